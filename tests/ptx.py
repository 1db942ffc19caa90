"""The PTX that kvserve's inline assembly uses (kvserve/kernels/gpu/common.py), run in Triton's
interpreter, so that on a CPU the helpers' GPU branches compute something to compare with their
interpreter branches.

Triton's interpreter refuses `tl.inline_asm_elementwise`. `emulating()` gives its builder a
`create_inline_asm` that runs the assembly here: each instruction as the PTX ISA defines it, on numpy
arrays (one entry per instance of the assembly), with the operands packed as Triton packs them: an
instance takes `pack` consecutive elements of every argument and result; elements narrower than 32 bits
share a register, the first in the lowest bits (8-bit x 4 in one register, 16-bit x 2), wider ones take
a register each, results first in the `$` numbering, then the arguments in order (Triton's docstring
of `inline_asm_elementwise`). Only the instructions kvserve writes are known; any other raises, so a new
one cannot pass untested. `prefetch.global.L2` records its addresses (`Emulator.prefetched`).

What this checks is the assembly against the ISA as read here, not the hardware: an instruction this
file models wrongly would agree with a kernel that uses it wrongly. tests/test_cuda.py on a GPU stays
the judge.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Iterator

import numpy as np

MASK = np.uint64(0xFFFFFFFF)


def _u32(x) -> np.ndarray:
    return np.asarray(x).astype(np.uint64) & MASK


def _signed(x: np.ndarray) -> np.ndarray:
    return _u32(x).astype(np.uint32).view(np.int32).astype(np.int64)


def _bytes(x: np.ndarray, signed: bool) -> list[np.ndarray]:
    """The four bytes of each 32-bit value, as unsigned or signed integers (int64)."""
    out = []
    for i in range(4):
        b = ((_u32(x) >> np.uint64(8 * i)) & np.uint64(0xFF)).astype(np.int64)
        out.append(np.where(b >= 128, b - 256, b) if signed else b)
    return out


def _bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _f64_to_bf16(total: np.ndarray, error: np.ndarray) -> np.ndarray:
    """The bfloat16 (bits) nearest to total + error, ties to even, where total is a float64 and error the
    exact remainder of the sum (TwoSum): error only decides a total that is itself a tie."""
    exponent = np.frexp(total)[1]  # total = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    ulp = np.ldexp(1.0, np.maximum(exponent - 8, -133))  # 8 significant bits; subnormals below 2**-126
    q = total / ulp  # exact: a power of two
    rounded = np.rint(q)  # ties to even
    tie = (q - np.floor(q) == 0.5) & (error != 0)
    rounded = np.where(tie, np.where(error > 0, np.ceil(q), np.floor(q)), rounded)
    value = (rounded * ulp).astype(np.float32)  # exact: a bfloat16 value (or an infinity)
    return (value.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _fma_bf16x2(a, b, c) -> np.ndarray:
    """fma.rn.bf16x2: per 16-bit half, a * b + c rounded once to bfloat16 (nearest, ties to even)."""
    out = np.zeros(np.shape(a), np.uint64)
    for shift in (0, 16):
        halves = [((_u32(v) >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint16) for v in (a, b, c)]
        x, y, z = (_bf16_to_f64(h) for h in halves)
        product = x * y  # exact: 8 x 8 significant bits
        total = product + z
        virtual = total - product  # TwoSum: total + error == product + z exactly
        error = (product - (total - virtual)) + (z - virtual)
        out |= _f64_to_bf16(total, error).astype(np.uint64) << np.uint64(shift)
    return out


def _prmt(a, b, selector) -> np.ndarray:
    """prmt.b32 (the default mode): byte i of the result is byte (selector's nibble i & 7) of b:a, its
    sign replicated where the nibble's bit 3 is set."""
    sources = _bytes(a, False) + _bytes(b, False)
    table = np.stack(sources)  # [8, n]
    selector = _u32(selector)
    out = np.zeros(table.shape[1:], np.uint64)
    for i in range(4):
        nibble = ((selector >> np.uint64(4 * i)) & np.uint64(0xF)).astype(np.int64)
        nibble = np.broadcast_to(nibble, out.shape)
        byte = np.take_along_axis(table, (nibble & 7)[None], axis=0)[0]
        byte = np.where(nibble & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out


def _dp4a(a, b, c, a_signed: bool, b_signed: bool) -> np.ndarray:
    total = _signed(c)
    for x, y in zip(_bytes(a, a_signed), _bytes(b, b_signed), strict=True):
        total = total + x * y
    return _u32(total)


def _cvt_rni_s32_f32(a) -> np.ndarray:
    """cvt.rni.s32.f32: to the nearest integer, ties to even, saturated to int32; NaN gives 0."""
    x = _u32(a).astype(np.uint32).view(np.float32).astype(np.float64)
    rounded = np.clip(np.rint(np.nan_to_num(x, nan=0.0)), -(2.0**31), 2.0**31 - 1)
    return _u32(rounded.astype(np.int64))


class Emulator:
    """Runs asm blocks. `prefetched`: every address a `prefetch.global.L2` asked for; `loads`: every
    128-bit load's."""

    def __init__(self) -> None:
        self.prefetched: list[int] = []
        self.loads: list[int] = []  # the addresses of every ld.global.v4

    def run(
        self, asm: str, constraints: str, args: list[np.ndarray], arg_bits: list[int], out_bits: list[int], pack: int
    ):
        count = args[0].size
        assert count % pack == 0, (count, pack)
        n = count // pack
        operands: list[np.ndarray] = []
        outputs = [c for c in constraints.split(",") if c.startswith("=")]
        for bits in out_bits:
            operands += [np.zeros(n, np.uint64) for _ in range(self._registers(bits, pack))]
        assert len(operands) == len(outputs), (constraints, out_bits, pack)
        for data, bits in zip(args, arg_bits, strict=True):
            operands += self._pack(data.reshape(n, pack), bits)
        assert len(operands) == len(constraints.split(",")), (constraints, arg_bits, out_bits, pack)
        registers = {f"${i}": value for i, value in enumerate(operands)}
        body = asm.strip()
        if body.startswith("{") and body.endswith("}"):  # a scope around the block
            body = body[1:-1]
        for statement in body.split(";"):
            statement = statement.strip()
            if statement and not statement.startswith(".reg"):
                self._execute(statement, registers, n)
        results, index = [], 0
        for bits in out_bits:
            size = self._registers(bits, pack)
            results.append(self._unpack([registers[f"${index + i}"] for i in range(size)], bits))
            index += size
        return results

    @staticmethod
    def _registers(bits: int, pack: int) -> int:
        if bits >= 32:
            return pack
        assert (bits * pack) % 32 == 0, f"{pack} elements of {bits} bits do not fill whole registers"
        return bits * pack // 32

    @staticmethod
    def _pack(group: np.ndarray, bits: int) -> list[np.ndarray]:
        """[n, pack] elements -> the registers of each instance."""
        if bits >= 32:
            raw = group.view(np.uint64 if bits == 64 else np.uint32).astype(np.uint64)
            return [raw[:, i] for i in range(group.shape[1])]
        raw = group.view({8: np.uint8, 16: np.uint16}[bits]).astype(np.uint64)
        per = 32 // bits
        return [
            sum((raw[:, r * per + j] << np.uint64(bits * j) for j in range(per)), np.zeros(len(raw), np.uint64))
            for r in range(raw.shape[1] // per)
        ]

    @staticmethod
    def _unpack(registers: list[np.ndarray], bits: int) -> np.ndarray:
        """The registers of each instance -> its pack elements' bits, flattened in element order."""
        if bits >= 32:
            columns = registers
        else:
            per, mask = 32 // bits, np.uint64((1 << bits) - 1)
            columns = [(r >> np.uint64(bits * j)) & mask for r in registers for j in range(per)]
        return np.stack(columns, axis=1).reshape(-1)

    def _execute(self, statement: str, registers: dict[str, np.ndarray], n: int) -> None:
        opcode, _, rest = statement.partition(" ")
        operands = [o.strip() for o in re.split(r",(?![^{]*})", rest)]

        def value(name: str) -> np.ndarray:
            if name in registers:
                return registers[name]
            return np.full(n, int(name, 0) & 0xFFFFFFFF, np.uint64)

        def put(name: str, result) -> None:
            registers[name] = np.broadcast_to(np.asarray(result, np.uint64), (n,)).copy()

        if opcode == "prefetch.global.L2":
            self.prefetched += [int(a) for a in value(operands[0].strip("[]"))]
            return
        if opcode == "ld.global.v4.b32":
            targets = operands[0].strip("{}").split(",")
            addresses = value(operands[1].strip("[]"))
            self.loads += [int(a) for a in addresses]
            words = np.array([list((ctypes.c_uint32 * 4).from_address(int(a))) for a in addresses], np.uint64)
            for i, target in enumerate(targets):
                put(target.strip(), words[:, i])
            return
        d, *sources = operands
        x = [value(s) for s in sources]
        if opcode in ("mov.b32", "mov.u32"):
            put(d, x[0])
        elif opcode == "and.b32":
            put(d, x[0] & x[1])
        elif opcode == "shr.b32":
            put(d, np.where(x[1] < 32, x[0] >> np.minimum(x[1], 31), 0))
        elif opcode == "shr.s32":
            put(d, _u32(_signed(x[0]) >> np.minimum(x[1], 31).astype(np.int64)))
        elif opcode == "add.s32":
            put(d, _u32(x[0] + x[1]))
        elif opcode == "prmt.b32":
            put(d, _prmt(x[0], x[1], x[2]))
        elif opcode in ("dp4a.u32.s32", "dp4a.s32.s32", "dp4a.u32.u32", "dp4a.s32.u32"):
            a_type, b_type = opcode.split(".")[1:]
            put(d, _dp4a(x[0], x[1], x[2], a_type == "s32", b_type == "s32"))
        elif opcode == "fma.rn.bf16x2":
            put(d, _fma_bf16x2(x[0], x[1], x[2]))
        elif opcode == "cvt.rni.s32.f32":
            put(d, _cvt_rni_s32_f32(x[0]))
        else:
            raise NotImplementedError(f"tests/ptx.py does not know {opcode!r}")


class _Call:
    def __init__(self, results) -> None:
        self.results = results

    def get_result(self, index: int):
        return self.results[index]


@contextlib.contextmanager
def emulating() -> Iterator[Emulator]:
    """Triton's interpreter runs inline assembly through an `Emulator` (yielded) inside the block."""
    from triton.runtime import interpreter

    emulator = Emulator()

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        def bits(dtype) -> int:
            return 64 if dtype.is_ptr() else dtype.primitive_bitwidth

        shape = np.broadcast_shapes(*(v.data.shape for v in values))
        args = [np.ascontiguousarray(np.broadcast_to(v.data, shape)) for v in values]
        scalars = [t.scalar if hasattr(t, "scalar") else t for t in types]
        results = emulator.run(
            asm, constraints, args, [bits(v.dtype.scalar) for v in values], [bits(t) for t in scalars], pack
        )
        handles = []
        for raw, dtype in zip(results, scalars, strict=True):
            numpy_type = interpreter._get_np_dtype(dtype)
            width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[numpy_type.itemsize]
            handles.append(interpreter.TensorHandle(raw.astype(width).view(numpy_type).reshape(shape), dtype))
        return _Call(handles)

    original = interpreter.InterpreterBuilder.create_inline_asm
    interpreter.InterpreterBuilder.create_inline_asm = create_inline_asm
    try:
        yield emulator
    finally:
        interpreter.InterpreterBuilder.create_inline_asm = original
