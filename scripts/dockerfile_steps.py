"""Read the Dockerfile as the image would see it, and run its RUN steps here in a fresh virtual environment.

This checks the Dockerfile without a container engine (scripts/build_image_local.sh builds the image for real):
`image()` follows the stages the final FROM picks (ARG, ENV, WORKDIR, COPY, RUN, USER, CMD, HEALTHCHECK), and `main`
copies the build context (what .dockerignore lets through) under a temporary root, moves the image's absolute paths
(/opt, /home, /mnt, in the environment and in the commands) under that root, and runs every RUN command with
`sh -c`, in order, with the image's environment. A RUN that changes the system itself (useradd, apt-get) needs the
image's root file system: it is listed as not run.

Usage:
  python scripts/dockerfile_steps.py                                   # DEVICE=cuda, MODEL_SOURCE=wheel (the defaults)
  python scripts/dockerfile_steps.py --build-arg MODEL_SOURCE=mount
  python scripts/dockerfile_steps.py --keep /tmp/image-root            # keep the root (and its venv) afterwards
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYSTEM_COMMANDS = ("useradd", "groupadd", "adduser", "apt-get", "chown")  # need the image's root file system
_REROOT = ("/opt/", "/home/", "/mnt/")
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_ABSOLUTE = re.compile(r"(?<![\w.$}/-])(?=/(?:opt|home|mnt)/)")  # where an image path starts inside a command


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    value: str  # the rest of the (joined) line
    line: int


@dataclasses.dataclass
class Run:
    stage: str
    command: str
    env: dict[str, str]
    workdir: str
    line: int


@dataclasses.dataclass
class Image:
    """What one build (one set of build arguments) would produce: its stages and the final image's settings."""

    stages: list[str]
    env: dict[str, str]
    workdir: str
    user: str | None
    cmd: list[str]
    healthcheck: str | None
    copies: list[tuple[list[str], str]]  # (sources in the context, destination)
    runs: list[Run]


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, value = buf.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
        buf = ""
    return out


def expand(value: str, variables: dict[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m.group(1) or m.group(2), ""), value)


def _pairs(value: str) -> list[tuple[str, str]]:
    """ENV/ARG key=value pairs (quotes removed)."""
    out = []
    for word in shlex.split(value, posix=True):
        key, sep, val = word.partition("=")
        out.append((key, val if sep else ""))
    return out


def _flags(value: str) -> tuple[dict[str, str], str]:
    flags = {}
    while value.startswith("--"):
        word, _, value = value.partition(" ")
        key, _, val = word[2:].partition("=")
        flags[key] = val
        value = value.strip()
    return flags, value


def image(dockerfile: Path = REPO / "Dockerfile", build_args: dict[str, str] | None = None,
          base_env: dict[str, str] | None = None) -> Image:
    """Follow the stages the final FROM picks. base_env: the base image's own environment (e.g. its PATH)."""
    build_args = build_args or {}
    instructions = parse(dockerfile.read_text())
    global_args: dict[str, str] = {}
    stages: dict[str, list[Instruction]] = {}
    order: list[tuple[str, str]] = []  # (name, FROM image or stage)
    current: list[Instruction] | None = None
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.value.split()
            src = expand(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage-{len(order)}"
            current = stages.setdefault(name, [])
            order.append((name, src))
        elif current is None:
            if ins.keyword == "ARG":
                for key, default in _pairs(ins.value):
                    global_args[key] = build_args.get(key, default)
        else:
            current.append(ins)
    parents = dict(order)

    def chain(name: str) -> list[str]:
        src = parents[name]
        return (chain(src) if src in parents else []) + [name]

    final = order[-1][0]
    names = chain(final)
    env: dict[str, str] = {}
    img = Image(stages=names, env=env, workdir="/", user=None, cmd=[], healthcheck=None, copies=[], runs=[])
    for name in names:
        args: dict[str, str] = {}
        for ins in stages[name]:
            scope = {**(base_env or {}), **args, **env}
            if ins.keyword == "ARG":
                for key, default in _pairs(ins.value):
                    args[key] = build_args.get(key, expand(default, scope))
            elif ins.keyword == "ENV":
                for key, val in _pairs(expand(ins.value, scope)):
                    env[key] = val
            elif ins.keyword == "WORKDIR":
                img.workdir = os.path.join(img.workdir, expand(ins.value, scope))
            elif ins.keyword == "COPY":
                _, rest = _flags(ins.value)
                words = [expand(w, scope) for w in rest.split()]
                img.copies.append((words[:-1], os.path.join(img.workdir, words[-1])))
            elif ins.keyword == "RUN":
                img.runs.append(Run(name, ins.value, {**args, **env}, img.workdir, ins.line))  # sh expands it
            elif ins.keyword == "USER":
                img.user = ins.value
            elif ins.keyword == "CMD":
                img.cmd = _json_or_shell(ins.value)
            elif ins.keyword == "HEALTHCHECK":
                img.healthcheck = ins.value
    return img


def _json_or_shell(value: str) -> list[str]:
    import json

    return json.loads(value) if value.startswith("[") else ["/bin/sh", "-c", value]


def dockerignore_patterns(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `rel` (a context-relative path) out; patterns match a path or any parent of it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        p = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix.rsplit("/", 1)[-1], p):
                return True
    return False


def copy_context(context: Path, dest: Path) -> list[str]:
    """Copy the build context as docker would send it; return what was sent."""
    patterns = dockerignore_patterns(context)
    sent = []
    for path in sorted(context.rglob("*")):
        rel = path.relative_to(context).as_posix()
        if path.is_file() and not ignored(rel, patterns):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)
            sent.append(rel)
    return sent


def _reroot(value: str, root: Path) -> str:
    """Move the image's absolute paths under `root` (also inside PATH-like lists)."""
    return ":".join(str(root) + p if p.startswith(_REROOT) else p for p in value.split(":"))


def run_steps(img: Image, context: Path, root: Path, runs: list[Run] | None = None) -> list[tuple[Run, str, float]]:
    """Copy the context, do the COPY steps, run each RUN (or only `runs`). Returns (step, "ok" | "not run: ..." |
    "FAILED", seconds)."""
    sent = root / "context"
    copy_context(context, sent)
    for sources, dest in img.copies:
        target = Path(_reroot(dest, root))
        for src in sources:
            s = sent / src
            if s.is_dir():  # docker copies a directory's contents
                shutil.copytree(s, target, dirs_exist_ok=True)
            else:
                (target if dest.endswith("/") else target.parent).mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, target / s.name if dest.endswith("/") else target)
    results = []
    for step in img.runs if runs is None else runs:
        system = [w for w in shlex.split(step.command) if w in SYSTEM_COMMANDS]
        if system:
            results.append((step, f"not run: {system[0]} changes the system; it needs the image's root file system",
                            0.0))
            continue
        env = {**os.environ, **{k: _reroot(v, root) for k, v in step.env.items()}}
        env["PATH"] = _reroot(step.env.get("PATH", os.environ["PATH"]), root)
        workdir = Path(_reroot(step.workdir, root))
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"--- line {step.line} ({step.stage}): {step.command}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call(["sh", "-c", _ABSOLUTE.sub(str(root), step.command)], cwd=workdir, env=env)
        results.append((step, "ok" if rc == 0 else f"FAILED (exit {rc})", time.perf_counter() - t))
        if rc:
            break
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-arg", action="append", default=[], help="NAME=VALUE, as docker build takes it")
    ap.add_argument("--keep", type=Path, help="use this directory as the root and keep it")
    args = ap.parse_args()
    build_args = dict(a.split("=", 1) for a in args.build_arg)
    img = image(build_args=build_args, base_env={"PATH": os.environ["PATH"]})
    root = args.keep or Path(tempfile.mkdtemp(prefix="jaxstation-image-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        results = run_steps(img, REPO, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nstages: {' -> '.join(img.stages)}; the image itself was not built (scripts/build_image_local.sh does)")
    for step, outcome, seconds in results:
        print(f"  line {step.line:3d} {step.stage:12s} {outcome} ({seconds:.0f} s): {step.command}")
    return 0 if all(o == "ok" or o.startswith("not run") for _, o, _ in results) and \
        len(results) == len(img.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
