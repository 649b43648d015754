"""Every reply a test server sends, checked against the app's own OpenAPI document.

`ReplyCheck` wraps a station app (ASGI) and records each JSON reply and each server-sent event; `problems()` lists
those whose body does not match the schema the document gives for its path, method and status, and the statuses the
document does not declare. `ServerThread` (tests/server_util.py) wraps every app it serves and fails the test on a
problem, so the document and the wire format cannot drift apart anywhere in the suite.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

NO_BODY = (499,)  # a client gone: nobody reads the reply


class ReplyCheck:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.replies: list[tuple[str, str, int, str, bytes]] = []  # path, method, status, content type, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        head: dict[str, Any] = {}
        body: list[bytes] = []

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                head["status"] = message["status"]
                head["type"] = dict(message.get("headers") or ()).get(b"content-type", b"").decode()
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.replies.append((scope["path"], scope["method"], head["status"], head["type"], b"".join(body)))
            await send(message)

        await self.app(scope, receive, recording_send)

    def problems(self) -> list[str]:
        document = getattr(getattr(self.app, "state", None), "openapi", None)
        if document is None:
            return []
        doc = document()
        out = []
        for path, method, status, ctype, body in self.replies:
            op = doc["paths"].get(path, {}).get(method.lower())
            if op is None or status in NO_BODY:
                continue  # not a route of the document (404, 405), or no reply to check
            reply = op["responses"].get(str(status))
            if reply is None:
                out.append(f"{method} {path}: status {status} is not in the document")
                continue
            out += [f"{method} {path} {status}: {p}" for p in _check(reply["content"], ctype, body, doc)]
        return out


def _check(content: dict[str, Any], ctype: str, body: bytes, doc: dict[str, Any]) -> list[str]:
    """What is wrong with `body` (of content type `ctype`) against the document's `content` of its reply."""
    if ctype.startswith("text/event-stream"):
        data = content["text/event-stream"]["schema"]["properties"]["data"]["anyOf"][0]["contentSchema"]
        events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
        return [e for ev in events if ev != "[DONE]" for e in _errors(json.loads(ev), data, doc)]
    if not ctype.startswith("application/json"):
        return []
    if "application/json" not in content:
        return [f"a JSON reply where the document says {sorted(content)}"]
    return _errors(json.loads(body), content["application/json"]["schema"], doc)


def _errors(value: Any, schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    root = {**schema, "components": doc["components"]}
    validator = jsonschema.Draft202012Validator(root)
    return [f"{'/'.join(map(str, e.absolute_path)) or 'the body'}: {e.message[:200]}"
            for e in validator.iter_errors(value)]
