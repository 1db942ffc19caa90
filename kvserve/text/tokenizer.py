"""Tokenizer: a Hugging Face `tokenizers` backend built from GGUF metadata or a model folder.

`encode` and `decode` behave like transformers' tokenizer for the same model (same ids, special
tokens spelled in text are parsed as special tokens, BOS added when the model asks for it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvserve.errors import InvalidRequestError, UnsupportedModelError, check_text, reads_model_files
from kvserve.text.chat_template import ChatTemplate
from kvserve.text.sentencepiece import sentencepiece_backend
from kvserve.weights.gguf_file import GGUFFile, open_gguf

# How text is split before BPE, by GGUF `tokenizer.ggml.pre`. These are the published split
# rules of each tokenizer family (tiktoken's cl100k for Llama 3, Qwen2's variant with single digits).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>")
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


LONG_TEXT = 16 << 10  # characters from which a text is encoded in a batch of one (see encode)


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: dict[str, str | None],
        chat_template: str | None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # bos_token, eos_token, unk_token, pad_token -> text
        self.chat_template = ChatTemplate(chat_template, special_tokens) if chat_template else None
        eos = self.eos_token_id
        self.stop_token_ids = tuple(dict.fromkeys([*([eos] if eos is not None else []), *stop_token_ids]))
        self.model_rows: int | None = None  # see keep_below

    def keep_below(self, model_rows: int) -> None:
        """Refuse text that encodes to an id the model has no row for: a tokenizer may have a few more
        added tokens than its model (CodeLlama's 32004 over 32000), and only a text that spells one out
        meets them."""
        self.model_rows = model_rows if self.vocab_size > model_rows else None

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | Path) -> Tokenizer:
        if not isinstance(gguf, GGUFFile):
            gguf = open_gguf(gguf)
        kind = gguf.get("tokenizer.ggml.model")
        if kind == "llama":
            backend, special = sentencepiece_backend(gguf)
        elif kind == "gpt2":
            backend, special = _byte_level_backend(gguf)
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported yet; kvserve builds byte-level BPE ('gpt2') "
                "and SentencePiece ('llama') tokenizers from GGUF. Use the model's Hugging Face folder "
                "(tokenizer.json) instead."
            )
        _set_post_processor(
            backend,
            special,
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos=bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        )
        extra_stops = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        # A file without an eot id still ends a chat turn with its template's special token, which
        # llama.cpp recognizes by its text (Gemma's <end_of_turn>, Phi-3's <|end|>).
        special_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        extra_stops += [special_ids[t] for t in _END_OF_TURN if t in special_ids]
        return cls(
            backend,
            special_tokens=special,
            chat_template=gguf.get("tokenizer.chat_template"),
            stop_token_ids=[i for i in extra_stops if i is not None],
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise UnsupportedModelError(f"{path} has no tokenizer.json; kvserve needs the fast-tokenizer file.")
        backend = Backend.from_file(str(tokenizer_json))
        config = _read_json(path / "tokenizer_config.json")
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_post_processor(
                backend,
                special,
                add_bos=config.get("add_bos_token", False),
                add_eos=config.get("add_eos_token", False),
            )
        template_file = path / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text()
        elif isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # The model's end tokens as transformers and vLLM read them: generation_config.json's, else (no
        # such file, or no eos_token_id in it) config.json's, where Llama 3 lists <|eot_id|> beside EOS.
        generation = _read_json(path / "generation_config.json")
        stops = generation.get("eos_token_id")
        if stops is None:
            stops = _read_json(path / "config.json").get("eos_token_id")
        stops = [stops] if isinstance(stops, int) else stops if isinstance(stops, list) else []
        return cls(
            backend,
            special_tokens=special,
            chat_template=template,
            stop_token_ids=[i for i in stops if isinstance(i, int) and not isinstance(i, bool)],
        )

    @classmethod
    @reads_model_files
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        return cls.from_folder(path) if path.is_dir() else cls.from_gguf(path)

    # ----- use ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text = check_text(text, "prompt")
        if len(text) < LONG_TEXT:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            # encode_batch lets go of the interpreter lock while it works (encode holds it): a long prompt,
            # tokenized on the server's worker thread, then does not stall the event loop's streams
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        rows = self.model_rows
        past = None if rows is None else next((i for i in ids if i >= rows), None)
        if past is not None:
            raise InvalidRequestError(
                f"The text holds {self.backend.id_to_token(past)!r:.60} (token id {past}), which this model has no "
                f"row for: its tokenizer has {self.vocab_size} tokens, the model {rows}. Leave that token out.",
                "prompt",
            )
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text, as transformers' apply_chat_template does."""
        if self.chat_template is None:
            raise UnsupportedModelError(
                "This model has no chat template (it is a base model); send a plain prompt instead of messages."
            )
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """`kwargs` are more template variables (`tools=[...]`, as transformers passes them)."""
        # The template writes BOS itself where the model wants one; encoding adds no second one.
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def token_bytes(self) -> list[bytes] | None:
        """Each id's bytes, for a tokenizer whose decoding is joining them and reading the result as
        UTF-8 (a byte-level BPE: its decoder is ByteLevel alone), else None. A token spelled in GPT-2's
        byte alphabet is those bytes; another (an added token such as "<|im_end|>" may be) is its own
        UTF-8, as the ByteLevel decoder does."""
        if type(self.backend.decoder) is not decoders.ByteLevel:
            return None
        inverse = {char: byte for byte, char in _byte_alphabet().items()}
        table = []
        for token_id in range(self.vocab_size):
            token = self.backend.id_to_token(token_id) or ""
            spelled = [inverse.get(char) for char in token]
            table.append(token.encode("utf-8") if None in spelled else bytes(spelled))
        return table

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids that `decode(..., skip_special_tokens=True)` leaves out."""
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @cached_property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @cached_property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))


def _byte_level_backend(gguf: GGUFFile) -> tuple[Backend, dict[str, str | None]]:
    """The backend (no post-processor) and special tokens of a GGUF byte-level BPE ('gpt2') vocabulary."""
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
    token_types: list[int] = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token written with characters outside the byte alphabet is respelled byte by byte.
    vocab = {
        (tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges", [])]
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL and set(tok) <= spelled
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab
        ]
    )

    def token(key: str) -> str | None:
        token_id = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    return backend, special


def _set_post_processor(backend: Backend, special: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    tokens = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
