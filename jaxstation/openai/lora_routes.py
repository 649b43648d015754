"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, served only with
`--allow-runtime-lora` (without it the paths do not exist: 404). They answer in OpenAI's error shape, as every
/v1/ route. Reading an adapter file runs off the event loop."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxstation.model.lora_files import AdapterError
from jaxstation.openai.parse import validate
from jaxstation.openai.protocol import OpenAIErrorResponse
from jaxstation.server.adapters import AdapterConflict
from jaxstation.server.errors import ApiError
from jaxstation.server.http_common import read_json
from jaxstation.server.openapi import Endpoint
from jaxstation.server.outcomes import OUTCOMES, check_ready, failure
from jaxstation.server.protocol import LoadLoraAdapterRequest, LoraAdapterResponse, UnloadLoraAdapterRequest
from jaxstation.server.station import Station

M = TypeVar("M", bound=BaseModel)


def lora_endpoints(station: Station) -> list[Endpoint]:
    """The load and unload routes of `station` (whose plan holds LoRA slots)."""

    async def body_as(request: Request, model: type[M]) -> M:
        check_ready(station)
        if station.adapters is None:
            raise ApiError(400, "this station holds no LoRA slots (--max-loras 0)", "lora_name")
        return validate(model, await read_json(request, station.config.max_body_bytes))

    async def load(request: Request) -> Response:
        try:
            req = await body_as(request, LoadLoraAdapterRequest)
            await asyncio.to_thread(station.adapters.load, req.lora_name, req.lora_path)
        except AdapterError as e:
            return ApiError(400, str(e), "lora_path").response()
        except AdapterConflict as e:
            return ApiError(409, str(e), "lora_name").response()
        except OUTCOMES as e:
            return failure(e, 400).response(request.url.path)
        return JSONResponse(LoraAdapterResponse(lora_name=req.lora_name, status="loaded").model_dump())

    async def unload(request: Request) -> Response:
        try:
            req = await body_as(request, UnloadLoraAdapterRequest)
            if station.adapters.unload(req.lora_name) is None:
                raise ApiError(404, f"lora_name {req.lora_name!r} is not a loaded adapter", "lora_name")
        except OUTCOMES as e:
            return failure(e, 400).response(request.url.path)
        return JSONResponse(LoraAdapterResponse(lora_name=req.lora_name, status="unloaded").model_dump())

    return [
        Endpoint("/v1/load_lora_adapter", "POST", load, "vLLM's: load a LoRA adapter under a name",
                 LoraAdapterResponse, OpenAIErrorResponse, request=LoadLoraAdapterRequest,
                 statuses=(400, 409, 413, 503)),
        Endpoint("/v1/unload_lora_adapter", "POST", unload, "vLLM's: unload a LoRA adapter", LoraAdapterResponse,
                 OpenAIErrorResponse, request=UnloadLoraAdapterRequest, statuses=(400, 404, 413, 503)),
    ]
