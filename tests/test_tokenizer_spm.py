"""SentencePiece ('llama') GGUF tokenizers vs transformers loaded from the same file: the real Gemma 3
270M GGUF and a tiny Llama-2-style vocabulary written here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvserve.errors import UnsupportedModelError
from kvserve.text.tokenizer import Tokenizer
from kvserve.weights.registry import pull
from tests.tokenizer_corpus import CONVERSATIONS as SHARED_CONVERSATIONS
from tests.tokenizer_corpus import corpus

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SPACE = "\u2581"
GEMMA_TEXTS = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>twice<bos> <eos>x<pad>",
    "[multimodal] <mask> <unused0>",
    "  two leading, two trailing  ",
    "\t\ttabs\t and\n\n\nnewlines \n",
    "mixed 日本語 العربية 🙂 9999.5",
]
TINY_TEXTS = ["hello world", " the hello", "  lead", "trail  ", "<|end|>hello<s>the</s>", "<tool>in an er", "ü ß 12 A1"]
# The base Gemma 3 270M GGUF carries no chat template; this is the one Google ships with the
# instruction-tuned Gemma 3 checkpoints (a system message opens the first user turn).
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CONVERSATIONS = {name: SHARED_CONVERSATIONS[name] for name in ("single-user", "system-and-turns")}


# ----- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The Gemma 3 270M GGUF, fetched with `kvserve pull` semantics on first use."""
    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def gemma(gemma_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_gguf)


@pytest.fixture(scope="session")
def hf_gemma(gemma_gguf: Path):
    # Loaded once: transformers takes ~15 s to build Gemma's 262k vocabulary.
    return transformers.AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)


def write_tiny_spm(path: Path, add_space_prefix: bool = True, model: str = "llama", arch: str = "llama") -> Path:
    """A tiny Llama-2-style SentencePiece GGUF: <unk> <s> </s>, 256 byte tokens, a control and a
    user-defined token, then letters and `▁`-prefixed pieces whose scores rank the merges."""
    # Merged pieces first, in the order SentencePiece learned them (its scores rank the merges).
    pieces = [f"{SPACE}{c}" for c in "thwa"] + ["ll", "or", "ld", "in", "er", "an", "12", SPACE * 2]
    pieces += [f"{SPACE}th", f"{SPACE}the", "llo", f"{SPACE}he", f"{SPACE}hello", f"{SPACE}wor", f"{SPACE}world"]
    pieces += [SPACE, *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-()", "日"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|end|>", "<tool>", *pieces]
    types = [2, 3, 3, *[6] * 256, 3, 4, *[1] * len(pieces)]
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_spm(tmp_path_factory.mktemp("tiny-spm") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny(tiny_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_gguf)


# ----- helpers ----------------------------------------------------------------------------------
def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text)]


def backend_json(backend) -> dict:
    return json.loads(backend.to_str())


def encode_mismatches(ours: Tokenizer, hf, texts: list[str]) -> list[tuple]:
    return [
        (text, special, ours.encode(text, add_special_tokens=special), hf.encode(text, add_special_tokens=special))
        for text in texts
        for special in (True, False)
        if ours.encode(text, add_special_tokens=special) != hf.encode(text, add_special_tokens=special)
    ]


def decode_mismatches(ours: Tokenizer, hf, id_lists: list[list[int]]) -> list[tuple]:
    return [
        (ids, skip, ours.decode(ids, skip_special_tokens=skip), hf.decode(ids, skip_special_tokens=skip))
        for ids in id_lists
        for skip in (False, True)
        if ours.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip)
    ]


def id_lists(hf, texts: list[str], vocab_size: int) -> list[list[int]]:
    """The encodings of `texts` plus random id sequences (stray byte tokens, specials mid-text)."""
    rng = random.Random(0)
    return [hf.encode(t) for t in texts] + [[rng.randrange(vocab_size) for _ in range(12)] for _ in range(100)]


# ----- Gemma 3 ----------------------------------------------------------------------------------
def test_gemma_backend_identical_to_transformers(gemma, hf_gemma):
    """Every part of the backend (model, merges, normalizer, added tokens, decoder) serializes the same."""
    ours, theirs = backend_json(gemma.backend), backend_json(hf_gemma.backend_tokenizer)
    for part in theirs:
        assert ours[part] == theirs[part], part


def test_gemma_encode_identical_to_transformers(gemma, hf_gemma):
    mismatches = encode_mismatches(gemma, hf_gemma, corpus() + GEMMA_TEXTS)
    assert not mismatches, f"{len(mismatches)} differ, first: {mismatches[0]!r}"


def test_gemma_decode_identical_to_transformers(gemma, hf_gemma):
    ids = id_lists(hf_gemma, corpus() + GEMMA_TEXTS, len(hf_gemma))
    mismatches = decode_mismatches(gemma, hf_gemma, ids)
    assert not mismatches, f"{len(mismatches)} differ, first: {mismatches[0]!r}"


def test_gemma_special_tokens_and_no_space_prefix(gemma):
    assert (gemma.bos_token_id, gemma.eos_token_id) == (2, 1)
    assert gemma.vocab_size == 262144
    assert gemma.encode("<start_of_turn>user") == [2, 105, gemma.token_to_id("user")]
    # add_space_prefix is false: "Hello" is the unprefixed piece, a leading space its own.
    assert gemma.encode("Hello", add_special_tokens=False) == [gemma.token_to_id("Hello")]
    assert gemma.encode(" Hello", add_special_tokens=False) == [gemma.token_to_id(f"{SPACE}Hello")]
    assert gemma.decode(gemma.encode("  a\tb ")) == "<bos>  a\tb "
    # no eot id in the file: a chat turn still ends at <end_of_turn>, as llama.cpp recognizes it
    assert gemma.stop_token_ids == (1, gemma.token_to_id("<end_of_turn>"))
    assert gemma.token_bytes is None  # SentencePiece's decoder is no join of bytes: the detokenizer decodes windows


def test_gemma_base_gguf_has_no_chat_template(gemma):
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        gemma.apply_chat_template(CONVERSATIONS["single-user"])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_gemma_chat_template_identical_to_transformers(gemma, hf_gemma, name):
    messages = CONVERSATIONS[name]
    expected = hf_gemma.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=GEMMA3_CHAT_TEMPLATE
    )
    chat = Tokenizer(gemma.backend, special_tokens=gemma.special_tokens, chat_template=GEMMA3_CHAT_TEMPLATE)
    rendered = chat.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.startswith("<bos><start_of_turn>user\n") and rendered.endswith("<start_of_turn>model\n")
    if messages[0]["role"] == "system":  # Gemma has no system turn: it opens the first user turn
        assert rendered.startswith(f"<bos><start_of_turn>user\n{messages[0]['content']}\n\n{messages[1]['content']}")
    assert chat.encode_chat(messages) == hf_gemma.encode(expected, add_special_tokens=False)


# ----- tiny Llama-2-style vocabulary ------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # Phi-3 prefixes "▁" in a normalizer instead
def test_tiny_identical_to_transformers(tmp_path, arch):
    path = write_tiny_spm(tmp_path / f"{arch}.gguf", arch=arch)
    tiny, hf_tiny = Tokenizer.from_gguf(path), transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours, theirs = backend_json(tiny.backend), backend_json(hf_tiny.backend_tokenizer)
    for part in theirs:
        assert ours[part] == theirs[part], part
    texts = corpus() + TINY_TEXTS
    mismatches = encode_mismatches(tiny, hf_tiny, texts) + decode_mismatches(
        tiny, hf_tiny, id_lists(hf_tiny, texts, len(hf_tiny))
    )
    assert not mismatches, f"{len(mismatches)} differ, first: {mismatches[0]!r}"


def test_tiny_space_prefix_and_byte_fallback(tiny):
    # add_space_prefix: the first word gets "▁" like every later one; decode removes it again.
    assert pieces(tiny, "hello world") == ["<s>", f"{SPACE}hello", f"{SPACE}world"]
    assert pieces(tiny, "<|end|>the") == ["<s>", "<|end|>", "t", "h", "e"]  # prefix on the text's start only
    # A character missing from the vocabulary is spelled with its UTF-8 byte tokens.
    assert pieces(tiny, "ü") == ["<s>", SPACE, "<0xC3>", "<0xBC>"]
    for text in ["hello world", "ü ß 日", "trail  ", "a\nb"]:
        assert tiny.decode(tiny.encode(text), skip_special_tokens=True) == text
    # As in transformers (tokenizers' Metaspace), text that starts with a space gets no second one.
    assert tiny.encode(" lead") == tiny.encode("lead")
    assert tiny.decode(tiny.encode("hi</s>")) == "<s> hi</s>"


def test_add_space_prefix_false_is_honoured(tmp_path):
    """llama.cpp's reading of the flag; transformers ignores it outside Gemma (the one known difference)."""
    plain = Tokenizer.from_gguf(write_tiny_spm(tmp_path / "plain.gguf", add_space_prefix=False))
    assert pieces(plain, "hello world") == ["<s>", "h", "e", "llo", f"{SPACE}world"]
    assert plain.decode(plain.encode(" hello"), skip_special_tokens=True) == " hello"


def test_unsupported_tokenizer_kind_says_what_to_do(tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"'bert' is not supported.*Hugging Face folder"):
        Tokenizer.from_gguf(write_tiny_spm(tmp_path / "bert.gguf", model="bert"))
