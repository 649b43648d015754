"""Tools a client sends that the station cannot run: a hosted tool (OpenAI's `web_search`, Anthropic's server tools
such as `web_search_20250305`) or a group of tools under a `namespace` (Codex's sub-agent tools). They are left out of
the prompt rather than refused, as llama.cpp does, so that an agent works with only its provider settings; the reply
names them in the `X-Jaxstation-Skipped-Tools` header and the log names each once (up to 256 names). A function
tool is validated as before. Pydantic models and helpers shared by the Responses and Messages faces.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

HEADER = "X-Jaxstation-Skipped-Tools"
# the union's tags; a space marks them as no field's name, so that an error names `tools[0].name` (errors.field_path)
FUNCTION_TOOL, HOSTED_TOOL = "function tool", "hosted tool"
_logged: set[str] = set()  # the server's event loop's alone; bounded, since clients choose the names
_LOGGED_MAX = 256


class HostedTool(BaseModel):
    """A tool of any type but the API's own function type, kept only to be named."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


def tool_kind(function_types: Sequence[str | None]) -> Any:
    """A pydantic discriminator: FUNCTION_TOOL for a tool whose type is one of `function_types`, else HOSTED_TOOL."""

    def kind(value: Any) -> str:
        t = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return FUNCTION_TOOL if t in function_types else HOSTED_TOOL

    return kind


def skipped(tools: Sequence[BaseModel] | None) -> list[str]:
    """The names of the hosted tools among `tools` (type:name, or the type), each logged the first time it is seen."""
    names = [f"{t.type}:{t.name}" if t.name else t.type for t in tools or () if isinstance(t, HostedTool)]
    for name in names:
        if name not in _logged and len(_logged) < _LOGGED_MAX:
            _logged.add(name)
            log.info("skipping tool %s: the station runs only function tools", name)
    return names


def headers(names: list[str]) -> dict[str, str]:
    """The reply's header naming the skipped tools, each percent-encoded past printable ASCII."""
    return {HEADER: ", ".join(quote(n, safe=":_.-/ ") for n in names)} if names else {}
