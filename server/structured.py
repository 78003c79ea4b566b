"""A request's output constraint, from OpenAI's ``response_format`` or the ``guided_*`` extensions
(vLLM's names). The engine compiles and enforces it; a schema, regex or grammar it cannot compile is a
400 from ``LLMEngine.prepare`` naming the field recorded here as ``Constraint.param``."""

from __future__ import annotations

from engine import Constraint
from server.errors import bad_request
from server.protocol import ResponseFormat, SamplingFields

# What type json_object asks for, and a json_schema without a schema: any JSON object.
ANY_OBJECT = {"type": "object"}


def from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint.json_object("response_format")
    spec = fmt.json_schema
    if spec is None:
        raise bad_request("response_format type json_schema needs a json_schema object", "response_format.json_schema")
    schema = ANY_OBJECT if spec.schema_ is None else spec.schema_
    # OpenAI's strict defaults to False: keywords the grammar engine does not implement are then ignored.
    return Constraint.json_schema(schema, "response_format.json_schema.schema", strict=bool(spec.strict))


def requested(req: SamplingFields) -> list[tuple[str, Constraint]]:
    """Every field of the request that asks for a constraint, in the order the fields are documented."""
    found = []
    if (c := from_response_format(req.response_format)) is not None:
        found.append(("response_format", c))
    if req.guided_regex is not None:
        found.append(("guided_regex", Constraint.regex(req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", Constraint.choice(req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", Constraint.grammar(req.guided_grammar)))
    return found


def only_one(found: list[tuple[str, Constraint]]) -> Constraint | None:
    """The request's constraint; two are a 400 naming the second (an output cannot match both in general)."""
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise bad_request(f"{second} cannot be combined with {first}: a request takes one output constraint", second)
    return found[0][1] if found else None
