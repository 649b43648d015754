#!/usr/bin/env bash
# Build jaxstation's image on this machine and check it the way Cloud Run runs it: build with podman (or docker where
# a daemon runs), run the container, wait for /ready, send one chat request, then stop it during a long generation and
# check the exit code and how long the stop took against Cloud Run's 10 s.
#
# Where the registry's python image is unreachable, the base is made from Debian packages (debootstrap trixie, with
# its Python 3.13) and imported as localhost/jaxstation-base:trixie. Podman runs with runc, nofile and nproc limits
# this machine allows (a containers.conf of its own), and this machine's CA bundle mounted into the build for pip, so
# a build works behind a TLS-inspecting proxy. It needs root (or a docker daemon), the network to PyPI and Debian, and,
# for the default CUDA image, about 6 GB of disk for the CUDA wheels. Not part of .ci/run.
#
#   scripts/build_image_local.sh                 # the default image (DEVICE=cuda), run here on CPU
#   scripts/build_image_local.sh --device cpu    # the CPU image (g++ and the CPU kernels, no CUDA wheels)
#   scripts/build_image_local.sh --out bench/results/image-cpu.json
# It prints one JSON object with the figures and exits non-zero if any check fails.
set -euo pipefail

DEVICE=cuda
OUT=
PORT=18080
STOP_LIMIT_S=8.5  # Cloud Run kills 10 s after SIGTERM; the stop must leave a margin
while [[ $# -gt 0 ]]; do
  case $1 in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift ;;
    --out) OUT=${2:?--out needs a file}; shift ;;
    --port) PORT=${2:?--port needs a number}; shift ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $DEVICE in cuda | cpu) ;; *) echo "--device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=localhost/jaxstation:$DEVICE
CONTAINER=jaxstation-check-$DEVICE
LOCAL_BASE=localhost/jaxstation-base:trixie
WORK=$(mktemp -d)
say() { echo "== $*" >&2; }
fail() { echo "FAILED: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

# ---- the engine ------------------------------------------------------------------------------------------------------
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  ENGINE=docker
else
  if ! command -v podman >/dev/null; then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
      fail "no docker daemon and no podman: install podman"
    fi
    say "installing podman, runc and debootstrap (apt-get)"
    apt-get install -y --no-install-recommends podman runc debootstrap >&2
  fi
  ENGINE=podman
  # podman raises nofile and nproc past what this kind of machine allows unless told, and runc then refuses to start
  # a step ("error setting rlimit"): nofile at the hard limit, nproc at most 32768 (the hard limit itself is refused)
  NOFILE=$(ulimit -Hn)
  NPROC=$(ulimit -Hu)
  [[ $NPROC == unlimited ]] || (( NPROC > 32768 )) && NPROC=32768
  cat > "$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]

[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF=$WORK/containers.conf
fi
cleanup() {
  "$ENGINE" rm -f "$CONTAINER" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# ---- the base image --------------------------------------------------------------------------------------------------
BASE_ARGS=()
if "$ENGINE" image exists "$LOCAL_BASE" 2>/dev/null || "$ENGINE" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
  say "base: $LOCAL_BASE (made earlier from Debian packages)"
  BASE_ARGS=(--build-arg "BASE_IMAGE=$LOCAL_BASE")
elif timeout 60 "$ENGINE" pull -q docker.io/library/python:3.12-slim >/dev/null 2>&1; then
  say "base: python:3.12-slim from the registry"
else
  command -v debootstrap >/dev/null || fail "the registry is unreachable and debootstrap is not installed"
  say "the registry is unreachable: making $LOCAL_BASE with debootstrap trixie"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates trixie "$WORK/rootfs" \
    http://deb.debian.org/debian >&2
  rm -rf "$WORK/rootfs/var/cache/apt/archives"/*.deb "$WORK/rootfs/var/lib/apt/lists"/*
  tar -C "$WORK/rootfs" -c . | "$ENGINE" import --change 'CMD ["python3"]' - "$LOCAL_BASE" >&2
  rm -rf "$WORK/rootfs"
  BASE_ARGS=(--build-arg "BASE_IMAGE=$LOCAL_BASE")
fi

# ---- the build -------------------------------------------------------------------------------------------------------
BUILD_FLAGS=()
CA=/etc/ssl/certs/ca-certificates.crt
if [[ $ENGINE == podman && -f $CA ]]; then
  # pip reads /etc/pip.conf: this machine's CA bundle, for a proxy that inspects TLS; apt reads the same bundle
  printf '[global]\ncert = /etc/ssl/certs/host-ca-bundle.crt\n' > "$WORK/pip.conf"
  BUILD_FLAGS=(--format docker -v "$CA:/etc/ssl/certs/host-ca-bundle.crt:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro")
fi
say "building $IMAGE (DEVICE=$DEVICE) with $ENGINE"
t0=$(now)
"$ENGINE" build "${BUILD_FLAGS[@]}" "${BASE_ARGS[@]}" --build-arg "DEVICE=$DEVICE" -t "$IMAGE" "$REPO_ROOT" >&2
BUILD_S=$(since "$t0")
IMAGE_BYTES=$("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE")
HEALTHCHECK=$("$ENGINE" image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")
[[ $HEALTHCHECK == *health* ]] || fail "the image has no HEALTHCHECK: $HEALTHCHECK"

# ---- run it ----------------------------------------------------------------------------------------------------------
URL=http://127.0.0.1:$PORT
"$ENGINE" rm -f "$CONTAINER" >/dev/null 2>&1 || true
t0=$(now)
RUN_FLAGS=()
# podman runs health checks from systemd timers; without systemd, this script runs the check itself (below)
[[ $ENGINE == podman ]] && RUN_FLAGS=(--health-interval disable)
"$ENGINE" run -d "${RUN_FLAGS[@]}" --name "$CONTAINER" -p "127.0.0.1:$PORT:8080" "$IMAGE" >/dev/null
until curl -fs "$URL/ready" >/dev/null; do
  [[ $("$ENGINE" inspect --format '{{.State.Running}}' "$CONTAINER") == true ]] \
    || { "$ENGINE" logs "$CONTAINER" >&2; fail "the container exited before /ready"; }
  (( $(python3 -c "print(int(float('$(since "$t0")') > 600))") == 0 )) || fail "/ready not 200 after 600 s"
  sleep 0.5
done
READY_S=$(since "$t0")
say "/ready after $READY_S s"
if [[ $ENGINE == podman ]]; then
  "$ENGINE" healthcheck run "$CONTAINER" >&2 || fail "the image's HEALTHCHECK failed on a ready station"
fi
USER_ID=$("$ENGINE" exec "$CONTAINER" id -u)
[[ $USER_ID == 10001 ]] || fail "the station runs as uid $USER_ID, not 10001"

CHAT=$(curl -fsS "$URL/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
       "temperature": 0}' \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
say "chat: $CHAT"
[[ $CHAT == *Paris* ]] || fail "the chat reply does not name Paris: $CHAT"

# ---- stop it during a long generation --------------------------------------------------------------------------------
curl -s -o "$WORK/long.json" -w '%{http_code}' "$URL/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true}' > "$WORK/long.status" &
LONG=$!
until curl -fs "$URL/metrics" | grep -Eq '^jaxstation_busy_lanes [1-9]'; do sleep 0.2; done
sleep 1
t0=$(now)
"$ENGINE" stop -t 10 "$CONTAINER" >/dev/null
STOP_S=$(since "$t0")
wait "$LONG" || true
LONG_STATUS=$(cat "$WORK/long.status")
EXIT_CODE=$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$CONTAINER")
"$ENGINE" logs "$CONTAINER" > "$WORK/station.log" 2>&1
TRACEBACKS=$(grep -c Traceback "$WORK/station.log" || true)
grep -E ' (WARNING|ERROR) ' "$WORK/station.log" | sed 's/^/   station: /' >&2 || true
say "stop: $STOP_S s, exit code $EXIT_CODE, the request in flight got $LONG_STATUS"

RESULT=$(python3 - "$DEVICE" "$ENGINE" "${BASE_ARGS[*]:-python:3.12-slim}" "$BUILD_S" "$IMAGE_BYTES" "$READY_S" \
  "$CHAT" "$STOP_S" "$EXIT_CODE" "$LONG_STATUS" "$TRACEBACKS" <<'EOF'
import json, sys
device, engine, base, build_s, size, ready_s, chat, stop_s, code, status, tracebacks = sys.argv[1:]
print(json.dumps({"device": device, "engine": engine, "base": base.removeprefix("--build-arg BASE_IMAGE="),
                  "build_s": float(build_s), "image_gb": round(int(size) / 1e9, 2), "ready_s": float(ready_s),
                  "chat_reply": chat, "stop_under_load_s": float(stop_s), "exit_code": int(code),
                  "in_flight_status": int(status), "log_tracebacks": int(tracebacks)}, indent=1))
EOF
)
echo "$RESULT"
[[ -z $OUT ]] || echo "$RESULT" > "$OUT"
[[ $EXIT_CODE == 0 ]] || fail "the station exited $EXIT_CODE after SIGTERM"
python3 -c "import sys; sys.exit(float('$STOP_S') > $STOP_LIMIT_S)" \
  || fail "the stop took $STOP_S s (limit $STOP_LIMIT_S)"
[[ $LONG_STATUS == 503 || $LONG_STATUS == 200 ]] || fail "the request in flight got HTTP $LONG_STATUS"
(( TRACEBACKS == 0 )) || { cat "$WORK/station.log" >&2; fail "the station's log holds a traceback"; }
say "all checks passed"
