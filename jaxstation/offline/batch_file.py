"""OpenAI's batch files, declared once as pydantic models: the input's lines (`custom_id`, `method`, `url`, `body`)
and the output's (`id`, `custom_id`, `response` with `status_code`, `request_id` and `body`, or `error`).

The input is checked whole before anything runs: every `custom_id` once (as OpenAI's Batch API requires), so that
the output names each line once. The output is appended one whole line at a time (one write of the line and its
newline) and so survives a killed run; a run over an output that holds lines already answers only the input lines
not yet there: those with a `custom_id` not in it, and of the lines that have none (not JSON, or without the field,
answered with an error line whose `custom_id` is null, in input order as they are read), those past as many as it
holds. A last line cut short by a kill is dropped and its request run again. Plain Python, no JAX.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxstation.config.setting_values import ConfigError
from jaxstation.server.errors import describe

URLS = ("/v1/chat/completions", "/v1/completions")


class BatchFileError(ConfigError):
    """An input or output file that a batch cannot run over; the message names the file and the line."""


class InputLine(BaseModel):
    """One request of the input file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineError(BaseModel):
    code: str
    message: str


class OutputLine(BaseModel):
    """One answer of the output file: the route's reply (`response`, whatever its status), or why the line never
    reached a route (`error`)."""

    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None

    @classmethod
    def answered(cls, custom_id: str, status: int, body: dict[str, Any]) -> OutputLine:
        return cls(id=f"batch_req_{uuid.uuid4().hex}", custom_id=custom_id, error=None,
                   response=LineResponse(status_code=status, request_id=f"req_{uuid.uuid4().hex}", body=body))

    @classmethod
    def refused(cls, custom_id: str | None, code: str, message: str) -> OutputLine:
        return cls(id=f"batch_req_{uuid.uuid4().hex}", custom_id=custom_id, response=None,
                   error=LineError(code=code, message=message))


def read_line(number: int, text: str) -> InputLine | OutputLine:
    """Input line `number` (from 1) as a request, or the error line that answers it."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        return OutputLine.refused(None, "invalid_json", f"line {number} is not JSON: {e}")
    custom_id = raw.get("custom_id") if isinstance(raw, dict) and isinstance(raw.get("custom_id"), str) else None
    try:
        return InputLine.model_validate(raw)
    except ValidationError as e:
        field, message, _ = describe(e, raw)
        if field == "url":
            message = f"url {raw.get('url')!r} is not served in a batch (served: {', '.join(URLS)})"
        return OutputLine.refused(custom_id, "invalid_request", f"line {number}: {message}")


def input_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, text) of each non-blank line of the input file."""
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                yield number, text


def check_input(path: Path) -> int:
    """The number of lines of the input file `path`; raises BatchFileError for a file that cannot be read or a
    custom_id on two lines."""
    seen: dict[str, int] = {}
    count = 0
    try:
        for number, text in input_lines(path):
            count += 1
            try:
                raw = json.loads(text)
            except ValueError:
                continue
            custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
            if isinstance(custom_id, str):
                if custom_id in seen:
                    raise BatchFileError(f"{path}: custom_id {custom_id!r} is on lines {seen[custom_id]} and {number}; "
                                         "each line's custom_id must be unique")
                seen[custom_id] = number
    except (OSError, UnicodeDecodeError) as e:
        raise BatchFileError(f"cannot read the input file {path}: {e}") from None
    return count


def answered(path: Path) -> tuple[set[str], int]:
    """(the custom_ids the output file `path` answers, how many of its lines answer a line that had none), once a
    last line cut short is cut off. Raises BatchFileError for a line that is not an output line."""
    ids: set[str] = set()
    anonymous = whole = 0
    if not path.exists():
        return ids, anonymous
    with path.open("r+b") as f:
        for number, text in enumerate(f, 1):
            if not text.endswith(b"\n"):  # cut short
                f.truncate(whole)
                break
            whole += len(text)
            try:
                line = OutputLine.model_validate_json(text)
            except ValidationError as e:
                raise BatchFileError(f"{path} line {number} is not a batch output line ({e.errors()[0]['msg']}); "
                                     "give another output file") from None
            if line.custom_id is None:
                anonymous += 1
            else:
                ids.add(line.custom_id)
    return ids, anonymous


class Output:
    """The output file, opened for appending: each line one write of its bytes, so that a killed run leaves whole
    lines (and at most one cut short, which `answered` drops)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lines = 0

    def write(self, line: OutputLine) -> None:
        data = (json.dumps(line.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        while data:  # a regular file takes it in one write; a short one is finished
            data = data[os.write(self.fd, data):]
        self.lines += 1

    def close(self) -> None:
        os.close(self.fd)
