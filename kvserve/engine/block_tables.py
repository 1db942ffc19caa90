"""A step's block tables written into a 2-D buffer that persists from step to step, each row only where
its table changed since the step before. Decode steps repeat the last step's tables but for one new
block every block_size tokens, so rewriting every row whole made the host's cost per step grow with the
length of the conversations (about 5 us a row of 130 blocks, 2,000 tokens)."""

from __future__ import annotations

import numpy as np


class BlockTableRows:
    """Rows of `buffer` ([rows, max blocks], any integer dtype) holding the tables last written to
    them, each followed by zeros: row i is tables[i] padded with 0, as a tensor made from the padded
    lists would be."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self._written: list[list[int] | None] = [None] * buffer.shape[0]  # a copy of each row's table

    def forget(self) -> None:
        """The buffer was written by someone else: the next `write` writes every row whole."""
        self._written = [None] * self.buffer.shape[0]

    def write(self, tables: list[list[int]]) -> None:
        """Row i of the buffer holds tables[i] then zeros; rows past len(tables) are left as they are.
        The lists are not kept: they may change afterwards."""
        buffer, written = self.buffer, self._written
        for row, table in enumerate(tables):
            last, length = written[row], len(table)
            if last is None:  # whatever the row held: the whole row
                buffer[row, :length] = table
                buffer[row, length:] = 0
            elif length == len(last) and table == last:  # the same blocks
                continue
            elif length > len(last) and table[: len(last)] == last:  # new blocks only
                buffer[row, len(last) : length] = table[len(last) :]
            else:  # another sequence: its table, and zeros over what is left of the last one
                buffer[row, :length] = table
                buffer[row, length : len(last)] = 0
            written[row] = list(table)
