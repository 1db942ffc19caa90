"""The C++ kernels' cache is shared by every copy of the same sources on a machine: a start of
another checkout (or of an installed copy) loads the built library and never runs the compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvserve.kernels import build

# Loads the kernels from the sources at argv[1] and prints the library's file. A compiler spy lies
# first on PATH (c++, g++, gcc, cc and CXX): each records that it ran, and fails.
LOAD = """
import sys
from pathlib import Path
from kvserve.kernels import build
source_dir = Path(sys.argv[1])
module = build._build_or_load(build.build_name(source_dir), source_dir)
print(module.__file__)
"""
SPY = """#!/bin/sh
echo "$0 $*" >> "{log}"
exit 1
"""


def test_a_second_copy_of_the_sources_loads_the_built_library_without_compiling(extension, tmp_path):
    log = tmp_path / "compiler-calls.log"
    spies = tmp_path / "bin"
    spies.mkdir()
    for name in ("c++", "g++", "gcc", "cc"):
        spy = spies / name
        spy.write_text(SPY.format(log=log))
        spy.chmod(0o755)
    env = {**os.environ, "PATH": f"{spies}{os.pathsep}{os.environ['PATH']}", "CXX": str(spies / "c++")}
    libraries = []
    for checkout in ("one", "two"):  # two copies at other paths than the package's, as two checkouts are
        source_dir = tmp_path / checkout / "kvserve" / "kernels" / "csrc"
        shutil.copytree(build.SOURCE_DIR, source_dir)
        assert build.build_name(source_dir) == build.build_name()  # named by content, not by path
        result = subprocess.run(
            [sys.executable, "-c", LOAD, str(source_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert result.returncode == 0, result.stderr
        libraries.append(result.stdout.strip())
    assert not log.exists(), f"the compiler ran: {log.read_text()}"
    assert libraries[0] == libraries[1] == extension.__file__  # the one library this session built or found


def test_a_build_compiles_a_copy_of_the_sources_inside_the_cache_folder(tmp_path):
    staged = build._stage_sources(build.SOURCE_DIR, tmp_path / "kvserve_kernels_x" / "src")
    assert [p.name for p in build.sources(staged)] == [p.name for p in build.sources()]
    assert all(
        (staged / p.name).read_bytes() == p.read_bytes() for p in build.sources()
    )  # the same bytes: the same name
    assert build.build_name(staged) == build.build_name()
