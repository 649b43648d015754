"""An OpenAI batch file run on an in-process station (`jaxstation batch`): each input line's body is read as its
route reads it (`openai.routes.parse_request`) and answered with what the route answers (`whole_reply`, or the
route's error reply), written to the output as it ends, in OpenAI's batch output format (batch_file.py). A line the
routes refuse gets the route's error reply (a 400 naming the field); a line that reaches no route (not JSON, no
custom_id, another url or method) gets an error line; `stream: true` is refused, a batch answering whole replies.
SIGINT or SIGTERM stops it: the runs in flight are cancelled and left out, and a run over the same output later
answers them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from jaxstation.chat.request import unsupported
from jaxstation.chat.stream import reply_body
from jaxstation.offline.batch_file import Output, OutputLine, answered, input_lines, read_line
from jaxstation.offline.runs import Item, Outcome, Progress, run_all
from jaxstation.openai.routes import parse_request, reply_head, whole_reply
from jaxstation.server.outcomes import API_INVALID, OUTCOMES, failure
from jaxstation.server.station import Station


@dataclasses.dataclass
class Summary:
    """What a batch run wrote: lines, of which errors (a status other than 200, or an error line), the tokens of the
    requests it ran and the seconds it took; `signal` the one that stopped it, if one did."""

    lines: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    signal: int | None = None


def run_batch(station: Station, source: Path, output: Path, total: int, use_tqdm: bool = True) -> Summary:
    """Answer the lines of `source` (`total` of them) not yet in `output`, appending to it; stops at SIGINT or
    SIGTERM."""
    done, anonymous = answered(output)
    out = Output(output)
    summary = Summary()
    progress = Progress(total - len(done) - anonymous, use_tqdm, "batch")

    def write(line: OutputLine) -> None:
        out.write(line)
        summary.lines += 1
        summary.errors += line.error is not None or line.response.status_code != 200

    def finished(outcome: Outcome) -> None:
        if isinstance(outcome.error, _Refusal):
            return write(outcome.error.line)
        line, head = outcome.key
        if outcome.error is not None:
            f = failure(outcome.error, API_INVALID)
            return write(OutputLine.answered(line.custom_id, f.status, _json(f.response(line.url).body)))
        return write(OutputLine.answered(line.custom_id, 200, reply_body(whole_reply(outcome.run, head))))

    async def main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: (setattr(summary, "signal", s), stop.set()))
        return await run_all(station, _requests(station, source, done, anonymous), finished, progress, stop)

    try:
        asyncio.run(main())
    finally:
        progress.close()
        out.close()
        summary.seconds = time.perf_counter() - progress.start
        summary.prompt_tokens, summary.generated_tokens = progress.prompt_tokens, progress.generated_tokens
    return summary


class _Refusal(Exception):
    """An input line answered without running: its output line."""

    def __init__(self, line: OutputLine) -> None:
        super().__init__(line.error.message if line.error else "refused")
        self.line = line


def _requests(station: Station, source: Path, done: set[str], anonymous: int) -> Iterator[Item]:
    """The input lines not answered yet, each read as its route reads its body, keyed by (the line, its reply's
    head), or refused with its output line."""
    for number, text in input_lines(source):
        line = read_line(number, text)
        if isinstance(line, OutputLine) and line.custom_id is None and anonymous:
            anonymous -= 1
            continue
        if line.custom_id is not None and line.custom_id in done:
            continue
        if isinstance(line, OutputLine):
            yield None, _Refusal(line)
            continue
        chat = line.url == "/v1/chat/completions"
        try:
            if line.body.get("stream"):
                raise unsupported("stream", "stream=true is not served in a batch: each line is answered whole")
            req = parse_request(station, line.body, chat)
        except OUTCOMES as e:
            f = failure(e, API_INVALID)
            yield None, _Refusal(OutputLine.answered(line.custom_id, f.status, _json(f.response(line.url).body)))
            continue
        yield (line, reply_head(station, chat)), req


def _json(body: bytes | memoryview) -> dict:
    return json.loads(bytes(body))
