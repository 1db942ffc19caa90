"""BlockTableRows: a step's block tables in a buffer kept from step to step, rows rewritten where changed,
each padded with zeros."""

import random

import numpy as np

from kvserve.engine.block_tables import BlockTableRows


def test_each_row_holds_its_table_through_steps_that_grow_keep_replace_and_shrink_tables():
    rng = random.Random(3)
    buffer = np.zeros((6, 12), dtype=np.int32)
    rows = BlockTableRows(buffer)
    tables = [[] for _ in range(6)]
    for _ in range(400):
        for i in range(len(tables)):
            change = rng.random()
            if change < 0.2 and len(tables[i]) < 12:  # a new block
                tables[i] = tables[i] + [rng.randrange(1000)]
            elif change < 0.3:  # another sequence in this row, maybe as long, maybe sharing a prefix
                keep = rng.randrange(len(tables[i]) + 1)
                tables[i] = tables[i][:keep] + [rng.randrange(1000) for _ in range(rng.randrange(13 - keep))]
            elif change < 0.35 and tables[i]:  # one block swapped in place
                tables[i] = list(tables[i])
                tables[i][rng.randrange(len(tables[i]))] = rng.randrange(1000)
        count = rng.randrange(1, 7)  # steps of fewer rows leave the others as they were
        rows.write(tables[:count])
        for i in range(count):  # each row its table padded with zeros
            assert buffer[i].tolist() == tables[i] + [0] * (12 - len(tables[i])), i


def test_a_table_changed_after_its_write_is_written_again():
    buffer = np.full((1, 8), -1, dtype=np.int64)  # rows never written are written whole
    rows = BlockTableRows(buffer)
    table = [4, 5]
    rows.write([table])
    table.append(9)  # the caller's list grew in place: the rows kept their own copy
    rows.write([table])
    table[0] = 6
    rows.write([table])
    assert buffer[0].tolist() == [6, 5, 9, 0, 0, 0, 0, 0]


def test_after_forget_every_row_is_written_whole():
    buffer = np.zeros((2, 4), dtype=np.int32)
    rows = BlockTableRows(buffer)
    rows.write([[1, 2], [3]])
    buffer[:] = -1  # written by someone else (the graphs' padding)
    rows.forget()
    rows.write([[1, 2], [3]])
    assert buffer.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]]
