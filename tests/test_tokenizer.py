"""kvserve's tokenizer, chat template and incremental detokenizer vs transformers, on the bundled GGUF."""

from __future__ import annotations

import copy
import random

import pytest

from kvserve.errors import UnsupportedModelError
from kvserve.text.chat_template import ChatTemplateError
from kvserve.text.detokenizer import IncrementalDetokenizer
from kvserve.text.tokenizer import Tokenizer
from tests.tokenizer_corpus import CONVERSATIONS, corpus

pytestmark = pytest.mark.bundled

CORPUS = corpus()


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf):
    return Tokenizer.from_gguf(bundled_gguf)


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 200


def test_token_ids_identical_to_transformers(tokenizer, hf_gguf_tokenizer):
    mismatches = [
        (text, tokenizer.encode(text), hf_gguf_tokenizer.encode(text))
        for text in CORPUS
        if tokenizer.encode(text) != hf_gguf_tokenizer.encode(text)
    ]
    assert not mismatches, f"{len(mismatches)} strings differ, first: {mismatches[0]!r}"


def test_decode_identical_to_transformers(tokenizer, hf_gguf_tokenizer):
    for text in CORPUS:
        ids = hf_gguf_tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == hf_gguf_tokenizer.decode(
            ids, skip_special_tokens=True
        ), text


def test_special_tokens_and_stop_ids(tokenizer, hf_gguf_tokenizer):
    assert tokenizer.eos_token_id == hf_gguf_tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == hf_gguf_tokenizer.bos_token_id
    assert 2 in tokenizer.stop_token_ids
    assert tokenizer.encode("<|im_end|>") == [2]  # spelled special tokens parse as one token
    assert tokenizer.vocab_size == len(hf_gguf_tokenizer)


@pytest.fixture(params=["token bytes", "windows"])
def detok_tokenizer(request, tokenizer):
    """The bundled tokenizer as the detokenizer sees it: with its table of token bytes (a byte-level
    BPE), or without (the path of a SentencePiece tokenizer: decoding windows of tokens)."""
    if request.param == "token bytes":
        assert tokenizer.token_bytes is not None
        return tokenizer
    windows = copy.copy(tokenizer)
    windows.__dict__["token_bytes"] = None  # in place of the cached table
    return windows


def test_token_bytes_decode_as_decode_does(tokenizer):
    """Every id alone, and random runs of ids (byte tokens among them, so partial and invalid UTF-8),
    with and without special tokens: joining the table's bytes gives `decode`'s text."""
    table = tokenizer.token_bytes
    assert len(table) == tokenizer.vocab_size
    for token_id in range(len(table)):
        assert table[token_id].decode("utf-8", errors="replace") == tokenizer.decode([token_id]), token_id
    rng = random.Random(5)
    for _ in range(300):
        ids = [
            rng.randrange(len(table)) if rng.random() < 0.5 else rng.randrange(300) for _ in range(rng.randrange(40))
        ]
        for skip in (False, True):
            joined = b"".join(table[i] for i in ids if not (skip and i in tokenizer.special_token_ids))
            assert joined.decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_reproduces_decode(detok_tokenizer, skip_special_tokens):
    tokenizer = detok_tokenizer
    for text in CORPUS:
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        pieces = [detok.add([token]) for token in ids]
        pieces.append(detok.flush())
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == full, text
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), f"a piece split a character in {text!r}"


def test_detokenizer_holds_back_partial_characters(detok_tokenizer):
    tokenizer = detok_tokenizer
    ids = tokenizer.encode("👩‍👩‍👧‍👦")
    assert len(ids) > 1  # byte-level pieces of one grapheme
    detok = IncrementalDetokenizer(tokenizer)
    emitted = [detok.add([t]) for t in ids]
    assert all(piece == "" or "\ufffd" not in piece for piece in emitted)
    assert "".join(emitted) + detok.flush() == "👩‍👩‍👧‍👦"


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_identical_to_transformers(tokenizer, hf_gguf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(messages, add_generation_prompt) == list(expected_ids)


# Other families' templates, shaped like the published ones (the parts without tools): each has its
# own markers, Qwen's a default system turn, Qwen3's namespaces and string methods; Phi-3 ends a
# conversation without a generation prompt with eos_token.
FAMILY_TEMPLATES = {
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
        "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    "qwen2.5": """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}""",
    "qwen3": """{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "assistant" and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}""",
}


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_templates_render_as_transformers_renders_them(
    tokenizer, hf_gguf_tokenizer, family, name, add_generation_prompt
):
    from kvserve.text.chat_template import ChatTemplate

    template, messages = FAMILY_TEMPLATES[family], CONVERSATIONS[name]
    if family == "qwen3":
        messages = [*messages, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nDone."}]
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = ChatTemplate(template, tokenizer.special_tokens).render(messages, add_generation_prompt)
    assert ours == expected
    assert "<|end|>" in ours or "<|im_end|>" in ours


def test_folder_tokenizer_matches_gguf_tokenizer(tokenizer, hf_gguf_tokenizer, tmp_path):
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    from_folder = Tokenizer.from_folder(tmp_path)
    for text in CORPUS:
        assert from_folder.encode(text) == tokenizer.encode(text), text
    messages = CONVERSATIONS["system-and-turns"]
    assert from_folder.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert from_folder.eos_token_id == tokenizer.eos_token_id


def test_template_errors_are_typed(tokenizer):
    template = tokenizer.chat_template
    broken = type(template)("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        broken.render([{"role": "user", "content": "x"}])


def test_model_without_template_says_so(bundled_gguf):
    plain = Tokenizer.from_gguf(bundled_gguf)
    plain.chat_template = None
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_long_text_encodes_as_a_short_one_would(tokenizer):
    """From LONG_TEXT characters a text is encoded in a batch of one, which lets go of the interpreter
    lock (the server's event loop runs meanwhile): the same ids as encoding it whole."""
    from kvserve.text.tokenizer import LONG_TEXT

    text = "Ünïcode ✓ 日本語, and plain words with  spaces.\n" * (LONG_TEXT // 40 + 1)
    assert len(text) >= LONG_TEXT
    for special in (True, False):
        assert tokenizer.encode(text, special) == tokenizer.backend.encode(text, add_special_tokens=special).ids
