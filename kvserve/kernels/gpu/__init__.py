"""kvserve's GPU kernels, written in Triton: RMSNorm (`norm`), matmuls over float, int4 and int8
weights (`matmul`), paged attention with its KV-cache writes (`attention`), the gated activation and
RoPE (`elementwise`), and the sampler's argmax and draws (`sample`).

Every kernel is batch invariant (R7, docs/architecture.md): a row's result is computed with one
fixed tile configuration and reductions in one order, so its bits never depend on how many other
rows share the call. Without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`,
set before triton is imported), which is how CI tests them.

This module imports nothing heavier than the standard library, so `import kvserve.kernels.gpu`
works where triton is missing; the kernel modules import triton themselves.
"""

from __future__ import annotations

import os

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
# Programmatic dependent launch: each kernel's launch overlaps the end of the one before it in the
# stream (common.wait_for_prior keeps every result the same). Off until a GPU measures it:
# KVSERVE_PDL=1 turns it on where the GPU has it (compute capability 9.0, Hopper, and later).
# KVSERVE_PDL=prefetch also has each matmul ask L2 for its first weights before that wait (`PREFETCH`).
PDL: bool = os.environ.get("KVSERVE_PDL") in ("1", "prefetch")
# With PDL, a matmul's programs may start while the kernel before is still running; weights are never
# written by a kernel, so each program can ask L2 for its own before the wait and find them there after.
PREFETCH: bool = os.environ.get("KVSERVE_PDL") == "prefetch"
# Bytes of each weight row's K split a matmul program asks L2 for, at most: the whole split of the int4
# kernels and of the int8-input ones (256 B a row for int4 x int8 in splits of 512), half of the float-input
# int8 kernel's, the first two K steps of the float kernel's: 8 MB of a 1B model's gate and up projections
# in bfloat16, well within an H200's 50 MB of L2.
PREFETCH_BYTES = 512
# Triton's FP contraction (`a * b + c` as one FMA), pinned on at every launch: the arithmetic that every
# GPU run so far measured and tested, which Triton 3.10 turns off by default (3.9 warns at the first compile).
_FIXED = {"enable_fp_fusion": True}
_PDL_ON = {**_FIXED, "PDL": True, "launch_pdl": True}


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host's launch code: the same value, without a call through Triton's
    constexpr_function wrapper (about 2.5 us against 0.1 on a small CPU, and an eager step made 18 such
    calls a decoder layer)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for the host's launch code, as `cdiv`: the smallest power of two at
    least n (0 for n <= 0, as Triton's bit arithmetic gives)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def available() -> bool:
    """Whether the kernels can run here: triton imports, and there is a CUDA device or the
    interpreter is on. Never raises."""
    try:
        import torch
        import triton  # noqa: F401
    except Exception:  # missing, or a broken install
        return False
    return INTERPRET or torch.cuda.is_available()


# The oldest NVIDIA GPUs the kernels run on: Ampere (A100, A10, RTX 30xx). For a Turing GPU (sm_75, a T4)
# Triton makes every dot an FMA loop (0.4-7 KB of stack a thread), ptxas refuses the packed bfloat16
# FMAs and Triton the int8 tensor-core tile (tests/test_triton_kernels.py compiles the kernels for sm_80,
# sm_90, sm_100 and sm_120).
MIN_CAPABILITY = (8, 0)


def unsupported_gpu(name: str, capability: tuple[int, int], hip_version: str | None) -> str | None:
    """Why the kernels cannot serve on the GPU `name` of compute `capability`, in a sentence, or None
    where they can; `hip_version`: torch.version.hip (a ROCm build of PyTorch) or None."""
    if hip_version is not None:
        return (
            f"kvserve's GPU kernels are written for NVIDIA GPUs (Triton with inline PTX), and this PyTorch is a "
            f"ROCm build (HIP {hip_version}) for {name}."
        )
    if tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        return (
            f"kvserve's GPU kernels need an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
            f" or later (Ampere: A100, A10, RTX 30xx, and newer) for their tensor-core dots; {name} has {major}.{minor}."
        )
    return None


def gpu_problem(index: int) -> str | None:
    """`unsupported_gpu` for CUDA device `index` of this machine (which must exist)."""
    import torch

    return unsupported_gpu(
        torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index), torch.version.hip
    )


_capabilities: dict[tuple[str, int | None], int] = {}


def compiled_capability(device) -> int | None:
    """The compute capability that launches on `device` compile for, as Triton writes it (major * 10 +
    minor: 90 for sm_90): the CUDA GPU's; for tensors on the CPU outside the interpreter, the target of
    Triton's active driver (the offline compile tests, which tell it a GPU); None in the interpreter."""
    if INTERPRET:
        return None
    index = device.index
    if device.type == "cuda" and index is None:
        import torch

        index = torch.cuda.current_device()
    key = (device.type, index)
    if key not in _capabilities:  # (asked at every launch: only the first call per device reaches torch)
        if device.type == "cuda":
            import torch

            major, minor = torch.cuda.get_device_capability(index)
            _capabilities[key] = major * 10 + minor
        else:
            from triton.runtime import driver

            _capabilities[key] = driver.active.get_current_target().arch
    return _capabilities[key]


def supports_pdl(device) -> bool:
    """Whether kernels on `device` can launch with programmatic dependent launch: a CUDA GPU of compute
    capability 9.0 or later (never in the interpreter), whatever `PDL` says."""
    return device.type == "cuda" and (compiled_capability(device) or 0) >= 90


def uses_pdl(device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: `PDL` is on and the GPU
    has it."""
    return PDL and supports_pdl(device)


def launch_options(device) -> dict:
    """The launch options of every kernel on `device`: FP contraction pinned on, and where
    programmatic dependent launch is used (`uses_pdl`), the kernel's constexpr PDL and Triton's launch
    flag."""
    return _PDL_ON if uses_pdl(device) else _FIXED


def prefetch_lines(device, split_bytes: int) -> int:
    """How many 128-byte lines of each weight row's K split (`split_bytes` long) a matmul program on
    `device` asks L2 for before programmatic dependent launch's wait: a power of two covering the split
    up to PREFETCH_BYTES where `PREFETCH` is on and the kernels launch with PDL, else 0 (none)."""
    if not (PREFETCH and uses_pdl(device)):
        return 0
    lines = 1
    while lines * 128 < min(split_bytes, PREFETCH_BYTES):
        lines *= 2
    return lines
