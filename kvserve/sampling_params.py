"""SamplingParams: how one request samples and when it stops. Validated on construction."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError, check_text
from kvserve.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # top_k and the token counts: the engine's counters and tensors are int32-safe
MAX_SEED = 2**63 - 1  # a seed is a signed 64-bit integer, as OpenAI's and torch's generators take it
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
# Temperatures below this sample greedily, as vLLM's do: there a draw is the argmax unless another logit
# lies within about 1e-4 of it, and below about 1e-38 logits / T overflow float32, which made the draws
# of rows with top-k or top-p garbage and a plain row's the first of several infinite scores.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; N: chosen token plus the top N
    skip_special_tokens: bool = True
    # Added to the named tokens' logits before sampling (OpenAI's logit_bias: -100 bans, 100 forces);
    # a dict {token id: bias} is kept as (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # The output must match this grammar (a JSON schema, ...): the engine masks every other token.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept a single string / any iterable for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("max_tokens", "top_k", "seed", "min_tokens", "logprobs"):  # numpy's integers are integers
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool | int):
                object.__setattr__(self, name, int(value))
        bias = self.logit_bias
        for name, value, what in (
            ("stop", self.stop, "a string or a list of strings"),
            ("stop_token_ids", self.stop_token_ids, "a list of token ids"),
            ("logit_bias", bias.items() if isinstance(bias, dict) else bias, "a dict {token id: bias}"),
        ):
            if not isinstance(value or (), Iterable) or (name != "stop" and isinstance(value, str | bytes)):
                raise InvalidRequestError(f"{name} must be {what}, got {value!r:.80}.", name)
            object.__setattr__(self, name, tuple(value or ()))
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            value = getattr(self, name)
            too_long = isinstance(value, int) and value.bit_length() > 64  # repr() refuses past 4,300 digits
            shown = f"an integer of {value.bit_length()} bits" if too_long else repr(value)[:80]
            raise InvalidRequestError(f"{name} {rule}, got {shown}.", param=name)

        def is_int(name: str, low: int, high: int) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's floats are Real
                fail(name, "must be a number")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be true or false")

        if not is_int("max_tokens", 1, MAX_INT32):
            fail("max_tokens", f"must be an integer from 1 to {MAX_INT32}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be between 0 and 100 (0, or below {GREEDY_BELOW:g}, is greedy)")
        if not is_int("top_k", -1, MAX_INT32):
            fail("top_k", f"must be -1, 0 (no limit) or a positive integer up to {MAX_INT32}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be between -2 and 2")
        if self.seed is not None and not is_int("seed", 0, MAX_SEED):
            fail("seed", f"must be an integer from 0 to {MAX_SEED}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        for s in self.stop:
            check_text(s, "stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be integers from 0 to {MAX_INT32}")
        if not is_int("min_tokens", 0, MAX_INT32):
            fail("min_tokens", f"must be an integer from 0 to {MAX_INT32}")
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not is_int("logprobs", 0, MAX_LOGPROBS):
            fail("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        self._validate_logit_bias()
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):  # as a dict: the last one wins
            object.__setattr__(self, "logit_bias", tuple(dict(self.logit_bias).items()))
        self._validate_structured_output()

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are accepted.", "logit_bias"
            )
        for entry in bias:
            token, value = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            if not (isinstance(token, int) and not isinstance(token, bool) and 0 <= token <= MAX_INT32):
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers from 0 to {MAX_INT32}), got {token!r:.80}.",
                    "logit_bias",
                )
            if not (isinstance(value, int | float) and not isinstance(value, bool) and -100.0 <= value <= 100.0):
                raise InvalidRequestError(
                    f"logit_bias values must be numbers from -100 to 100, got {value!r:.80} for token {token}.",
                    "logit_bias",
                )

    def _validate_structured_output(self) -> None:
        """A grammar decides where the output ends: what would cut it elsewhere is refused."""
        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a StructuredOutput.", "structured_output")
        for name, conflict in (
            ("stop", self.stop),
            ("stop_token_ids", self.stop_token_ids),
            ("min_tokens", self.min_tokens),
        ):
            if conflict:
                source = (
                    "tools whose calls a grammar writes (a required or named call, or any call in the generic "
                    "format, which models whose template has no tools use)"
                    if self.structured_output.kind == "tool_calls"
                    else "response_format (structured_output in Python)"
                )
                raise InvalidRequestError(
                    f"{name} cannot be combined with structured output, here from {source}: the grammar decides "
                    f"where the output ends, and it must end where the grammar is complete. Remove {name}.",
                    name,
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def checked_params(params: object, default: SamplingParams | None = None) -> SamplingParams:
    """`params`, or `default` (SamplingParams()) for None; anything but a SamplingParams is an
    InvalidRequestError (a dict, the class itself)."""
    if params is None:
        return default or SamplingParams()
    if not isinstance(params, SamplingParams):
        shown = "the SamplingParams class" if params is SamplingParams else f"a {type(params).__name__}"
        raise InvalidRequestError(
            f"params must be a SamplingParams, such as SamplingParams(max_tokens=64, temperature=0), got {shown}.",
            "params",
        )
    return params
