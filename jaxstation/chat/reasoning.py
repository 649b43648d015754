"""A reasoning model's thinking apart from its answer: `<think>...</think>` split out of the generated text as it
streams, for every API (chat completions' `reasoning_content`, a Responses `reasoning` item, a Messages `thinking`
block).

Parsers (the `reasoning_parser` setting):
- "qwen3": the thinking is what an opening `<think>` at the start of the output (after whitespace) begins, or
  everything from the start when the prompt itself ends with `<think>` (templates that open the thinking for the
  model); it ends at `</think>`. Without an opening tag the whole output is the answer (thinking turned off).
- "deepseek_r1": the output starts in the thinking whatever the prompt says (R1 distills' templates open it, older
  ones leave it to the model); an opening tag the model writes anyway is dropped.
- "none": no split. "auto": qwen3 when the chat template writes `</think>`, else none.
Without a closing tag, everything after the opening is thinking. A tag split across tokens is held back until the next
piece decides it. Whitespace between `</think>` and the answer is dropped.

A JSON constraint (response_format, a JSON structured output, a required or named tool call) holds only the answer:
`after_thinking` makes it a grammar whose thinking is free text up to `</think>`, the JSON schema after it.
"""

from __future__ import annotations

import json

from jaxstation.chat.stops import holdback
from jaxstation.engine.constraints import JSON_WHITESPACE, ConstraintSpec

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def pick_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser a station uses for `setting`, given its chat template (None: no split)."""
    if setting == "auto":
        return "qwen3" if chat_template and CLOSE in chat_template else None
    return setting if setting in PARSERS else None


def after_thinking(spec: ConstraintSpec, parser: str, prompt_opens: bool) -> ConstraintSpec:
    """`spec` held to the answer only: the thinking before it (opened by the model, or already by the prompt) is free
    text ended by the closing tag. Constraints other than a JSON schema stay as they are, over the whole output."""
    if spec.kind != "json" or not isinstance(spec.value, dict):
        return spec
    schema = {**spec.value, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    thinking = 'thought /[ \\n]*/'
    start = (f'start: "{OPEN}"? {thinking} body' if parser == "deepseek_r1" or prompt_opens
             else f'start: ("{OPEN}" {thinking})? body')
    grammar = f'{start}\nthought[stop="{CLOSE}"]: /(?s:.*)/\nbody: %json {json.dumps(schema)}\n'
    return ConstraintSpec("grammar", grammar, spec.field)


class ReasoningStream:
    """One choice's text split into (thinking, answer) pieces as it arrives."""

    def __init__(self, parser: str, prompt_opens: bool) -> None:
        """prompt_opens: the rendered prompt ends with the opening tag."""
        self.state = "thinking" if parser == "deepseek_r1" or prompt_opens else "start"
        self.drop_open = parser == "deepseek_r1"  # an opening tag at the start of the thinking is dropped
        self.buf = ""
        self.thinking: list[str] = []  # everything split out so far

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """Take more text; return (thinking, answer) that may be shown now. `final`: the output ended."""
        self.buf += text
        thinking, answer = "", ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "thinking"
                    continue
                if not final and OPEN.startswith(head):  # nothing yet, or an opening tag in the making
                    break
                self.state = "answer"
            elif self.state == "thinking":
                if self.drop_open:
                    head = self.buf.lstrip()
                    if not final and OPEN.startswith(head):
                        break
                    self.drop_open = False
                    if head.startswith(OPEN):
                        self.buf = head[len(OPEN):]
                at = self.buf.find(CLOSE)
                if at >= 0:
                    thinking += self.buf[:at]
                    self.buf, self.state = self.buf[at + len(CLOSE):], "after"
                    continue
                keep = 0 if final else holdback(self.buf, (CLOSE,))
                thinking += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.state = "answer"
            else:
                answer, self.buf = answer + self.buf, ""
                break
        if thinking:
            self.thinking.append(thinking)
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back."""
        return self.push("", final=True)

    @property
    def in_thinking(self) -> bool:
        return self.state == "thinking"

    @property
    def text(self) -> str:
        return "".join(self.thinking)
