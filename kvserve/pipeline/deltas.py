"""A request's lists sent down a pipeline once, then only what changed.

Every stage reads a request's block table (its attention's blocks), and the last stage's sampler its
prompt and outputs where penalties need them (the repetition penalty both, the frequency and presence
penalties the outputs) or min_tokens counts the outputs. Sent whole with every step, each was work
growing with the conversation, pickled, sent and unpickled at every stage per request and step. Now
rank 0 (`Outbound`) sends them with a request's first plan, then only the outputs generated since its
last plan and the blocks added to its table (the whole table again where it changed otherwise: a
preempted request's new blocks). Each later stage (`Mirror`) keeps its copies up to date and hands its
runner the items with their whole tables (the last stage also whole prompts and outputs), forwarding
the plan as it came.

Plans reach every stage in the order rank 0 made them, every one of them (a plan a stage failed on is
passed on with its error: the copies take it before the step is skipped), so a copy holds the request's
lists as of each plan. A finished request's id goes with the next plan's releases, which each stage
applies before that plan's items: an id that comes back for a new request starts whole.
"""

from __future__ import annotations

from kvserve.engine.scheduler import ScheduledRequest

# request id -> (outputs sent before this plan's, the prompt on the request's first plan, else None);
# only requests whose sampling reads them: penalties (prompt and outputs) or min_tokens (the outputs)
Histories = dict[str, tuple[int, list[int] | None]]
# request id -> the blocks of its table kept from its last plan, the item carrying the rest (absent: all)
Tables = dict[str, int]


def _item(item: ScheduledRequest, prompt: list[int], outputs: list[int], table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=item.request_id,
        token_ids=item.token_ids,
        num_computed_tokens=item.num_computed_tokens,
        block_ids=table,
        sample=item.sample,
        params=item.params,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
        token_bitmask=item.token_bitmask,
        ahead=item.ahead,
    )


def _continues(table: list[int], held: list[int]) -> bool:
    """Whether `table` is `held` with blocks added (or none): a decode step's table, one new block every
    block_size tokens. The lists hold the same int objects (copies of one request's table), so the
    comparison is mostly of pointers."""
    if len(table) == len(held):
        return table == held
    return len(table) > len(held) and table[: len(held)] == held


class Outbound:
    """Rank 0's side: what each request's plans have carried so far. The engine thread's alone."""

    def __init__(self) -> None:
        self._outputs: dict[str, int] = {}  # request id -> outputs sent (requests whose sampling reads them)
        self._tables: dict[str, list[int]] = {}  # request id -> the table its last plan gave

    def trim(self, items: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], Histories, Tables]:
        """A step's items as they travel: each table's new blocks only, where it grew from the last
        plan's; prompt and outputs only where sampling reads them, outputs since the request's last
        plan, the prompt on its first (min_tokens counts outputs: no prompt)."""
        trimmed, histories, tables = [], {}, {}
        for item in items:
            request_id, params = item.request_id, item.params
            table, held = item.block_ids, self._tables.get(request_id)
            kept = len(held) if held is not None and _continues(table, held) else 0
            if kept:
                tables[request_id] = kept
            self._tables[request_id] = table  # the scheduler's copy for this step: never changed after
            outputs = []
            if params.has_penalties or params.min_tokens > 0:
                sent = self._outputs.get(request_id)
                prompt = None if sent is not None else (item.prompt_token_ids if params.has_penalties else [])
                histories[request_id] = (sent or 0, prompt)
                outputs = item.output_token_ids[sent or 0 :]
                self._outputs[request_id] = len(item.output_token_ids)
            trimmed.append(_item(item, [], outputs, table[kept:]))
        return trimmed, histories, tables

    @property
    def num_requests(self) -> int:
        """Requests the stages hold copies for: those in flight or running, none once the engine is idle."""
        return len(self._tables)

    def release(self, request_ids: list[str]) -> None:
        """Finished requests: the stages forget them with the next plan."""
        for request_id in request_ids:
            self._outputs.pop(request_id, None)
            self._tables.pop(request_id, None)


class Mirror:
    """A later stage's copies of each request's block table and, at the last stage (`histories`), its
    prompt and outputs; a middle stage's runner gets empty prompts and outputs (it does not sample). A
    copy's outputs list grows in place with later plans (the sampler reads it within its step); a table
    handed out is never changed (a new block makes a new list)."""

    def __init__(self, histories: bool) -> None:
        self._keep_histories = histories
        self._tables: dict[str, list[int]] = {}
        self._histories: dict[str, tuple[list[int], list[int]]] = {}

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def apply(self, items: list[ScheduledRequest], histories: Histories, tables: Tables) -> list[ScheduledRequest]:
        """Bring the copies up to date with a plan's items; return the items with their whole lists (the
        plan's stay as they came, to be passed on). RuntimeError where a plan does not continue a copy
        (plans lost or out of order: a defect)."""
        whole, broken = [], []
        for item in items:
            request_id = item.request_id
            kept = tables.get(request_id, 0)
            table = item.block_ids
            if kept:
                held = self._tables.get(request_id)
                if held is None or len(held) != kept:
                    broken.append(f"request {request_id}'s block table ({kept} blocks kept, {len(held or [])} held)")
                    continue
                table = held + table if table else held
            self._tables[request_id] = table
            prompt, outputs = [], []
            entry = histories.get(request_id) if self._keep_histories else None
            if entry is not None:
                outputs_from, first = entry
                if first is not None:  # the request's first plan
                    self._histories[request_id] = (first, [])
                lists = self._histories.get(request_id)
                if lists is None or len(lists[1]) != outputs_from:
                    held_outputs = len(lists[1]) if lists is not None else 0
                    broken.append(f"request {request_id}'s outputs (from {outputs_from}, {held_outputs} held)")
                    continue
                lists[1].extend(item.output_token_ids)
                prompt, outputs = lists
            whole.append(_item(item, prompt, outputs, table))
        if broken:  # the others' copies are up to date: only these requests are out of step
            raise RuntimeError(f"the plan does not continue this stage's copies: {', '.join(broken)}")
        return whole

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._tables.pop(request_id, None)
            self._histories.pop(request_id, None)
