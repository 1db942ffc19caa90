"""Request: a prompt catching up with its tokens. `num_computed_tokens` chases `num_tokens`."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.grammar import Grammar


class RequestStatus(enum.IntEnum):
    """Ordered: every status after RUNNING is finished."""

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASON_OF = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    stop_reason: int | str | None = None
    prefill_only: bool = False  # compute the prompt's KV and finish without sampling (eager session prefill)
    grammar: Grammar | None = None  # its structured output's matcher (engine/grammar.py), set when admitted
    is_paused: bool = False  # held out of the batch: its reader is not keeping up (Scheduler.pause)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building all of it: a decode step's one token costs the
        same at any length of the conversation."""
        prompt = self.prompt_token_ids
        split = len(prompt)
        if end <= split:
            return prompt[start:end]
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        return prompt[start:] + self.output_token_ids[: end - split]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_ready(self) -> bool:
        """Whether it may be scheduled: False while its grammar compiles or while it is paused."""
        return not self.is_paused and (self.grammar is None or self.grammar.is_ready)

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASON_OF.get(self.status)
