"""Per-program timestamps of the matmul kernels, for finding where a small GPU matmul's time goes.

A one-row 4-bit layer of the 1B shapes took 6-7 us on the H200 for 2.4-3.5 MB of weights that the
memory reads in under 1 us (docs/performance.md, third session), and a kernel's duration alone cannot
say whether that is its programs starting late, each program's chain of loads, or the last programs'
sums. While a `Timeline` is recording (`recording`), every matmul launch (`matmul._launch`) passes its
kernel a slice of the timeline's buffer, and each program writes there the GPU's global timer
(`%globaltimer`, nanoseconds, the same clock on every multiprocessor), its multiprocessor's cycle
counter (`%clock64`) and its multiprocessor (`%smid`) at four points (`ENTRY`, `WAITED` after the wait
for the kernel before, `LOOPED` once its K loop's sums are done, `DONE` once its stores are issued). Without a
recording the kernels take no timeline (a compile-time None) and their machine code has none of it.
The interpreter has no clock: there every stamp is 0, which still shows that each program passed
each point. bench/gpu_timeline.py records a decode step's matmuls and summarizes them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# the stamps' slots (constexprs, as the kernels name them); a program's SLOTS int64 hold the global times
# at 0-3, the cycle counts at CLOCKS + 0-3 and the multiprocessor at SM
ENTRY, WAITED, LOOPED, DONE = (tl.constexpr(slot) for slot in range(4))
SLOTS = tl.constexpr(16)
CLOCKS = tl.constexpr(8)
SM = tl.constexpr(15)


@triton.jit
def _program_index():
    """The program's place in its grid, the first axis fastest (CUDA's block order)."""
    return (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def _write(timeline, SLOT: tl.constexpr, after, INTERPRET: tl.constexpr):
    base = timeline + _program_index().to(tl.int64) * SLOTS
    if INTERPRET:  # no clock: zeros, which still show that the program came here
        now = after.to(tl.int64) * 0
        cycles = now
        sm = now
    else:  # `after` makes each read wait for the value it is given; volatile, so none is dropped or merged
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64, is_pure=False, pack=1
        )
        cycles = tl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l,r", [after], dtype=tl.int64, is_pure=False, pack=1
        )
        if SLOT == 0:
            sm = tl.inline_asm_elementwise(
                "mov.u32 $0, %smid;", "=r,r", [after], dtype=tl.int32, is_pure=False, pack=1
            ).to(tl.int64)
    tl.store(base + SLOT, now)
    tl.store(base + CLOCKS + SLOT, cycles)
    if SLOT == 0:
        tl.store(base + SM, sm)


@triton.jit
def stamp(timeline, SLOT: tl.constexpr, INTERPRET: tl.constexpr):
    """Record this program's arrival at SLOT (nothing without a timeline)."""
    if timeline is not None:
        _write(timeline, SLOT, tl.program_id(0), INTERPRET)


@triton.jit
def stamp_after(timeline, SLOT: tl.constexpr, tile, INTERPRET: tl.constexpr):
    """Record SLOT once every thread holds its part of the 2-D float32 `tile` (a K loop's sums): the
    tile's largest bits, a reduction across the program, are what the clocks are read after, so the
    stamp is the last thread's arrival (plus that reduction)."""
    if timeline is not None:
        bits = tile.to(tl.int32, bitcast=True)
        _write(timeline, SLOT, tl.max(tl.max(bits, 1), 0), INTERPRET)


@dataclass
class Launch:
    kernel: str
    label: str
    grid: tuple[int, int, int]
    first: int  # its first program's index in the buffer

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


class Timeline:
    """A buffer of `capacity` programs' stamps on `device`, handed out launch by launch in the order
    of the launches (so a CUDA graph captured while recording writes the same places at every replay).
    `label` names the launches that follow (a layer's name)."""

    def __init__(self, device: torch.device | str, capacity: int = 1 << 17) -> None:
        self.buffer = torch.full((capacity, SLOTS.value), -1, dtype=torch.int64, device=device)
        self.launches: list[Launch] = []
        self.label = ""
        self._used = 0

    def take(self, kernel: triton.JITFunction, grid: tuple[int, int, int]) -> torch.Tensor:
        launch = Launch(kernel.__name__, self.label, tuple(grid), self._used)
        if self._used + launch.programs > self.buffer.shape[0]:
            raise RuntimeError(f"the timeline holds {self.buffer.shape[0]} programs; record fewer launches")
        self.launches.append(launch)
        self._used += launch.programs
        return self.buffer[launch.first :]

    def stamps(self, launch: Launch) -> torch.Tensor:
        """[programs, SLOTS] on the CPU, in the grid's order (`_program_index`)."""
        return self.buffer[launch.first : launch.first + launch.programs].cpu()


_active: Timeline | None = None


def active_timeline() -> Timeline | None:
    return _active


@contextlib.contextmanager
def recording(timeline: Timeline):
    """Every matmul launched inside records its programs into `timeline`."""
    global _active
    previous, _active = _active, timeline
    try:
        yield timeline
    finally:
        _active = previous
