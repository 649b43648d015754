#!/usr/bin/env bash
# Deploy jaxstation to Cloud Run on one NVIDIA L4: build, deploy a canary at 0% traffic, burst-test it, promote it,
# roll back. Every subcommand takes --dry-run, which prints the exact commands (gcloud, docker, python) and runs none.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/deploy_cloudrun.sh SUBCOMMAND [options] [--dry-run]

Subcommands:
  build     Build the image and push it to Artifact Registry: Cloud Build (default) or, with --docker, the local
            docker engine. --model-source wheel|copy|mount (default wheel), --checkpoint DIR (copy: an HF directory
            or .gguf inside the repo), --model-path PATH (mount).
  deploy    Deploy a new revision of the image as a canary: tagged "canary", 0% of the traffic (--no-traffic). One L4,
            8 CPUs, 32 GiB, CPU always allocated, scaling from zero; concurrency = lanes + queue; a startup probe on
            /ready (failureThreshold x periodSeconds = 240 s, Cloud Run's cap). --max-instances N (default 1),
            --lanes N (8), --max-queue N (64), --max-seq N (2048), --dtype (float32), --timeout SECONDS (300),
            --compile-cache DIR (e.g. gs://BUCKET/jaxstation-cache), --model PATH, --env KEY=VALUE (repeatable).
  burst     Burst-test the canary: bench/throughput.py against its URL (an identity token as the bearer, unless
            --public), every reply checked, then the parity probe against --reference (greedy replies equal to
            a file made beforehand on CPU: python -m scripts.parity_probe make). Exits non-zero on any failure.
            --ks "1 8" (concurrency levels), --new-tokens N (64), --url URL (instead of the canary tag's URL).
  promote   Shift traffic to the canary: update-traffic --to-tags canary=N (--percent N, default 100); at 100 the
            service then follows the latest revision (--to-latest).
  rollback  Send 100% of the traffic back to the previous revision (the one before the newest, read from the
            service; --to REVISION picks another). Instant: no new revision, no cold start.
            --flag-off instead deploys the same image again with MOONSHINE_CONTINUOUS_BATCH=0 (one request at a
            time) and routes the traffic to it: this makes a NEW REVISION, which pays a COLD START.

Common options (or environment variables):
  --project ID      (PROJECT, default: gcloud's configured project)
  --region REGION   (REGION, default us-central1; needs L4 quota there)
  --service NAME    (SERVICE, default jaxstation)
  --repository NAME (REPOSITORY, default jaxstation: the Artifact Registry docker repository)
  --image IMAGE     (IMAGE, default REGION-docker.pkg.dev/PROJECT/REPOSITORY/jaxstation:GIT_SHORT_SHA)
  --dry-run         print the commands, run nothing
EOF
}

die() { echo "error: $*" >&2; exit 2; }

quote() {  # one word, quoted for a shell only where it needs it
  local s=$1
  if [[ $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$s"; else printf "'%s'" "${s//\'/\'\\\'\'}"; fi
}

show() {
  local first=1 word
  for word in "$@"; do
    if (( first )); then first=0; else printf ' '; fi
    quote "$word"
  done
  printf '\n'
}

run() {  # print the command with --dry-run, else run it
  if (( DRY_RUN )); then show "$@"; else "$@"; fi
}

note() {  # a comment in the dry-run listing, a progress line otherwise
  if (( DRY_RUN )); then echo "# $*"; else echo "== $*" >&2; fi
}

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
COMMAND=${1:-}
[[ -n $COMMAND ]] || { usage; exit 2; }
shift
case $COMMAND in -h | --help | help) usage; exit 0 ;; esac

DRY_RUN=0
PROJECT=${PROJECT:-}
REGION=${REGION:-us-central1}
SERVICE=${SERVICE:-jaxstation}
REPOSITORY=${REPOSITORY:-jaxstation}
IMAGE=${IMAGE:-}
USE_DOCKER=0
MODEL_SOURCE=wheel
CHECKPOINT=deploy/no-checkpoint  # the Dockerfile's stand-in: nothing copied
MODEL_PATH=/mnt/model
MAX_INSTANCES=1
LANES=8
MAX_QUEUE=64
MAX_SEQ=2048
DTYPE=float32
TIMEOUT=300
COMPILE_CACHE=
MODEL=
EXTRA_ENV=()
KS="1 8"
NEW_TOKENS=64
REFERENCE="$REPO_ROOT/scripts/parity_reference.json"
URL=
PUBLIC=0
PERCENT=100
TO_REVISION=
FLAG_OFF=0
PROBE_PERIOD_S=10
PROBE_FAILURES=24  # x PROBE_PERIOD_S = 240 s, Cloud Run's cap for a startup probe

need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --project) need "$@"; PROJECT=$2; shift ;;
    --region) need "$@"; REGION=$2; shift ;;
    --service) need "$@"; SERVICE=$2; shift ;;
    --repository) need "$@"; REPOSITORY=$2; shift ;;
    --image) need "$@"; IMAGE=$2; shift ;;
    --docker) USE_DOCKER=1 ;;
    --model-source) need "$@"; MODEL_SOURCE=$2; shift ;;
    --checkpoint) need "$@"; CHECKPOINT=$2; shift ;;
    --model-path) need "$@"; MODEL_PATH=$2; shift ;;
    --max-instances) need "$@"; MAX_INSTANCES=$2; shift ;;
    --lanes) need "$@"; LANES=$2; shift ;;
    --max-queue) need "$@"; MAX_QUEUE=$2; shift ;;
    --max-seq) need "$@"; MAX_SEQ=$2; shift ;;
    --dtype) need "$@"; DTYPE=$2; shift ;;
    --timeout) need "$@"; TIMEOUT=$2; shift ;;
    --compile-cache) need "$@"; COMPILE_CACHE=$2; shift ;;
    --model) need "$@"; MODEL=$2; shift ;;
    --env) need "$@"; EXTRA_ENV+=("$2"); shift ;;
    --ks) need "$@"; KS=$2; shift ;;
    --new-tokens) need "$@"; NEW_TOKENS=$2; shift ;;
    --reference) need "$@"; REFERENCE=$2; shift ;;
    --url) need "$@"; URL=$2; shift ;;
    --public) PUBLIC=1 ;;
    --percent) need "$@"; PERCENT=$2; shift ;;
    --to) need "$@"; TO_REVISION=$2; shift ;;
    --flag-off) FLAG_OFF=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
  shift
done

for n in MAX_INSTANCES LANES MAX_QUEUE MAX_SEQ TIMEOUT NEW_TOKENS PERCENT; do
  [[ ${!n} =~ ^[0-9]+$ ]] || die "--$(echo "$n" | tr '[:upper:]_' '[:lower:]-') must be a whole number, got ${!n}"
done
(( PERCENT <= 100 )) || die "--percent must be in [0, 100], got $PERCENT"
case $MODEL_SOURCE in wheel | copy | mount) ;; *) die "--model-source must be wheel, copy or mount" ;; esac
[[ $MODEL_SOURCE != copy || $CHECKPOINT != deploy/no-checkpoint ]] || die "--model-source copy needs --checkpoint"

if [[ -z $PROJECT && ($COMMAND != burst || -z $URL) ]]; then
  if (( DRY_RUN )); then die "--project is needed with --dry-run (nothing is read from gcloud)"; fi
  PROJECT=$(gcloud config get-value project 2>/dev/null) || true
  [[ -n $PROJECT ]] || die "no project: pass --project or set PROJECT"
fi
TAG=$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo latest)
IMAGE=${IMAGE:-$REGION-docker.pkg.dev/$PROJECT/$REPOSITORY/jaxstation:$TAG}
WHERE=(--project "$PROJECT" --region "$REGION")

cmd_build() {
  local build_args=(--build-arg "MODEL_SOURCE=$MODEL_SOURCE")
  case $MODEL_SOURCE in
    copy) build_args+=(--build-arg "CHECKPOINT=$CHECKPOINT") ;;
    mount) build_args+=(--build-arg "MODEL_PATH=$MODEL_PATH") ;;
  esac
  if (( USE_DOCKER )); then
    note "build with the local docker engine (BuildKit) and push to Artifact Registry"
    run gcloud auth configure-docker "$REGION-docker.pkg.dev" --quiet
    run env DOCKER_BUILDKIT=1 docker build "${build_args[@]}" -t "$IMAGE" "$REPO_ROOT"
    run docker push "$IMAGE"
  else
    note "build on Cloud Build (scripts/cloudbuild.yaml) and push to Artifact Registry"
    run gcloud builds submit "$REPO_ROOT" --project "$PROJECT" --region "$REGION" \
      --config "$REPO_ROOT/scripts/cloudbuild.yaml" \
      --substitutions "_IMAGE=$IMAGE,_MODEL_SOURCE=$MODEL_SOURCE,_CHECKPOINT=$CHECKPOINT,_MODEL_PATH=$MODEL_PATH"
  fi
}

station_env() {  # the MOONSHINE_* variables of a deploy, comma-joined for --set-env-vars
  local env=(MOONSHINE_CONTINUOUS_BATCH=1 "MOONSHINE_BATCH_LANES=$LANES" "MOONSHINE_MAX_QUEUE=$MAX_QUEUE"
    "MOONSHINE_MAX_SEQ=$MAX_SEQ" "MOONSHINE_DTYPE=$DTYPE" MOONSHINE_DRAIN_S=6)
  [[ -n $COMPILE_CACHE ]] && env+=("MOONSHINE_COMPILE_CACHE_DIR=$COMPILE_CACHE")
  [[ -n $MODEL ]] && env+=("MOONSHINE_MODEL=$MODEL")
  env+=("${EXTRA_ENV[@]}")
  local IFS=,
  echo "${env[*]}"
}

cmd_deploy() {
  local traffic=(--no-traffic --tag canary)
  if (( ! DRY_RUN )) && ! gcloud run services describe "$SERVICE" "${WHERE[@]}" >/dev/null 2>&1; then
    note "$SERVICE does not exist yet: its first revision takes the traffic (Cloud Run refuses --no-traffic then)"
    traffic=(--tag canary)
  fi
  note "a new revision of $IMAGE as the canary, at 0% of the traffic"
  run gcloud run deploy "$SERVICE" "${WHERE[@]}" --image "$IMAGE" \
    --gpu 1 --gpu-type nvidia-l4 --cpu 8 --memory 32Gi --no-cpu-throttling \
    --min-instances 0 --max-instances "$MAX_INSTANCES" \
    --concurrency "$((LANES + MAX_QUEUE))" --timeout "$TIMEOUT" \
    --startup-probe "httpGet.path=/ready,httpGet.port=8080,initialDelaySeconds=0,periodSeconds=$PROBE_PERIOD_S,failureThreshold=$PROBE_FAILURES,timeoutSeconds=5" \
    --set-env-vars "$(station_env)" \
    "${traffic[@]}"
}

canary_url() {
  gcloud run services describe "$SERVICE" "${WHERE[@]}" --format json \
    | "$PY" -c 'import json, sys; print(next(t["url"] for t in json.load(sys.stdin)["status"]["traffic"] if t.get("tag") == "canary"))'
}

cmd_burst() {
  local url=$URL
  if [[ -z $url ]]; then
    note "the canary tag's URL, read from the service"
    if (( DRY_RUN )); then
      show gcloud run services describe "$SERVICE" "${WHERE[@]}" --format json
      url=CANARY_URL
    else
      url=$(canary_url)
    fi
  fi
  if (( ! PUBLIC )); then
    note "an identity token as the bearer (the service is private)"
    if (( DRY_RUN )); then
      show gcloud auth print-identity-token
    else
      JAXSTATION_BEARER_TOKEN=$(gcloud auth print-identity-token)
      export JAXSTATION_BEARER_TOKEN
    fi
  fi
  local ks
  read -r -a ks <<< "$KS"
  note "burst: throughput at K = $KS with every reply checked, then the parity probe"
  (cd "$REPO_ROOT" && run "$PY" -m bench.throughput --url "$url" --ks "${ks[@]}" --new-tokens "$NEW_TOKENS" --reps 1 \
    --name burst)
  (cd "$REPO_ROOT" && run "$PY" -m scripts.parity_probe check --url "$url" --reference "$REFERENCE")
}

cmd_promote() {
  note "$PERCENT% of the traffic to the canary"
  run gcloud run services update-traffic "$SERVICE" "${WHERE[@]}" --to-tags "canary=$PERCENT"
  if (( PERCENT == 100 )); then
    note "the service follows its latest revision from now on"
    run gcloud run services update-traffic "$SERVICE" "${WHERE[@]}" --to-latest
  fi
}

cmd_rollback() {
  if (( FLAG_OFF )); then
    note "a NEW revision: the same image with MOONSHINE_CONTINUOUS_BATCH=0; it pays a cold start"
    run gcloud run services update "$SERVICE" "${WHERE[@]}" --update-env-vars MOONSHINE_CONTINUOUS_BATCH=0
    run gcloud run services update-traffic "$SERVICE" "${WHERE[@]}" --to-latest
    return
  fi
  local previous=$TO_REVISION
  if [[ -z $previous ]]; then
    note "PREVIOUS: the revision before the newest, read from the service"
    local list=(gcloud run revisions list --service "$SERVICE" "${WHERE[@]}"
      --sort-by ~metadata.creationTimestamp --limit 2 --format 'value(metadata.name)')
    if (( DRY_RUN )); then
      show "${list[@]}"
      previous=PREVIOUS
    else
      previous=$("${list[@]}" | sed -n 2p)
      [[ -n $previous ]] || die "$SERVICE has no revision before its newest one"
    fi
  fi
  note "100% of the traffic to $previous: instant, no new revision"
  run gcloud run services update-traffic "$SERVICE" "${WHERE[@]}" --to-revisions "$previous=100"
}

case $COMMAND in
  build) cmd_build ;;
  deploy) cmd_deploy ;;
  burst) cmd_burst ;;
  promote) cmd_promote ;;
  rollback) cmd_rollback ;;
  *) die "unknown subcommand $COMMAND (see --help)" ;;
esac
