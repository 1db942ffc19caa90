"""SeedStream: a seeded request's seeds drawn a block at a time are the numbers of one draw a step, and a
failed step's draws are taken back, across a block's end too."""

from __future__ import annotations

import torch

from kvserve.engine.seed_stream import HIGH, SeedStream


def one_draw_a_step(seed: int, steps: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, HIGH, (1,), generator=generator)) for _ in range(steps)]


def test_the_seeds_are_the_numbers_of_one_draw_a_step_across_blocks():
    stream = SeedStream(1234)
    steps = 3 * SeedStream.BLOCK + 5
    assert [stream.take() for _ in range(steps)] == one_draw_a_step(1234, steps)


def test_a_restored_mark_gives_the_same_seeds_again_within_a_block_and_across_its_end():
    expected = one_draw_a_step(7, 4 * SeedStream.BLOCK)
    for marked_at in (0, 5, SeedStream.BLOCK - 1, SeedStream.BLOCK, 2 * SeedStream.BLOCK - 1):
        stream = SeedStream(7)
        for _ in range(marked_at):
            stream.take()
        mark = stream.mark()
        stream.take()  # the failed step's draw (at a block's end: a new block drawn)
        stream.restore(mark)
        taken = [stream.take() for _ in range(SeedStream.BLOCK + 3)]
        assert taken == expected[marked_at : marked_at + SeedStream.BLOCK + 3], marked_at


def test_a_direct_stream_takes_back_uniforms_drawn_from_its_generator():
    """Without a kernel the sampler draws uniforms from the generator itself: a direct stream's mark
    keeps the generator's state, so the rerun draws the same uniforms, and later seeds are unchanged."""
    stream = SeedStream(11, direct=True)
    stream.take()
    mark = stream.mark()
    first = torch.empty(50).uniform_(generator=stream.generator)
    seed = stream.take()
    stream.restore(mark)
    assert torch.equal(torch.empty(50).uniform_(generator=stream.generator), first)
    assert stream.take() == seed
