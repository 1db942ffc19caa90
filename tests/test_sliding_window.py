"""A Mistral-style model with a sliding window shorter than its context: until sliding-window
attention is implemented, kvserve serves contexts up to the window, where it equals full attention
exactly, and refuses longer ones with a typed error, never silently attending past the window."""

import pytest
import torch

from kvserve import LLM, InvalidRequestError, SamplingParams
from tests.conftest import TINY_LLAMA, wait_idle_and_check, write_byte_tokenizer

transformers = pytest.importorskip("transformers")
WINDOW = 12


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral")
    torch.manual_seed(3)
    config = transformers.MistralConfig(**{**TINY_LLAMA, "sliding_window": WINDOW, "initializer_range": 0.2})
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path, model


def test_the_context_is_capped_to_the_window_and_equals_transformers_inside_it(mistral_dir):
    path, reference = mistral_dir
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    with LLM(path, dtype="float32", session_db=False) as llm:
        assert llm.model.config.sliding_window == WINDOW
        assert llm.config.max_model_len == WINDOW
        out = llm.generate(prompt, SamplingParams(max_tokens=WINDOW - len(prompt), temperature=0, ignore_eos=True))
        with pytest.raises(InvalidRequestError, match="context"):
            llm.generate(list(range(1, WINDOW + 1)), SamplingParams(max_tokens=1))
        wait_idle_and_check(llm)
    expected = reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=WINDOW - len(prompt),
        do_sample=False,
        min_new_tokens=WINDOW - len(prompt),
    )[0, len(prompt) :].tolist()
    assert out.token_ids == expected
