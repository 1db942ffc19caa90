"""Scheduler: continuous batching over the block pool.

A request is `num_computed_tokens` catching up with `num_tokens`. Each step, running requests
first and then waiting ones get up to `num_tokens - num_computed_tokens` new tokens, within a
per-step token budget: a whole prompt, a chunk of it (chunked prefill), or one decode token are
the same rule. Prefix-cache hits start a request with blocks (and computed tokens) already in
place. When blocks run out, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later from its tokens, which gives the same output.

A step may still be computing when the next is scheduled (a pipeline of stages, engine/core.py):
its requests are in flight until `update_from_output` takes its result, and meanwhile they are
neither scheduled again nor preempted; `schedule(max_num_scheduled)` splits the rest into
micro-batches.

A runner that runs ahead (async scheduling, `run_ahead`: one GPU step queued while the host takes
back the one before) may get a request again while its step computes. Behind a sampling step: one
decode token at the position of the token being sampled, whose id the runner takes on the device
(`AHEAD`). Only where nothing about the next step depends on that token's value on the host: no
grammar, no penalties, min_tokens reached, and the pending token cannot end it by length. If it ends
it otherwise (a stop token or string, an abort), the step ahead is computed and its token dropped.
Behind a chunk of a prompt (or of a preempted request's tokens): the next chunk, whose tokens the
host knows (an abort meanwhile: both chunks are computed, into blocks freed at once, which every
later use reaches only after them on the device's stream). Requests go ahead only when every one in
flight can (or ends with its step in flight): one that must wait for its token on the host would
otherwise be left out of every other step. And only when the free blocks cover all their steps
ahead, which never reclaim nor preempt: when the pool runs short the engine takes its steps in turn
again, and preemption picks the newest request as above.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.block_pool import BlockPool, hash_full_blocks
from kvserve.engine.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

# The token id of a step scheduled ahead: the runner takes it on the device from the step in flight.
AHEAD = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step. Plain data: what the runner needs, nothing it may mutate."""

    request_id: str
    token_ids: list[int]  # the new tokens computed this step
    num_computed_tokens: int  # tokens already in the KV blocks
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the end of the known tokens: sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The tokens its grammar allows next (a torch int32 tensor, one bit per token id), set by the
    # engine before the step runs on the rows that sample under a grammar (engine/grammar.py).
    token_bitmask: Any = None
    # Scheduled ahead of a sampling step: token_ids is [AHEAD], the token its step in flight samples
    # (run_ahead). A chunk scheduled ahead of a chunk has its token ids, and False here.
    ahead: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # The scheduler's own record of which Request each item was (a finished request's id may come
    # back for a new one before this step's result does); the runner never reads it.
    requests: dict[str, Request] = field(default_factory=dict, repr=False)

    def only(self, item: ScheduledRequest) -> SchedulerOutput:
        """This step's share of one of its requests, as a step of its own."""
        return SchedulerOutput(scheduled=[item], requests={item.request_id: self.requests[item.request_id]})

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    generation_tokens_total: int = 0


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: set[Request] = set()  # scheduled in a step whose result has not come back
        self.run_ahead = False  # the runner takes a pending token on the device (async scheduling)
        self.sampling: set[Request] = set()  # in flight in a step that samples its next token
        self.ahead: set[Request] = set()  # in flight twice: a step ahead queued behind its step in flight
        self.tokens_in_flight: dict[Request, int] = {}  # per request in flight, its steps' tokens
        self.stats = SchedulerStats()
        # Called with a number of blocks when the pool is short, before anything is preempted
        # (sessions unpin idle conversations here).
        self.reclaim: Callable[[int], None] | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_ready_work(self) -> bool:
        """Whether a request could be scheduled now: one waiting (and ready), one running not in flight,
        or one in flight that may go ahead."""
        return (
            len(self.running) > len(self.in_flight)
            or any(r.is_ready for r in self.waiting)
            or (self._goes_ahead() and any(self._may_go_ahead(r) for r in self.in_flight))
        )

    @property
    def num_paused(self) -> int:
        return sum(request.is_paused for request in self.requests.values())

    def pause(self, request_ids: Iterable[str], paused: bool = True) -> None:
        """Hold requests out of the batch (a stream whose client does not read) or let them back. A
        paused request keeps its place and its tokens; the next schedule that finds it running, and
        not in flight, frees its KV blocks and puts it back at the front of the queue, where it is
        skipped until resumed, and then recomputed (the same output). Unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.is_paused = paused

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.stats.prompt_tokens_total += request.num_prompt_tokens

    # ----- one step -------------------------------------------------------------------------
    def schedule(self, max_num_scheduled: int | None = None) -> SchedulerOutput:
        """The next step: at most `max_num_scheduled` requests (None: as many as fit), none of those
        in flight, which are then in flight until `update_from_output` takes this step's result."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        room = max_num_scheduled if max_num_scheduled is not None else len(self.running) + len(self.waiting)
        ahead = self._goes_ahead()
        index = 0
        while index < len(self.running) and budget > 0 and len(out.scheduled) < room:
            request = self.running[index]
            if request in self.in_flight:
                if ahead and self._may_go_ahead(request):
                    num_new = self._tokens_ahead(request, budget)
                    if self._allocate_slots(request, num_new, ahead=True):
                        out.scheduled.append(self._scheduled(request, num_new, ahead=request in self.sampling))
                        budget -= num_new
                index += 1
                continue
            if request.is_paused:  # out of the batch, its blocks back in the pool, its place kept
                self.running.pop(index)
                self._free_blocks(request)
                request.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(request)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._allocate_slots(request, num_new):
                victim = self._pop_victim(index)
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1
                continue
            break

        unready: list[Request] = []  # waiting for their grammars: skipped, and kept in their places
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted_ids
            and len(out.scheduled) < room
        ):
            request = self.waiting[0]
            if not request.is_ready:
                unready.append(self.waiting.popleft())
                continue
            hit_blocks = []
            if request.num_computed_tokens == 0:
                hit_blocks = self._lookup_prefix(request)
                self.pool.touch(hit_blocks)
            num_hit_blocks = len(hit_blocks)
            num_computed = num_hit_blocks * self.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            request.block_ids = list(hit_blocks)
            request.num_computed_tokens = num_computed
            if not self._allocate_slots(request, num_new):
                self.pool.free(hit_blocks)
                request.block_ids, request.num_computed_tokens = [], 0
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
                self.stats.prefix_cache_hit_tokens_total += num_computed
            request.num_cached_blocks = num_hit_blocks
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(unready))
        return self._launched(out)

    def _launched(self, out: SchedulerOutput) -> SchedulerOutput:
        for item in out.scheduled:
            request = self.requests[item.request_id]
            out.requests[item.request_id] = request
            if request in self.in_flight:
                self.ahead.add(request)
            self.in_flight.add(request)
            self.tokens_in_flight[request] = self.tokens_in_flight.get(request, 0) + len(item.token_ids)
            if item.sample:
                self.sampling.add(request)
        return out

    def _goes_ahead(self) -> bool:
        """Whether requests in flight may get steps ahead now: every one of them can or needs none, and
        the free blocks cover all their steps ahead. Otherwise none goes ahead: their steps come back,
        and the next schedule preempts as without async scheduling, the newest request first (one that
        missed its block while the others ran ahead would be in flight never, and preempt itself)."""
        if not self.run_ahead:
            return False
        needed = 0
        for request in self.in_flight:
            if self._may_go_ahead(request):
                num_new = self._tokens_ahead(request, self.max_num_batched_tokens)
                needed += max(0, self._blocks_needed(request, num_new))
            elif not self._ends_in_flight(request):
                return False
        return needed <= self.pool.num_free_blocks

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether its step in flight ends the request: the token it samples by length, or the last
        chunk of a prefill-only request."""
        if request in self.ahead:  # in flight twice: its first step does not end it
            return False
        if request in self.sampling:
            return (
                request.num_output_tokens + 1 >= request.params.max_tokens
                or request.num_tokens + 1 >= self.max_model_len
            )
        return request.prefill_only and self._tokens_left(request) == 0

    def _may_go_ahead(self, request: Request) -> bool:
        """Whether a request in flight may get a step ahead: behind a step that samples, where the next
        step needs nothing on the host from that token (see the module's docstring); behind a chunk,
        where tokens are left."""
        if request in self.ahead or request.is_paused:
            return False
        if request not in self.sampling:
            return self._tokens_left(request) > 0
        params = request.params
        return (
            request.grammar is None
            and not params.has_penalties
            and params.min_tokens <= request.num_output_tokens
            and request.num_output_tokens + 1 < params.max_tokens
            and request.num_tokens + 1 < self.max_model_len
        )

    def _tokens_ahead(self, request: Request, budget: int) -> int:
        """The tokens of a step ahead within `budget`: the one its sampling step in flight samples, or
        the next chunk of its known tokens."""
        return 1 if request in self.sampling else min(self._tokens_left(request), budget)

    def _tokens_left(self, request: Request) -> int:
        """Known tokens that neither its KV blocks hold nor a step in flight computes."""
        return request.num_tokens - request.num_computed_tokens - self.tokens_in_flight.get(request, 0)

    def _returned(self, request: Request, num_tokens: int) -> None:
        """One of a request's steps (of num_tokens) came back: it stays in flight while its step ahead
        computes."""
        left = self.tokens_in_flight.pop(request, 0) - num_tokens
        if left > 0:
            self.tokens_in_flight[request] = left
        if request in self.ahead:
            self.ahead.discard(request)
        else:
            self.in_flight.discard(request)
            self.sampling.discard(request)

    def _pop_victim(self, index: int) -> Request:
        """The running request to preempt for running[index]: the most recently admitted one not in
        flight (never one scheduled already in this step: those come before `index`), running[index]
        itself if all the others are."""
        victim = next(i for i in range(len(self.running) - 1, index - 1, -1) if self.running[i] not in self.in_flight)
        return self.running.pop(victim)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a stop rule; the
        step's requests are no longer in flight.

        Returns the requests that got a new token this step (finished ones included), and
        prefill-only requests that completed.
        """
        updated = []
        for item in out.scheduled:
            request = out.requests[item.request_id]
            self._returned(request, len(item.token_ids))
            if request.is_finished or self.requests.get(item.request_id) is not request:
                continue
            request.num_computed_tokens += len(item.token_ids)
            self._cache_computed_blocks(request)
            if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                updated.append(request)
                continue
            if not item.sample:
                continue
            token = sampled[item.request_id]
            request.output_token_ids.append(token)
            self.stats.generation_tokens_total += 1
            status = self._check_stop(request, token)
            if status is not None:
                grammar = request.grammar
                self.finish(request, status)
                if status is RequestStatus.FINISHED_LENGTH:  # the engine feeds it this last token (core.py)
                    request.grammar = grammar
            updated.append(request)
        return updated

    # ----- finishing ------------------------------------------------------------------------
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests wherever they are (waiting or running). Unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self.finish(request, status)
                finished.append(request)
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The one place a request leaves: its blocks are freed and it is forgotten."""
        assert status.is_finished
        self.in_flight.discard(request)
        self.sampling.discard(request)
        self.ahead.discard(request)
        self.tokens_in_flight.pop(request, None)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._free_blocks(request)
        request.grammar = None  # its matcher goes with it
        del self.requests[request.request_id]

    def check_integrity(self) -> None:
        """The bookkeeping of steps in flight: running requests only, each with its tokens in flight."""
        assert self.tokens_in_flight.keys() == self.in_flight, (self.tokens_in_flight, self.in_flight)
        assert self.sampling <= self.in_flight and self.ahead <= self.in_flight
        for request in self.in_flight:
            assert request.status == RequestStatus.RUNNING and self.requests.get(request.request_id) is request
            assert self.tokens_in_flight[request] > 0, request.request_id

    # ----- internals ------------------------------------------------------------------------
    def _scheduled(self, request: Request, num_new: int, ahead: bool = False) -> ScheduledRequest:
        """The request's next num_new tokens, past those of its step in flight if any; `ahead`: the one
        token its step in flight samples, at that token's position."""
        start = request.num_computed_tokens + self.tokens_in_flight.get(request, 0)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=[AHEAD] if ahead else request.token_ids_between(start, start + num_new),
            num_computed_tokens=start,
            block_ids=list(request.block_ids),
            sample=ahead or (start + num_new == request.num_tokens and not request.prefill_only),
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            ahead=ahead,
        )

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        """Blocks the request lacks for num_new more tokens (past those of its step in flight); <= 0: none."""
        computed = request.num_computed_tokens + self.tokens_in_flight.get(request, 0)
        return -(-(computed + num_new) // self.block_size) - len(request.block_ids)

    def _allocate_slots(self, request: Request, num_new: int, ahead: bool = False) -> bool:
        """Blocks for num_new more tokens (past those of its step in flight); False if the pool is short.
        A step ahead only takes free blocks: it never reclaims nor preempts."""
        needed = self._blocks_needed(request, num_new)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks and self.reclaim is not None and not ahead:
            self.reclaim(needed)
        if needed > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def _lookup_prefix(self, request: Request) -> list[int]:
        # Never the whole sequence: the last token must be computed to produce logits.
        usable = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request)
        return self.pool.find_cached_prefix(request.block_hashes[:usable])

    def _extend_hashes(self, request: Request) -> None:
        done = len(request.block_hashes)
        if done < request.num_tokens // self.block_size:
            parent = request.block_hashes[-1] if request.block_hashes else b""
            tokens = request.token_ids_between(done * self.block_size, request.num_tokens)  # the blocks not hashed
            request.block_hashes.extend(hash_full_blocks(tokens, self.block_size, parent=parent))

    def _cache_computed_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        self._extend_hashes(request)
        for index in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])
        request.num_cached_blocks = num_full

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _free_blocks(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
