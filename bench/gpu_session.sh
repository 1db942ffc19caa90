#!/usr/bin/env bash
# A GPU session's first device call (issue 32), in one go and in the order that decides the most:
#   1. gpu_timeline.py: a one-row 1B step's matmuls, program by program, the 4-bit kernel against the one
#      before 2026-12-05 (`int4-bf16x2-waited`) and the norms in the prologues;
#   2. gpu_persistent.py: what one persistent kernel for a step would save at one row, against a kernel a phase;
#   3. gpu_kernels.py, kvserve's own configurations: each layer at one row for the same-bits candidates
#      (docs/performance.md, "What the next GPU run decides"), then at 20 and 64 rows for the row tiles;
#   4. gpu.py with the time left (at least GPU_RESERVE_S, 420 s): its runs by importance for 200 s less than
#      that, its tests last, until LIMIT_S (570 s: the device tool's 600 s a call, less the margin to write
#      back $OUT). What it skips (`skipped` in gpu.json) is a second call's: `python bench/gpu.py --runs ...`.
# Each step has a deadline; one that fails or runs out leaves the others theirs. Outputs in $OUT.
#
#   python bench/gpu.py --prepare        # here, right before the device call (`commit` in the JSONs)
#   bash bench/gpu_session.sh            # the device tool: carry [".gpu_assets"], timeout_s 600
#   # the plumbing on a CPU (Triton's interpreter, tiny shapes, one engine run; about 6 minutes):
#   DEVICE=cpu PYTHON=.venv/bin/python LIMIT_S=1800 \
#       GPU_ARGS="--runs q4-waited --streams 1 --max-tokens 2 --skip-tests --run-timeout-s 1200" bash bench/gpu_session.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_session}
device=${DEVICE:-cuda}
py=${PYTHON:-python}
limit=${LIMIT_S:-570}
begin=$SECONDS
mkdir -p "$out"
left() { echo $((limit - (SECONDS - begin))); }
if [ "$device" = cuda ]; then
    pip install -q --no-index --no-deps --target /tmp/site .gpu_assets/wheels/*.whl || exit 1
    export PYTHONPATH=.:/tmp/site
    shapes=llama1b layers=16 gpu_shapes=llama1b,smol135m
else
    export PYTHONPATH=. TRITON_INTERPRET=1 KVSERVE_KERNELS=triton
    shapes=tiny layers=1 gpu_shapes=tiny
fi
one_row=int4-bf16x2,int4-bf16x2-waited,float-normed,float-normed-kernel,int4-bf16x2-normed,int4-bf16x2-normed-kernel
one_row=$one_row,int4-int8,int4-int8-words512,int4-int8-words1024,int4-int8-words2048,int8-int8,int8-int8-words1024
one_row=$one_row,float-gated,float-gated-kernel,int4-bf16x2-gated,int4-bf16x2-gated-kernel,float-rope,float-rope-kernel
tiles=int4-bf16x2,int4-bf16x2-waited,int4-bf16x2-1tile,int4-bf16x2-2tile,int4-bf16x2-4tile,int8,int8-1tile

step() {  # step NAME SECONDS COMMAND...: at most SECONDS, and never into the last GPU_RESERVE_S
    local name=$1 seconds=$2
    shift 2
    local most=$(($(left) - ${GPU_RESERVE_S:-420}))
    [ "$seconds" -gt "$most" ] && seconds=$most
    if [ "$seconds" -lt 20 ]; then
        echo "[$((SECONDS - begin)) s] $name: skipped, no time left" | tee -a "$out/session.log"
        return
    fi
    echo "[$((SECONDS - begin)) s] $name (at most $seconds s)" | tee -a "$out/session.log"
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "[$((SECONDS - begin)) s] $name: exit $?" | tee -a "$out/session.log"
}

step timeline 75 "$py" bench/gpu_timeline.py --device "$device" --shapes "$shapes" --layers "$layers" --rows 1 \
    --kinds int4-bf16x2,int4-bf16x2-waited,float,float-normed,int4-bf16x2-normed --out "$out/timeline.json"
step persistent 75 "$py" bench/gpu_persistent.py --device "$device" --shapes "$shapes" --layers "$layers" \
    --out "$out/persistent.json"
step kernels 80 "$py" bench/gpu_kernels.py --device "$device" --shapes "$shapes" --own-configs --budget-s 50 \
    --rows 1 --kinds "$one_row" --out "$out/kernels.json"
step kernels_tiles 45 "$py" bench/gpu_kernels.py --device "$device" --shapes "$shapes" --own-configs --budget-s 20 \
    --rows 20,64 --kinds "$tiles" --out "$out/kernels_tiles.json"
# the engine: runs until 200 s before the end, then its tests until 10 s before it
rest=$(left)
echo "[$((SECONDS - begin)) s] gpu.py ($rest s left)" | tee -a "$out/session.log"
# shellcheck disable=SC2086
timeout "$((rest - 5))" "$py" bench/gpu.py --device "$device" --shapes "$gpu_shapes" --budget-s "$((rest - 200))" \
    --deadline-s "$((rest - 10))" --out "$out/gpu.json" ${GPU_ARGS:-} > "$out/gpu.log" 2>&1
echo "[$((SECONDS - begin)) s] gpu.py: exit $?" | tee -a "$out/session.log"
tail -n 40 "$out/gpu.log"
