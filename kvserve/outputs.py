"""What callers get back: results of whole requests and chunks of streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sampler import TokenLogprobs


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

    @classmethod
    def from_chunks(cls, chunks: list[StreamChunk], prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """The whole result of a finished stream (its last chunk carries finish reason and usage)."""
        last = chunks[-1]
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
        return cls(
            request_id=last.request_id,
            prompt_token_ids=prompt_token_ids or [],
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            logprobs=logprobs or None,
            usage=last.usage,
        )
