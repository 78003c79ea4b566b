"""instructor against the live server, unmodified: a pydantic model back from JSON_SCHEMA mode (response_format
json_schema) and from TOOLS mode (a forced tool call), through the openai client it wraps."""

from __future__ import annotations

from typing import Literal

import instructor
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL

pytestmark = pytest.mark.timeout(120)


class Verdict(BaseModel):
    """Bounded fields: a random model's integers could run past max_tokens, an enum and a bool cannot."""

    ok: bool
    kind: Literal["bug", "feature"]


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_returns_a_validated_model_in_each_mode(server, mode):
    client = instructor.from_openai(server.client(), mode=mode)
    verdict = client.chat.completions.create(model=MODEL, response_model=Verdict, max_retries=0, temperature=0,
                                             max_tokens=60, messages=[{"role": "user", "content": "is it a bug?"}])
    assert isinstance(verdict, Verdict)
