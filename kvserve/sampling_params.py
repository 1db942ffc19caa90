"""SamplingParams: how one request samples and when it stops. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        # Accept a single string / any iterable for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}.", param=name)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "must be between 0 and 100 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be -1, 0 (no limit) or a positive integer")
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
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            fail("seed", "must be a non-negative integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be a non-negative integer")
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"must be between 0 and {MAX_LOGPROBS}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
