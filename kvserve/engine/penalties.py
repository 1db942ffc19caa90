"""Repetition, frequency and presence penalties, with each request's history kept on the logits' device.

A penalized row needs the distinct tokens its prompt and output hold (the repetition penalty, as
transformers and vLLM apply it) and how often it generated each (OpenAI's frequency and presence
penalties). Rebuilt from the whole history every step, that was host work growing with the context:
sets, a sort and two host-to-device lists per row and step. Here a request gets a row of two tables the
first time it is penalized: its distinct token ids in the order first seen, and each one's count among
the outputs. A step adds the tokens generated since its last (one, in decode), then penalizes every
penalized row at once, in one gather and one scatter over those ids. The host's work per row and
step is a dict lookup per new token, whatever the context's length.

A row's result depends on its own history and settings only (R7): each id is penalized by its own
row's numbers, and where two writes meet (a row's padding) they write the same value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.layers.transfer import on_device

if TYPE_CHECKING:
    from kvserve.engine.sampler import SamplingRow

MIN_COLUMNS = 256  # the tables' first width in ids; each growth doubles it


@dataclass
class _History:
    slot: int  # the request's row in the tables
    vocab: int  # ids at or past the logits' width are never penalized
    columns: dict[int, int] = field(default_factory=dict)  # token id -> its column, in first-seen order
    num_counted: int = 0  # outputs counted so far


class Penalties:
    """The penalized requests' histories, by request id, on the device of the logits they last saw.
    Not thread-safe: the engine thread (or a pipeline's last stage) owns it."""

    def __init__(self) -> None:
        self._histories: dict[object, _History] = {}
        self._free_slots: list[int] = []
        self._ids: torch.Tensor | None = None  # [slots, columns] int64: each request's distinct ids
        self._counts: torch.Tensor | None = None  # [slots, columns] float32: how often it generated each

    @property
    def num_requests(self) -> int:
        return len(self._histories)

    @property
    def num_bytes(self) -> int:
        """The tables' size: the most penalized requests at once by the most distinct ids of one, 12 bytes
        each, until none is left."""
        return 0 if self._ids is None else self._ids.nbytes + self._counts.nbytes

    def apply(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
        """Penalize logits' rows `indices` [B, V] in place, each by rows[i]'s settings and history.
        A row without a key (no request behind it) gets a history for this call only."""
        if not indices:
            return
        temporary = [object() for i in indices if rows[i].key is None]
        try:
            self._apply(logits, rows, indices, iter(temporary))
        except BaseException:  # the histories may be ahead of the tables: these requests' start again
            self.release([rows[i].key for i in indices if rows[i].key is not None])
            raise
        finally:
            self.release(temporary)

    def release(self, keys: list) -> None:
        """Forget finished requests' histories; their rows in the tables serve the next ones, and with
        none left the tables go (one long conversation's width is not kept for good)."""
        for key in keys:
            history = self._histories.pop(key, None)
            if history is not None:
                self._free_slots.append(history.slot)
        if not self._histories:
            self._free_slots.clear()
            self._ids = self._counts = None

    def _apply(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int], temporary) -> None:
        device, vocab = logits.device, logits.shape[1]
        if self._ids is not None and self._ids.device != device:  # another device's tables: start again
            self.release(list(self._histories))  # with none left, the tables go
        histories = []
        new_ids: list[tuple[int, int, int]] = []  # (slot, column, token id) first seen this step
        new_counts: dict[tuple[int, int], int] = {}  # (slot, column) -> outputs generated since
        for i in indices:
            row = rows[i]
            key = row.key if row.key is not None else next(temporary)
            history = self._histories.get(key)
            if history is not None and (history.vocab != vocab or history.num_counted > len(row.output_token_ids)):
                # another model's logits, or an output that went back: start again
                self.release([key])
                history = None
            if history is None:
                history = self._start(key, row.prompt_token_ids, vocab, new_ids)
            columns = history.columns
            for token in row.output_token_ids[history.num_counted :]:
                if token >= vocab:
                    continue
                column = columns.get(token)
                if column is None:
                    column = columns[token] = len(columns)
                    new_ids.append((history.slot, column, token))
                new_counts[history.slot, column] = new_counts.get((history.slot, column), 0) + 1
            history.num_counted = len(row.output_token_ids)
            histories.append(history)
        self._fit(len(self._histories) + len(self._free_slots), histories, device)
        if new_ids:
            slots, columns, tokens = on_device(device, list(zip(*new_ids, strict=True)))
            self._ids[slots, columns] = tokens
        if new_counts:  # one entry per (row, id): no two adds meet
            slots, columns = on_device(device, list(zip(*new_counts, strict=True)))
            self._counts[slots, columns] += on_device(device, list(new_counts.values()), torch.float32)
        self._penalize(logits, rows, indices, histories)

    def _start(self, key, prompt_token_ids: list[int], vocab: int, new_ids: list) -> _History:
        slot = self._free_slots.pop() if self._free_slots else len(self._histories)  # slots: in use or free
        history = self._histories[key] = _History(slot, vocab)
        history.columns = {token: c for c, token in enumerate(dict.fromkeys(t for t in prompt_token_ids if t < vocab))}
        new_ids.extend((slot, c, token) for token, c in history.columns.items())
        if self._counts is not None and slot < self._counts.shape[0]:
            self._counts[slot].zero_()  # a finished request's counts
        return history

    def _fit(self, num_slots: int, histories: list[_History], device) -> None:
        """Grow the tables (doubling) to hold `num_slots` rows and every history's columns."""
        width = max((len(h.columns) for h in histories), default=0)
        if self._ids is not None and self._ids.shape[0] >= num_slots and self._ids.shape[1] >= width:
            return
        old_slots, old_width = (0, 0) if self._ids is None else self._ids.shape
        slots, columns = max(num_slots, 2 * old_slots, 8), max(MIN_COLUMNS, old_width)
        while columns < width:
            columns *= 2
        ids = torch.zeros(slots, columns, dtype=torch.long, device=device)
        counts = torch.zeros(slots, columns, dtype=torch.float32, device=device)
        if self._ids is not None:
            ids[:old_slots, :old_width] = self._ids
            counts[:old_slots, :old_width] = self._counts
        self._ids, self._counts = ids, counts

    def _penalize(self, logits: torch.Tensor, rows: list[SamplingRow], indices: list[int], histories) -> None:
        """One gather and one scatter over every penalized row's distinct ids, laid out as a grid of
        [rows, the most ids]: a row with fewer repeats its last id, which computes and writes that id's
        value again (a gather over a 2-D view: a tenth of the time of torch's advanced indexing on a CPU)."""
        live = [(i, h) for i, h in zip(indices, histories, strict=True) if h.columns]
        if not live:  # nothing seen yet (an empty prompt)
            return
        assert logits.is_contiguous()  # the sampler's own copy
        device, vocab = logits.device, logits.shape[1]
        width = max(len(h.columns) for _, h in live)
        params = [rows[i].params for i, _ in live]
        # per penalized row: its logits row, its tables' row, its last column; its three settings
        index = on_device(
            device, [[i for i, _ in live], [h.slot for _, h in live], [len(h.columns) - 1 for _, h in live]]
        )
        repetition, frequency, presence = on_device(
            device,
            [
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            torch.float32,
        )[:, :, None]  # each [P, 1]
        column = torch.minimum(torch.arange(width, device=device)[None, :], index[2][:, None])  # [P, width]
        token = self._ids[:, :width].index_select(0, index[1]).gather(1, column)
        counts = self._counts[:, :width].index_select(0, index[1]).gather(1, column)
        at = (index[0][:, None] * vocab + token).view(1, -1)
        flat = logits.view(1, -1)
        values = flat.gather(1, at).view(len(live), width)
        # repetition over the prompt and output (x 1 and / 1 change nothing), then OpenAI's two on outputs
        values = torch.where(values > 0, values / repetition, values * repetition)
        values = values - (frequency * counts + presence * (counts > 0).to(values.dtype))
        flat.scatter_(1, at, values.view(1, -1))
