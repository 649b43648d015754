#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and JAX installed, from the source tree (no install needed), run
#   1. the tiny-fixture parity tests (float32 at highest precision, the unrolled layout, dense and blocked attention);
#   2. bitwise invariance at Mistral-7B shapes (bfloat16, 8 lanes, neighbours up to 2000 tokens), with the station's
#      GPU defaults (cuDNN attention, unrolled layers) and with the blocked attention;
#   3. bench/step.py --shape mistral-7b at lanes 1, 8, 32, 64 and live 512, 2048 (bfloat16), and int8 at 1 and 8;
#   4. bench/throughput.py --shape mistral-7b at K = 1, 8, 32 through the scheduler;
#   5. the other families at real shapes: bitwise invariance at gemma-3-4b (local and global layers), and bench/step.py
#      --shape qwen2.5-7b, qwen3-8b and gemma-3-4b at lanes 1 and 8, live 512 (bfloat16).
# Results land in bench/results/ (and in $OUT when that is set). Budget: under 10 minutes on one H100/H200.
# Usage: scripts/gpu_check.sh            (exits non-zero if a test or the invariance check fails)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.devices())' || exit 2
status=0
step() { echo "== $*"; local t0=$SECONDS; "$@" || status=1; echo "== done in $((SECONDS - t0)) s"; }

step python3 -m pytest -q -p no:cacheprovider tests/test_parity_tiny.py
step python3 -m bench.invariance --shape mistral-7b --dtype bfloat16 --lanes 8 --max-len 2000 --cases 6
step python3 -m bench.invariance --shape mistral-7b --dtype bfloat16 --lanes 8 --max-len 2000 --cases 3 \
  --attention blocked
step python3 -m bench.step --shape mistral-7b --dtype bfloat16 --lanes 1 8 32 64 --live 512 2048 --max-seq 2176 \
  --reps 5 --name step_mistral-7b_bfloat16
step python3 -m bench.step --shape mistral-7b --dtype int8 --lanes 1 8 --live 512 --max-seq 640 --reps 5 \
  --name step_mistral-7b_int8
step python3 -m bench.throughput --shape mistral-7b --dtype bfloat16 --ks 1 8 32 --new-tokens 64 --reps 2
step python3 -m bench.invariance --shape gemma-3-4b --dtype bfloat16 --lanes 8 --max-len 2000 --cases 3
for shape in qwen2.5-7b qwen3-8b gemma-3-4b; do
  step python3 -m bench.step --shape "$shape" --dtype bfloat16 --lanes 1 8 --live 512 --max-seq 640 --reps 5 \
    --name "step_${shape}_bfloat16"
done
if [ -n "${OUT:-}" ]; then cp bench/results/*-7b*.json bench/results/*-8b*.json bench/results/*-4b*.json "$OUT"/ 2>/dev/null; fi
exit $status
