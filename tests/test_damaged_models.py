"""Model folders as users have them: damaged ones are one UnsupportedModelError naming the file's
problem (never a library's traceback: JSONDecodeError, KeyError, SafetensorError), and folders that
hold more than one copy of the weights load the copy transformers would, giving the same tokens."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError, UnsupportedModelError
from tests.conftest import wait_idle_and_check

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = [5, 6, 7, 8]


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        for name, value in changes.items():
            if value is None:
                config.pop(name)
            else:
                config[name] = value
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


DAMAGED = {
    "config.json not JSON": (_write("config.json", "{not json"), "JSONDecodeError"),
    "config.json a list": (_write("config.json", "[1, 2]"), "AttributeError"),
    "no hidden_size": (_edit_config(hidden_size=None), "KeyError: 'hidden_size'"),
    "zero heads": (_edit_config(num_attention_heads=0), "num_attention_heads is 0"),
    "no context": (_edit_config(max_position_embeddings=0), "max_position_embeddings is 0"),
    "fewer layers than the checkpoint": (_edit_config(num_hidden_layers=1), "has a layer 1, but its model has 1"),
    "truncated safetensors": (_truncate, "SafetensorError"),
    "tokenizer.json not JSON": (_write("tokenizer.json", "{1: 2}"), "key must be a string"),
    "tokenizer_config.json not JSON": (_write("tokenizer_config.json", "{"), "JSONDecodeError"),
    # every chat failed, its template's tokens blamed on the request: "Token id 257 is outside the vocabulary"
    "tokenizer larger than the model": (
        _edit_config(vocab_size=100),
        r"tokenizer has \d+ tokens, but its model only 100",
    ),
}


def _variant(tiny_model_dir: Path, tmp_path: Path, change: Callable[[Path], None]) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    change(folder)
    return folder


def _tokens(folder: Path) -> list[int]:
    with LLM(str(folder), dtype="float32", kv_cache_tokens=1024, session_db=False, progress=False) as llm:
        return llm.generate(PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_model_folder_is_one_typed_error_naming_its_problem(tiny_model_dir, tmp_path, name):
    change, says = DAMAGED[name]
    with pytest.raises(UnsupportedModelError, match=says) as refused:
        _tokens(_variant(tiny_model_dir, tmp_path, change))
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 600


def test_added_tokens_past_the_models_rows_load_with_a_warning_when_its_own_tokens_fit(
    tiny_model_dir, tmp_path, caplog
):
    """CodeLlama's tokenizer has 32004 tokens over 32000 rows, some Gemma folders one more than the
    model: refused, they could not be served at all. Only a tokenizer whose own tokens (EOS, what its
    chat template writes) are past the rows is refused; a prompt that spells out one that is past them
    gets a 400 (it failed in the model step)."""
    from tokenizers import Tokenizer

    def add_tokens(folder: Path) -> None:  # 259 tokens become 301, over the model's 300 rows
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend.add_tokens([f"<extra_{i}>" for i in range(42)])
        backend.save(str(folder / "tokenizer.json"))

    folder = _variant(tiny_model_dir, tmp_path, add_tokens)
    with caplog.at_level("WARNING", logger="kvserve.weights"):
        assert _tokens(folder) == _tokens(tiny_model_dir)
    assert "tokenizer has 301 tokens, but its model only 300" in caplog.text
    with LLM(str(folder), dtype="float32", kv_cache_tokens=1024, session_db=False, progress=False) as llm:
        assert llm.generate("<extra_40>", GREEDY).token_ids  # id 299: a row
        for prompt in ("<extra_41>", [5, 300]):  # id 300: none
            with pytest.raises(InvalidRequestError, match=r"[tT]oken id 300"):
                llm.generate(prompt, GREEDY)
        with pytest.raises(InvalidRequestError, match="<extra_41>"):
            llm.chat([{"role": "user", "content": "say <extra_41>"}], GREEDY)
        with llm.session() as session:  # refused before it is recorded: the session goes on
            with pytest.raises(InvalidRequestError, match="<extra_41>"):
                session.add_message("user", "say <extra_41>")
            session.add_message("user", "say <extra_40>")
            assert session.generate(GREEDY).token_ids
        wait_idle_and_check(llm)

    # its EOS (<|im_end|>, id 258) past the rows: every reply would fail
    with pytest.raises(UnsupportedModelError, match="and its EOS 258 is past them"):
        _tokens(_variant(tiny_model_dir, tmp_path / "eos", _edit_config(vocab_size=258)))


def test_the_copy_of_the_weights_transformers_reads_is_the_one_loaded(tiny_model_dir, tmp_path):
    """Mistral's repositories hold consolidated.safetensors beside model.safetensors; a folder resharded
    in place keeps a stale model.safetensors beside the shards its index names. Both loaded every file
    and were refused for tensors that have no place, or that come twice."""
    expected = _tokens(tiny_model_dir)
    weights = load_file(tiny_model_dir / "model.safetensors")

    def consolidated(folder: Path) -> None:
        save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, folder / "consolidated.safetensors")

    def resharded(folder: Path) -> None:
        names = sorted(weights)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({n: weights[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map = {n: file for file, part in halves.items() for n in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        save_file({"lm_head.weight": torch.zeros(3, 3)}, folder / "model.safetensors")  # stale, unlisted

    for name, change in (("consolidated", consolidated), ("resharded", resharded)):
        assert _tokens(_variant(tiny_model_dir, tmp_path / name, change)) == expected, name


def test_float64_weights_are_float_weights(tiny_model_dir, tmp_path):
    """float64 safetensors were taken for a quantized kind and rounded to int8 groups."""

    def widen(folder: Path) -> None:
        wide = {n: t.double() for n, t in load_file(folder / "model.safetensors").items()}
        save_file(wide, folder / "model.safetensors", metadata={"format": "pt"})

    assert _tokens(_variant(tiny_model_dir, tmp_path, widen)) == _tokens(tiny_model_dir)


def test_a_failure_that_is_not_the_files_is_not_called_damage(tiny_model_dir, monkeypatch):
    """Out of memory (on a GPU, torch's OutOfMemoryError), a file that cannot be opened, a compiler's
    error: raised as they are, never "its files are damaged, fetch the model again"."""
    from kvserve.weights import loader

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loader, "_materialize", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        loader.load_model(tiny_model_dir)


def test_one_part_of_a_split_gguf_says_to_merge_the_parts(tmp_path):
    """llama.cpp's gguf-split writes a model as several files; the first part said only that it lacked
    tensors."""
    path = tmp_path / "model-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_int32("split.tensors.count", 12)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"split into 2 files .* `llama-gguf-split --merge"):
        LLM(str(path), session_db=False, progress=False)


def test_a_folder_without_generation_config_stops_at_the_end_tokens_of_its_config(tiny_model_dir, tmp_path):
    """Llama 3 lists <|eot_id|> in config.json's eos_token_id; without a generation_config.json kvserve
    read none of them and chatted past the end of the turn, where transformers and vLLM stop."""
    free = SamplingParams(max_tokens=8, temperature=0)  # stops at a stop token
    expected = _tokens(tiny_model_dir)
    end = expected[2]  # the third greedy token, made an end token
    folder = _variant(tiny_model_dir, tmp_path, _edit_config(eos_token_id=[258, end]))
    (folder / "generation_config.json").unlink()  # transformers' save_pretrained wrote one
    with LLM(str(folder), dtype="float32", kv_cache_tokens=1024, session_db=False, progress=False) as llm:
        out = llm.generate(PROMPT, free)
        assert (out.token_ids, out.finish_reason) == (expected[:3], "stop")
        wait_idle_and_check(llm)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 258}))  # its list wins
    with LLM(str(folder), dtype="float32", kv_cache_tokens=1024, session_db=False, progress=False) as llm:
        assert llm.generate(PROMPT, free).token_ids == expected
        wait_idle_and_check(llm)
