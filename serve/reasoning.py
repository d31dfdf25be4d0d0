"""`kiln serve --reasoning-parser`: a reasoning model's thinking, written between <think> and
</think>, goes to the message's `reasoning_content` (vLLM's field), the rest to `content`.

  deepseek_r1  the template opens the thinking, so the output starts inside it (a <think> the
               model writes anyway is dropped): reasoning up to </think>, content after it; an
               output with no </think> (cut short) is all reasoning.
  qwen3        the output thinks only when it opens with <think> (`enable_thinking: false` in
               `chat_template_kwargs` leaves it out); then as deepseek_r1, else all content.

Both splits only grow as text is added, so a stream sends each part's new text as its own delta,
holding back a tail that may be the start of a marker until the next piece tells.
"""
from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; reasoning None when the output did not think."""
    thinks = parser == "deepseek_r1" or text.startswith(OPEN)
    if not thinks:
        return None, text
    body = text[len(OPEN):] if text.startswith(OPEN) else text
    reasoning, closed, content = body.partition(CLOSE)
    return reasoning, content if closed else ""


def _marker_start(text: str) -> int:
    """Where a tail of `text` that could still grow into <think> or </think> begins (len: none)."""
    for start in range(max(0, len(text) - len(CLOSE) + 1), len(text)):
        tail = text[start:]
        if CLOSE.startswith(tail) or OPEN.startswith(tail):
            return start
    return len(text)


class ReasoningStream:
    """One streamed choice: its text so far, and how much of each part has been sent."""

    def __init__(self, parser: str):
        self.parser, self.text = parser, ""
        self.sent_reasoning, self.sent_content = 0, 0

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        """The new (reasoning, content) text after `piece`; `final`: nothing more will come."""
        self.text += piece
        visible = self.text if final else self.text[:_marker_start(self.text)]
        reasoning, content = split(self.parser, visible)
        reasoning = reasoning or ""
        if not final and self.parser == "qwen3" and OPEN.startswith(visible) and len(visible) < len(OPEN):
            return "", ""                 # not yet known whether the output opens with <think>
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new
