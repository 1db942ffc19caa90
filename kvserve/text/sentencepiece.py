"""SentencePiece vocabularies stored in GGUF (`tokenizer.ggml.model == "llama"`) as a `tokenizers` backend.

Built the way transformers builds them from the same file (`transformers/integrations/gguf/
gguf_tokenizer_mapping.py`), so that token ids and decoded text are identical: a BPE model with
byte fallback whose merges are derived from the vocabulary, and, by architecture,

- Gemma: spaces become `▁` in a normalizer, no prefix space; all-space tokens are respelled with `▁`
  and merges are ranked by vocabulary position (Gemma's scores do not follow its merge order);
- Phi-3: a normalizer that prepends `▁` to every text segment and replaces spaces;
- others (Llama 2, Mistral, TinyLlama): a `Metaspace` pre-tokenizer prefixing the first segment.

One deliberate difference: a file that says `tokenizer.ggml.add_space_prefix = false` gets no prefix
space (llama.cpp honours the flag; transformers ignores it outside the Gemma path).
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from kvserve.weights.gguf_file import GGUFFile

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_GEMMA = {"gemma", "gemma2", "gemma3"}
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def sentencepiece_backend(gguf: GGUFFile) -> tuple[Backend, dict[str, str | None]]:
    """The backend (no post-processor) and the special tokens (bos/eos/unk/pad -> text) of a GGUF
    SentencePiece vocabulary."""
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
    token_types: list[int] = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    arch = gguf.get("general.architecture")
    gemma = arch in _GEMMA
    prefix = gguf.get("tokenizer.ggml.add_space_prefix", True) and not gemma

    if gemma:
        # Gemma stores runs of spaces as real spaces, but its normalizer turns text spaces into "▁".
        spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        spelled = tokens
        scores = gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(spelled)}
    file_merges = gguf.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in file_merges] if file_merges else _merges_from_scores(spelled, scores)

    special = {name: _token(gguf, tokens, key) for name, key in _SPECIAL_IDS.items()}
    unk = special["unk_token"] if gemma else None  # transformers sets an unk token on Gemma's model only
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[decoders.Decoder] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        replace = normalizers.Replace(" ", SPACE)
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    else:
        scheme = "first" if prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the prefix added
    backend.decoder = decoders.Sequence(steps)

    # Control tokens and the named special tokens are matched whole and skipped by
    # skip_special_tokens; user-defined ones (Gemma's "\n", "[multimodal]") are matched whole only.
    named = {t for t in special.values() if t is not None}
    control = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys([*control, *sorted(named)])]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab and t not in named
        ]
    )
    return backend, special


def _token(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = gguf.get(f"tokenizer.ggml.{key}")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists none (transformers' `generate_merges`): every
    split of a token into two vocabulary pieces, best-scored token first, then longer left piece."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        ranked.extend(sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]
