"""Chat templates rendered as transformers renders them: Jinja2 in a sandbox, with its `tojson`, `raise_exception`,
`strftime_now` and `{% generation %}` markers. `read_template` takes a user's own (`--chat-template`), from a file
or inline, and refuses one that does not render, naming the file and the line."""

from __future__ import annotations

import json
import traceback
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` markers, rendering their body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# what a template must render at start-up: a user's turn and the assistant's opening
_PROBE = [{"role": "user", "content": "Hello"}]


def read_template(value: str) -> tuple[str, str]:
    """(the template, where it came from) for `value`, a Jinja file's path or the template itself. Raises ValueError,
    naming the file (or "inline") and the line, when it does not parse or does not render a user's turn."""
    path = Path(value)
    if "{{" not in value and "{%" not in value:
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a file nor a Jinja template")
        where, source = str(path), path.read_text(encoding="utf-8")
    else:
        where, source = "inline template", value
    try:
        compile_template(source).render(messages=_PROBE, add_generation_prompt=True, bos_token="", eos_token="")
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}, line {e.lineno}: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - any error a template raises while rendering
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
        at = f", line {lines[-1]}" if lines else ""
        raise ValueError(f"{where}{at}: {type(e).__name__}: {e}") from None
    return source, where
