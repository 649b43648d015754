"""The bases every face declares its API with: a request `Body` (strict types, unknown fields refused by name, a
null sent for a field the API does not have treated as absent, as OpenAI's clients send nulls freely) and a `Reply`
(the documented shape, nothing more)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Body(BaseModel):
    """A request body: strict types; unknown fields refused, unless sent as null."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_null_extras(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")
