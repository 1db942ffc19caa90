"""What callers get back: results of whole requests and chunks of streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sampler import TokenLogprobs


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class StreamChunk:
    """A piece of a stream: new text (possibly empty), new token ids; finish_reason on the last."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    usage: Usage | None = None  # on the last chunk


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    usage: Usage | None = None
