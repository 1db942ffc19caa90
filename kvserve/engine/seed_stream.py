"""SeedStream: a seeded request's randomness, one 63-bit seed a sampling step, drawn a block at a time.

The sampler's kernels (the CPU's C++ draw, a GPU's Triton pick: engine/sampler.py) take one seed per
random row and step from the row's own generator. Drawn one call a step, with the generator's state
kept for a failed step's rerun, that cost each seeded row about 7 us of the engine thread: 0.4 ms a
step at 64 seeded streams on a small CPU. torch's randint on a CPU generator fills a tensor's values
one after another from the generator's stream, so BLOCK seeds drawn at once are the numbers of BLOCK
single draws: the same seeds and tokens as before, one call every BLOCK steps. A failed step is rerun
with the seeds it took (`mark`, `restore`). Without a kernel the sampler draws uniforms from the
generator itself (`generator`); a stream made for that (`direct`) marks the generator's whole state.
"""

from __future__ import annotations

import torch

HIGH = 2**63 - 1  # randint's exclusive bound: seeds in [0, 2**63 - 1), as the sampler has always drawn them


class SeedStream:
    BLOCK = 64

    def __init__(self, seed: int, direct: bool = False) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.direct = direct  # the generator is also drawn from directly: marks keep its state
        self._block: list[int] = []
        self._next = 0  # the next seed's index in _block
        self._before_block: torch.Tensor | None = None  # the generator's state before _block was drawn

    def take(self) -> int:
        """The next seed of the stream."""
        if self._next == len(self._block):
            self._before_block = self.generator.get_state()
            self._block = torch.randint(0, HIGH, (self.BLOCK,), generator=self.generator).tolist()
            self._next = 0
        self._next += 1
        return self._block[self._next - 1]

    def mark(self) -> tuple:
        """Where the stream is, before a step's draws (at most one take: one seed a row and step)."""
        return self._block, self._next, self.generator.get_state() if self.direct else None

    def restore(self, mark: tuple) -> None:
        """Back to `mark`, for the rerun of a step that failed after its draws."""
        block, at, state = mark
        if state is not None:
            self.generator.set_state(state)
        elif block is not self._block:  # the failed step drew a new block: the generator as before it
            self.generator.set_state(self._before_block)
        self._block, self._next = block, at
