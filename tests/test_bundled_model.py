"""The registered GGUFs (the default SmolLM2, and Gemma 3 270M, a second architecture with a
SentencePiece vocabulary) loaded by kvserve (dequantized, and kept quantized) and by transformers
(dequantized, float32): greedy tokens agree.

First-divergence rule (DESIGN.md): up to the first differing token both runs agree; at that
position each run's token must be in the other's top-5 (the logits there are conditioned on the
same prefix, so this is a near-tie, not a bug). After a divergence the runs are not compared.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.llm import default_dtype
from kvserve.text.tokenizer import Tokenizer
from kvserve.weights.loader import load_model
from kvserve.weights.plan import resolve_activations
from kvserve.weights.registry import DEFAULT_MODEL, pull
from tests.simple_generate import prompt_logits, stream_token_ids

pytestmark = pytest.mark.bundled
transformers = pytest.importorskip("transformers")

NUM_TOKENS = 48
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Describe the sea."}],
    [{"role": "user", "content": "Translate to French: The cat sleeps on the warm windowsill."}],
    [{"role": "user", "content": "List three uses of a KV cache in LLM inference, briefly."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]
COMPLETIONS = [  # plain completion, no template
    "Once upon a time, in a village at the edge of the forest,",
    "def fibonacci(n):\n    ",
]
PROMPTS = {  # registered model -> its prompts (Gemma 3 270M is a base model: completions only)
    DEFAULT_MODEL: CHAT_PROMPTS + COMPLETIONS,
    "gemma3-270m": [
        *COMPLETIONS,
        "The three primary colours are",
        "Die Hauptstadt von Deutschland ist Berlin. La capitale de la France est",
    ],
}
CASES = [(name, index) for name, prompts in PROMPTS.items() for index in range(len(prompts))]


# (weights, dtype[, activations]): dequantized float32 (the foundation check), then served quantized
# as `auto` keeps them (int4 layers, the Q8_0 embedding/lm_head table) in both compute dtypes, and
# with the int4 layers' inputs quantized to int8 (an AVX2 CPU; float inputs elsewhere).
FORMS = {
    "f32": ("float", torch.float32),
    "auto-f32": ("auto", torch.float32),
    "auto-bf16": ("auto", torch.bfloat16),
    "auto-f32-int8-activations": ("auto", torch.float32, "int8"),
    # what LLM() runs on this machine: on an AVX-512 BF16 CPU int4 layers and lm_head with int8 inputs
    "default": ("auto", default_dtype(torch.device("cpu")), resolve_activations("auto", torch.device("cpu"), "auto")),
}


_references: dict[str, object] = {}


def _reference(name: str, path):
    """transformers' model from the same GGUF, loaded once (1.1 GB in float32 for Gemma)."""
    if name not in _references:
        _references[name] = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    return _references[name]


@pytest.fixture(scope="module", params=list(FORMS))
def form(request):
    return request.param


_loaded: dict[tuple[str, str], tuple] = {}


def _models(name: str, form: str) -> tuple:
    """(kvserve's model in `form`, its tokenizer, transformers' reference), the last pair kept."""
    if (name, form) not in _loaded:
        _loaded.clear()
        path = pull(name, progress=False)
        weights, dtype, activations = (*FORMS[form], "float")[:3]
        ours = load_model(path, dtype, progress=False, weights=weights, activations=activations)
        _loaded[(name, form)] = (ours, Tokenizer.from_gguf(path), _reference(name, path))
    return _loaded[(name, form)]


_expected: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _reference_greedy(name: str, reference, prompt_ids: list[int]) -> list[int]:
    key = (name, tuple(prompt_ids))
    if key in _expected:  # the same reference serves every form
        return _expected[key]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,  # compare all 48 positions even past an end-of-turn token
            do_sample=False,
            pad_token_id=0,
        )
    _expected[key] = out[0, len(prompt_ids) :].tolist()
    return _expected[key]


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_greedy_tokens_agree_with_transformers(form, name, index):
    ours, tokenizer, reference = _models(name, form)
    prompt = PROMPTS[name][index]
    prompt_ids = tokenizer.encode_chat(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    expected = _reference_greedy(name, reference, prompt_ids)
    got = list(stream_token_ids(ours, prompt_ids, NUM_TOKENS))
    assert len(got) == len(expected) == NUM_TOKENS
    divergence = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    if divergence is None:
        return
    context = prompt_ids + got[:divergence]
    our_top5 = prompt_logits(ours, context)[-1].topk(5).indices.tolist()
    with torch.no_grad():
        ref_top5 = reference(torch.tensor([context])).logits[0, -1].topk(5).indices.tolist()
    assert expected[divergence] in our_top5 and got[divergence] in ref_top5, (
        f"diverged at token {divergence}: ours {got[divergence]} (top5 {our_top5}), "
        f"transformers {expected[divergence]} (top5 {ref_top5})"
    )
