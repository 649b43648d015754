#!/usr/bin/env bash
# Evaluate a station with EleutherAI's lm-evaluation-harness (lm-eval 0.4.13) on two tiny local tasks in
# scripts/lm_eval_tasks: jaxstation_mc (20 multiple-choice questions: loglikelihood requests, i.e. /v1/completions
# with echo and prompt logprobs) and jaxstation_qa (20 short questions: greedy generate_until, exact match).
# lm-eval finds the tokenizer itself through the station's /tokenizer_info and /tokenize (its "remote" backend).
#
# Usage (from anywhere; it runs in the repository root): scripts/lm_eval_recipe.sh
#   env LMEVAL_VENV=DIR   the throwaway venv lm-eval goes into (default /tmp/lmeval; made and filled if missing)
#   env PORT=N            port of the station it starts on 127.0.0.1 (default 8765)
#   env STATION_URL=URL   evaluate an already running station instead (e.g. http://127.0.0.1:8000)
#   env OUT=DIR           lm-eval's --output_path root (default /tmp/lmeval_out)
#   env COMPARE_HF=1      also run the same tasks with transformers (`--model hf`) on the same GGUF, float32, and
#                         compare every sample with scripts/lm_eval_compare.py (takes minutes on CPU)
# lm-eval is not in the project's test extra: it pulls torch, transformers and datasets. Nothing is downloaded at run
# time (the tasks' data are the JSONL files beside their YAML; HF_*_OFFLINE is set).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${LMEVAL_VENV:-/tmp/lmeval}"
PORT="${PORT:-8765}"
OUT="${OUT:-/tmp/lmeval_out}"
PY="${PYTHON:-python3}"
TASKS="jaxstation_mc,jaxstation_qa"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"

if [[ ! -x "$VENV/bin/lm_eval" ]]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install "lm-eval[api]==0.4.13" "torch==2.13.0" transformers gguf accelerate
fi

GGUF="$("$PY" -c 'from jaxstation.model.default_model import default_model_path; print(default_model_path())')"
MODEL="$(basename "$GGUF" .gguf)"

if [[ -z "${STATION_URL:-}" ]]; then
  STATION_URL="http://127.0.0.1:$PORT"
  "$PY" -m jaxstation serve --port "$PORT" --continuous-batch --lanes 4 --max-seq 1024 > "$OUT.station.log" 2>&1 &
  STATION_PID=$!
  trap 'kill "$STATION_PID" 2>/dev/null || true' EXIT
  for _ in $(seq 240); do
    curl -sf "$STATION_URL/ready" >/dev/null && break
    kill -0 "$STATION_PID" 2>/dev/null || { echo "error: the station exited; see $OUT.station.log" >&2; exit 1; }
    sleep 0.5
  done
  curl -sf "$STATION_URL/ready" >/dev/null || { echo "error: the station did not turn ready" >&2; exit 1; }
fi

# Both kinds of task against the station: loglikelihood (multiple choice) and generation.
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=$STATION_URL/v1/completions,num_concurrent=4,max_retries=1" \
  --tasks "$TASKS" --include_path scripts/lm_eval_tasks --output_path "$OUT/station" --log_samples

if [[ "${COMPARE_HF:-0}" == 1 ]]; then
  "$VENV/bin/lm_eval" --model hf \
    --model_args "pretrained=$(dirname "$GGUF"),gguf_file=$(basename "$GGUF"),dtype=float32" --device cpu \
    --batch_size 1 --tasks "$TASKS" --include_path scripts/lm_eval_tasks --output_path "$OUT/hf" --log_samples
  "$PY" scripts/lm_eval_compare.py "$OUT/station" "$OUT/hf"
fi
