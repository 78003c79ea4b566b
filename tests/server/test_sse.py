"""Server-sent event framing."""

from __future__ import annotations

import json

from pydantic import BaseModel

from server.sse import event


class Chunk(BaseModel):
    text: str


def test_unicode_line_separators_are_escaped_so_line_splitting_clients_keep_one_event_per_line():
    text = "a\u2028b\u2029c\u0085d\ne"
    framed = event(Chunk(text=text))
    assert framed.endswith("\n\n") and framed.startswith("data: ")
    line = framed[len("data: "):-2]
    assert line.splitlines() == [line], "str.splitlines (httpx aiter_lines) must see one line"
    assert json.loads(line) == {"text": text}
