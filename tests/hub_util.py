"""A local Hugging Face Hub for the tests: a real HTTP server on a random loopback port that answers the Hub's routes
the `huggingface_hub` client calls (a model's info, its file tree, and each file, HEAD and GET with a Range) for
repositories made of local files; and a GGUF file split into parts as llama.cpp's `gguf-split` writes them."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import struct
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jaxstation.model.gguf_file import _Cursor

TOKEN = "hf_test_token"  # the one token the gated repository lets through
ALIGNMENT = 32


@contextmanager
def local_hub(repos: dict[str, dict[str, bytes | Path]], gated: frozenset[str] = frozenset()) -> Iterator[LocalHub]:
    """Serve `repos` (repo id -> file path in the repo -> its bytes, or a file holding them) at one revision, "main";
    a repo in `gated` serves its files only to requests carrying TOKEN."""
    hub = LocalHub(repos, gated)
    thread = threading.Thread(target=hub.server.serve_forever, name="local-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release.set()
        hub.server.shutdown()
        hub.server.server_close()
        thread.join(10)


class LocalHub:
    """The Hub's routes over `repos`. `cut`: a file path whose next GET sends half its bytes and closes the connection
    (a download cut halfway); `hold`: one whose GETs send half and then hold the connection open until `release` is
    set (a download a kill interrupts); `ranges`: the Range headers of the GETs served."""

    def __init__(self, repos: dict[str, dict[str, bytes | Path]], gated: frozenset[str]) -> None:
        self.repos = {repo: {name: data if isinstance(data, bytes) else data.read_bytes()
                             for name, data in files.items()} for repo, files in repos.items()}
        self.gated = gated
        self.cut: str | None = None
        self.hold: str | None = None
        self.half_sent = threading.Event()
        self.release = threading.Event()
        self.ranges: list[str | None] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()


INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/.*)?)?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: LocalHub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self, payload: object) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _repo(self, repo: str, rev: str) -> dict[str, bytes] | None:
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if urllib.parse.unquote(rev) not in ("main", hub.sha(repo)):
                self._error(404, "RevisionNotFound", "Invalid rev id")
                return None
            return hub.repos[repo]

        def _answer(self, body: bool) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if m := INFO.match(path):
                if (files := self._repo(m["repo"], m["rev"] or "main")) is None:
                    return
                if m["kind"] == "tree":
                    return self._json([{"type": "file", "path": name, "size": len(data),
                                        "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()])
                siblings = [{"rfilename": name, "size": len(data)} for name, data in files.items()]
                return self._json({"id": m["repo"], "sha": hub.sha(m["repo"]), "siblings": siblings, "private": False,
                                   "gated": "manual" if m["repo"] in hub.gated else False})
            m = RESOLVE.match(path)
            if m is None:
                return self._error(404, "EntryNotFound", "no such route")
            if (files := self._repo(m["repo"], m["rev"])) is None:
                return
            if m["repo"] in hub.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._error(401, "GatedRepo", "Access to model is restricted")
            name = urllib.parse.unquote(m["path"])
            if name not in files:
                return self._error(404, "EntryNotFound", "Entry not found")
            self._file(m["repo"], name, files[name], body)

        def _file(self, repo: str, name: str, data: bytes, body: bool) -> None:
            start = 0
            if body:
                hub.ranges.append(self.headers.get("Range"))
                if (asked := re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")) is not None:
                    start = int(asked[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in (hub.cut, hub.hold):
                self.wfile.write(data[start:len(data) // 2])
                self.wfile.flush()
                hub.half_sent.set()
                if name == hub.cut:
                    hub.cut = None
                else:
                    hub.release.wait(60)
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


def split_gguf(source: Path, out: Path, stem: str, parts: int) -> list[Path]:
    """`source` as `parts` GGUF files `out/<stem>-0000k-of-0000N.gguf`, as llama.cpp's gguf-split writes them: the
    first holds the metadata, every part some of the tensors and the split.* keys."""
    buf = memoryview(source.read_bytes())
    cur = _Cursor(buf)
    cur.take(4)
    version, n_tensors, n_fields = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    fields_start = cur.pos
    for _ in range(n_fields):
        cur.string()
        cur.value(cur.scalar("<I"))
    fields = bytes(buf[fields_start:cur.pos])
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        table.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    data_start = -(-cur.pos // ALIGNMENT) * ALIGNMENT
    ends = [offset for *_, offset in table[1:]] + [len(buf) - data_start]
    chunks = [bytes(buf[data_start + t[3]:data_start + end]) for t, end in zip(table, ends, strict=True)]

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    paths, per = [], -(-n_tensors // parts)
    for i in range(parts):
        mine = list(range(i * per, min((i + 1) * per, n_tensors)))
        split = (string("split.no") + struct.pack("<IH", 2, i) + string("split.count") + struct.pack("<IH", 2, parts)
                 + string("split.tensors.count") + struct.pack("<Ii", 5, n_tensors))
        head = b"GGUF" + struct.pack("<IQQ", version, len(mine), (n_fields if i == 0 else 0) + 3)
        head += (fields if i == 0 else b"") + split
        offset, infos, data = 0, b"", b""
        for k in mine:
            name, dims, kind, _ = table[k]
            infos += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            infos += struct.pack("<IQ", kind, offset)
            padded = chunks[k] + b"\0" * (-len(chunks[k]) % ALIGNMENT)
            data += padded
            offset += len(padded)
        head += infos
        path = out / f"{stem}-{i + 1:05d}-of-{parts:05d}.gguf"
        path.write_bytes(head + b"\0" * (-len(head) % ALIGNMENT) + data)
        paths.append(path)
    return paths
