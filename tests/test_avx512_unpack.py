"""The AVX-512 unpacking of the 4-, 5- and 6-bit quads (int8_quads.cpp: load_codes<4>, load_codes<5>,
load_codes6), run on any
x86 machine through SIMDe's portable AVX-512 (the `libsimde-dev` headers; skipped without them).

The C++ kernels build with -march=native, so a machine without AVX-512 never runs those functions; this
compiles them as written against SIMDe and checks their code vectors against quads.py's own unpacking
of random layouts. Reference: `quads._unsigned_vectors` (4 and 5 bits) and `quads.k6_parts` (6 bits), which
test_quads.py checks against the row-major codes the layouts were made from."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.layers import quads

SIMDE = Path("/usr/include/simde/x86/avx512.h")
SOURCE = Path(__file__).resolve().parents[1] / "kvserve" / "kernels" / "csrc" / "int8_quads.cpp"
FUNCTIONS = ("at_bit4", "load_nibbles", "load_codes", "load_codes6")

pytestmark = pytest.mark.skipif(
    not SIMDE.exists() or shutil.which("c++") is None,
    reason="needs SIMDe's headers (apt-get install libsimde-dev) and a C++ compiler",
)


def _avx512_function(section: str, name: str) -> str:
    """The whole definition of `name` (taking __m512i) in `section`, its template line included."""
    match = re.search(rf"(template <[^\n]*>\n)?inline [^\n]*\b{name}\([^)]*__m512i[^)]*\) \{{", section)
    assert match is not None, f"{name} (AVX-512) not found in {SOURCE.name}"
    depth, end = 0, match.end() - 1
    for end in range(match.end() - 1, len(section)):
        depth += {"{": 1, "}": -1}.get(section[end], 0)
        if depth == 0:
            break
    return section[match.start() : end + 1]


@pytest.fixture(scope="module")
def unpack(tmp_path_factory) -> Path:
    """A program: `unpack BITS GROUPS IN OUT` writes each group's eight 64-byte code vectors."""
    source = SOURCE.read_text()
    section = source[source.index("#if KVSERVE_HAS_VNNI512") :]
    functions = "\n\n".join(_avx512_function(section, name) for name in FUNCTIONS)
    folder = tmp_path_factory.mktemp("avx512_unpack")
    program = folder / "unpack.cpp"
    program.write_text(
        "#define SIMDE_ENABLE_NATIVE_ALIASES\n#include <simde/x86/avx512.h>\n#include <cstdint>\n"
        "#include <cstdio>\n#include <cstdlib>\n#include <cstring>\n#include <vector>\n"
        "constexpr int64_t kK6Bytes = 384, kMin4Bytes = 256;\n\n" + functions + "\n\n" + _MAIN
    )
    binary = folder / "unpack"
    subprocess.run(["c++", "-O1", "-std=c++17", "-w", str(program), "-o", str(binary)], check=True)
    return binary


_MAIN = r"""
int main(int argc, char** argv) {
  const int bits = std::atoi(argv[1]);
  const long groups = std::atol(argv[2]), bytes = bits == 5 ? 320 : bits == 4 ? kMin4Bytes : kK6Bytes;
  std::vector<uint8_t> in(groups * bytes), out(groups * 512);
  FILE* f = std::fopen(argv[3], "rb");
  if (f == nullptr || std::fread(in.data(), 1, in.size(), f) != in.size()) return 1;
  std::fclose(f);
  for (long g = 0; g < groups; ++g) {
    __m512i codes[8];
    if (bits == 5) {
      load_codes<5>(in.data(), g, codes);
    } else if (bits == 4) {
      load_codes<4>(in.data(), g, codes);
    } else {
      load_codes6(in.data(), g, codes);
    }
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out.data() + g * 512 + j * 64, codes[j]);
  }
  f = std::fopen(argv[4], "wb");
  std::fwrite(out.data(), 1, out.size(), f);
  std::fclose(f);
  return 0;
}
"""


def _run(unpack: Path, bits: int, held: torch.Tensor, folder: Path) -> torch.Tensor:
    vectors, groups = held.shape[:2]
    held.contiguous().numpy().tofile(folder / "in")
    subprocess.run([str(unpack), str(bits), str(vectors * groups), folder / "in", folder / "out"], check=True)
    return torch.from_numpy(np.fromfile(folder / "out", dtype=np.uint8)).view(vectors, groups, 8, 64)


def test_avx512_unpacks_five_bit_codes_as_quads_py_does(unpack, tmp_path):
    """Q5_0's layout (every code -16..15, held + 16): each byte of each code vector, fifth bit included."""
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-16, 16, (64, 640), generator=generator, dtype=torch.int8)
    held, _ = quads.to_quads(codes, torch.ones(64, 20))
    assert quads.code_bits(held) == 5
    assert torch.equal(_run(unpack, 5, held, tmp_path), quads._unsigned_vectors(held))


def test_avx512_unpacks_four_bit_codes_as_quads_py_does(unpack, tmp_path):
    """Q4_0's and Q4_1's layout (codes 0..15, the nibbles alone): each byte of each code vector."""
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 640), generator=generator, dtype=torch.uint8)
    held, _ = quads.to_q4_quads(codes, torch.ones(64, 20), torch.zeros(64, 20))
    assert quads.code_bits(held) == 4
    unpacked = quads._unsigned_vectors(held)
    assert torch.equal(unpacked, codes.view(4, 16, 20, 8, 4).permute(0, 2, 3, 1, 4).reshape(4, 20, 8, 64))
    assert torch.equal(_run(unpack, 4, held, tmp_path), unpacked)


def test_avx512_unpacks_six_bit_codes_as_quads_py_does(unpack, tmp_path):
    """Q6_K's layout (codes 0..63): the nibbles and both crumb bits of every code."""
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 64, (64, 512), generator=generator, dtype=torch.uint8)
    scales = torch.randint(-128, 128, (64, 32), generator=generator, dtype=torch.int8)
    held, k_scales = quads.to_k6_quads(codes, scales, torch.rand(64, 2, generator=generator).half())
    back = quads.k6_parts(held, k_scales)[0]  # row-major [64, 512], as to_k6_quads took them
    assert torch.equal(back, codes)
    vectors, groups = held.shape[:2]
    expected = back.view(vectors, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(vectors, groups, 8, 64)
    assert torch.equal(_run(unpack, 6, held, tmp_path), expected)
