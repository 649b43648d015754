"""How a request ends, for every API the station speaks: one function that waits on a job, one that checks the
station can take work, and one that maps each way a request can fail to its HTTP status, message, field and code.

The engine and the scheduler raise their own exceptions (`engine.jobs`, `engine.constraints`) and know nothing of
HTTP; the routes raise `StationError` (the station's own routes) or `ApiError` (the OpenAI, Responses and Messages
faces) for what their parsers refuse. `failure` turns any of them into a `Failure`, and `errors.error_response` renders
that in the shape of the route's API. The one status that differs between the APIs is that of a well-formed request the
station cannot serve as asked (a constraint that does not compile, or one that leaves no token): `/generate` answers
422, as for its other refusals, and the API faces 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

from starlette.responses import JSONResponse

from jaxstation.engine.constraints import ConstraintError, ConstraintFailed
from jaxstation.engine.jobs import Cancelled, QueueFull, ShuttingDown, StepFailed, UpstreamFailed
from jaxstation.engine.scheduler import Scheduler
from jaxstation.server.errors import ApiError, StationError, error_response
from jaxstation.server.http_common import RETRY_AFTER_S, BodyError
from jaxstation.server.protocol import request_field
from jaxstation.server.station import Station

STATION_INVALID = 422  # /generate's status for a request it cannot serve as asked
API_INVALID = 400  # the API faces' (OpenAI, Responses, Messages)


class NotReady(Exception):
    """The station is still loading, or failed to start."""


class Disconnected(Exception):
    """The client went away before the reply was complete."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """An error reply before its API's shape: `field` is the request field at fault, `code` OpenAI's code."""

    status: int
    message: str
    field: str | None = None
    code: str | None = None
    retry: bool = False  # a 503 the client should retry: Retry-After

    def response(self, path: str) -> JSONResponse:
        """The reply in the shape of the API at `path`."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.retry else None
        return error_response(path, self.status, self.message, self.field, self.code, headers=headers)


def failure(error: Exception, invalid: int) -> Failure:
    """What `error` answers with; `invalid` is the API's status for a request it cannot serve as asked."""
    match error:
        case StationError():
            return Failure(error.status, error.message, error.field)
        case ApiError():
            return Failure(error.status, error.message, error.param, error.code)
        case BodyError():
            return Failure(error.status, error.message, "body", "too_large" if error.status == 413 else "invalid_value")
        case ConstraintError():
            return Failure(invalid, error.message, request_field(error.field), "invalid_value")
        case ConstraintFailed():
            return Failure(invalid, str(error), request_field(error.field), "constraint_failed")
        case QueueFull() | NotReady():
            return Failure(503, str(error), None, "overloaded", retry=True)
        case ShuttingDown():
            return Failure(503, str(error), None, "shutting_down")
        case StepFailed():
            return Failure(502 if isinstance(error.cause, UpstreamFailed) else 500, str(error), None, "internal_error")
        case Cancelled():
            return Failure(500, str(error), None, "internal_error")
    raise TypeError(f"no outcome for {type(error).__name__}: {error}") from error


OUTCOMES = (StationError, ApiError, BodyError, ConstraintError, ConstraintFailed, QueueFull, NotReady, ShuttingDown,
            StepFailed, Cancelled)  # every exception `failure` maps


def check_ready(station: Station) -> Scheduler:
    """The station's scheduler, or ShuttingDown (draining) or NotReady (loading, or failed to start)."""
    if station.draining:
        raise ShuttingDown("the station is shutting down")
    if station.scheduler is None or not station.ready.is_set():
        raise NotReady(f"the station failed to start: {station.load_error}" if station.load_error else "not ready yet")
    return station.scheduler


async def wait_for(waited: asyncio.Future, scheduler: Scheduler, futures: Callable[[], list[Future]],
                   gone: asyncio.Future | None = None) -> None:
    """Return once `waited` is done. Raises Disconnected if `gone` (the client's disconnect) comes first, and
    StepFailed if the decode thread dies leaving any of `futures()` (the request's jobs) unanswered."""
    waits = {waited} if gone is None else {waited, gone}
    while True:
        done, _ = await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        if waited in done:
            return
        if gone is not None and gone in done:
            raise Disconnected
        if not scheduler.alive and not all(f.done() for f in futures()):  # the thread answers every Future it ends
            raise StepFailed("the decode thread has died")
