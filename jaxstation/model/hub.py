"""A model named as on the Hugging Face Hub, `org/name` or `org/name:QUANT`, made a local checkpoint with
`huggingface_hub`: downloaded into the standard Hugging Face cache (or found there), and the path the loader reads.

- A repository with `config.json` and `*.safetensors` gives its safetensors checkpoint: `config.json`, the weights
  (`consolidated*.safetensors`, Mistral's own format, only where no other weights are), the shard index and the
  tokenizer, generation and chat-template files; no other weights format. The path is the snapshot's directory.
- A repository of `.gguf` files gives one of them: `:QUANT` picks the file whose name ends in that quant
  (case-insensitive, as llama.cpp's `-hf` does), a name without one picks `Q4_K_M`, else the smallest file. A model
  split in parts (`-00001-of-0000N.gguf`) downloads every part; the path is its first part. Multimodal projectors
  (`mmproj*`) are never picked.
- `HF_HUB_OFFLINE=1`, or a Hub that cannot be reached, uses what the cache holds (a model that transformers or
  llama.cpp downloaded there included) and, for a GGUF file, llama.cpp's own older cache (`$LLAMA_CACHE` or
  `~/.cache/llama.cpp`, files named `org_name_FILE.gguf`). `HF_TOKEN` is sent for gated repositories, `HF_ENDPOINT`
  names another Hub. `huggingface_hub` writes each file to an `*.incomplete` file and moves it into place once
  whole: a connection cut midway resumes where it stopped (a Range request), a snapshot never shows a partial file,
  and a download killed midway fetches that file again at the next start.

Every failure is one `HubError` line: no such repository or revision, no file of a served format (listing what the
repository holds), an unknown quant (listing the quants there are), a gated repository without a token, no network.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from jaxstation.model.source import SPLIT_NAME, CheckpointError

HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<tag>[\w.-]+))?$")
DEFAULT_QUANT = "Q4_K_M"
QUANT = re.compile(r"[-._](?P<tag>(?:I?Q\d|TQ\d|MXFP\d)\w*|B?F16|F32)$", re.I)  # the quant a GGUF file name ends in
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")
LISTED = 12  # how many of a repository's files an error lists


class HubError(CheckpointError):
    """A Hub model that cannot be made a local checkpoint; the message says why in one line."""


def is_hub_name(name: str | None) -> bool:
    """Whether `name` names a Hub model (`org/name`, `org/name:QUANT`) rather than a local path: it is not a path
    that exists, and has the form of one."""
    return name is not None and not Path(name).exists() and HUB_NAME.match(name) is not None


def fetch(name: str, revision: str | None = None) -> Path:
    """The local checkpoint of the Hub model `name` at `revision` (a branch, tag or commit; default: main),
    downloaded with a progress bar where the cache lacks it. Raises HubError."""
    from huggingface_hub import HfApi, constants, errors, snapshot_download

    repo, tag = _split(name)
    page = f"{constants.ENDPOINT}/{repo}"
    at = f" at revision {revision!r}" if revision else ""
    if constants.HF_HUB_OFFLINE:
        return _cached(name, revision, "HF_HUB_OFFLINE is set")
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except errors.GatedRepoError:
        return _cached(name, revision, _gated(name, page))
    except errors.RepositoryNotFoundError:
        raise HubError(f"no model {repo} on the Hub ({page}; a private one needs HF_TOKEN), and no local path "
                       f"{name}") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {revision!r} on the Hub ({page})") from None
    except Exception as e:  # no network, a proxy, the Hub down: the cache may hold it
        return _cached(name, revision, f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: "
                                       f"{_first_line(e)})")
    files = {s.rfilename: s.size or 0 for s in info.siblings or ()}
    chosen = _choose(repo, files, tag)
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=chosen))
    except errors.GatedRepoError:
        return _cached(name, revision, _gated(name, page))
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, OSError) as e:
        raise HubError(f"downloading {name}{at} failed ({type(e).__name__}: {_first_line(e)}); run it again to "
                       "resume") from None
    return folder if chosen[0] in CONFIG_FILES else folder / chosen[0]


def _split(name: str) -> tuple[str, str | None]:
    m = HUB_NAME.match(name)
    if m is None:
        raise HubError(f"{name!r} is not a Hub model name (org/name, or org/name:QUANT for a GGUF repository)")
    return m["repo"], m["tag"]


def _gated(name: str, page: str) -> str:
    token = "HF_TOKEN's account has not been granted access" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set"
    return f"{name} is a gated model: accept its terms at {page} and set HF_TOKEN to a token of that account ({token})"


def _first_line(error: Exception) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _listing(files: dict[str, int]) -> str:
    names = sorted(files)
    return ", ".join(names[:LISTED]) + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def _choose(repo: str, files: dict[str, int], tag: str | None) -> list[str]:
    """The files to download of a repository holding `files` (path -> bytes): the safetensors checkpoint's, or the
    parts of one GGUF model. The first is config.json or the GGUF model's first part."""
    weights = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    if tag is None and "config.json" in files and weights:
        native = [f for f in weights if not f.startswith("consolidated")]
        return [f for f in CONFIG_FILES if f in files] + sorted(native or weights)
    models = _gguf_models(files)
    if not models:
        raise HubError(f"{repo} holds no safetensors checkpoint (config.json and *.safetensors) and no .gguf file; "
                       f"it holds {_listing(files) or 'no file'}")
    if tag is not None:
        matching = [m for m in models if (q := QUANT.search(_stem(m[0]))) and q["tag"].upper() == tag.upper()]
        if not matching:
            tags = sorted({q["tag"].upper() for m in models if (q := QUANT.search(_stem(m[0])))})
            raise HubError(f"{repo} has no GGUF file of quant {tag}; its quants: {', '.join(tags) or 'none named'} "
                           f"(files: {_listing({m[0]: 0 for m in models})})")
        return sorted(matching)[0]
    default = [m for m in models if (q := QUANT.search(_stem(m[0]))) and q["tag"].upper() == DEFAULT_QUANT]
    return sorted(default)[0] if default else min(models, key=lambda m: (sum(files[p] for p in m), m))


def _stem(path: str) -> str:
    """A GGUF file's name less its directory, its split part and `.gguf`."""
    name = path.rsplit("/", 1)[-1]
    m = SPLIT_NAME.match(name)
    return m["base"] if m else name.removesuffix(".gguf")


def _gguf_models(files: dict[str, int]) -> list[list[str]]:
    """The GGUF models among `files`: each a list of its files, the first part first (a split model whose parts are
    not all there is left out)."""
    models = []
    for path in sorted(f for f in files if f.endswith(".gguf") and not f.rsplit("/", 1)[-1].startswith("mmproj")):
        m = SPLIT_NAME.match(path.rsplit("/", 1)[-1])
        if m is None:
            models.append([path])
        elif int(m["no"]) == 1:
            count, base = int(m["count"]), path[:-len(m.group(0))] + m["base"]
            parts = [f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
            if all(p in files for p in parts):
                models.append(parts)
    return models


def _cached(name: str, revision: str | None, reason: str) -> Path:
    """The checkpoint the caches hold for the Hub model `name` (the Hugging Face cache's snapshot of `revision`, else
    llama.cpp's older flat cache), asked for since `reason` keeps the Hub from answering; else HubError."""
    from huggingface_hub import constants

    repo, tag = _split(name)
    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit if commit else None
    if snapshot is not None and snapshot.is_dir():
        files = {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
        try:
            chosen = _choose(repo, files, tag)
        except HubError as e:
            raise HubError(f"{e} (in the cache, at {snapshot}: {reason})") from None
        return snapshot if chosen[0] in CONFIG_FILES else snapshot / chosen[0]
    llama = Path(os.environ.get("LLAMA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "llama.cpp")
    prefix = repo.replace("/", "_") + "_"
    flat = {p.name[len(prefix):]: p.stat().st_size for p in llama.glob(f"{prefix}*.gguf")} if revision is None else {}
    with contextlib.suppress(HubError):
        if flat:
            return llama / (prefix + _choose(repo, flat, tag)[0])
    at = f" at revision {revision!r}" if revision else ""
    raise HubError(f"{reason}, and {name}{at} is not in the cache ({constants.HF_HUB_CACHE})")
