"""What a request's output must match: a JSON schema, a regex, one of several strings, or a Lark
grammar. Pure data and text; the grammar engine (llguidance) compiles it in engine.structured.grammar."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from engine.types.errors import SamplingParamError

# JSON is written the way Python's json.dumps writes it, one fixed separator and no free whitespace:
# the model cannot drift into endless blank space (a known failure of small models under a grammar that
# allows any), and every key, separator and closing bracket is then forced by the grammar, so it is
# drafted for free (engine.speculative.drafting).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(enum.Enum):
    JSON = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. ``param`` is the request field it came from, which every error
    about it names (a 400 upstream). ``strict`` (JSON only): a schema keyword the grammar engine does not
    implement is an error; with strict False it is ignored (OpenAI's non-strict schemas are best effort)."""

    kind: ConstraintKind
    text: str  # the canonical JSON of the schema, the regex, the Lark grammar, or the JSON list of choices
    param: str
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format", strict: bool = True) -> Constraint:
        if not isinstance(schema, dict) and not isinstance(schema, bool):
            raise SamplingParamError(param, f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(ConstraintKind.JSON, json.dumps(schema), param, strict)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Constraint:
        """OpenAI's ``{"type": "json_object"}``: any JSON object."""
        return cls.json_schema({"type": "object"}, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "guided_regex") -> Constraint:
        if not pattern:
            raise SamplingParamError(param, "the regex is empty")
        return cls(ConstraintKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...], param: str = "guided_choice") -> Constraint:
        if not options:
            raise SamplingParamError(param, "needs at least one choice")
        if not all(isinstance(o, str) and o for o in options):
            raise SamplingParamError(param, "every choice must be a non-empty string")
        return cls(ConstraintKind.CHOICE, json.dumps(list(options)), param)

    @classmethod
    def grammar(cls, lark: str, param: str = "guided_grammar") -> Constraint:
        if not lark.strip():
            raise SamplingParamError(param, "the grammar is empty")
        return cls(ConstraintKind.GRAMMAR, lark, param)

    def grammar_text(self) -> str:
        """The grammar in the form llguidance's matcher takes (validated there, against the tokenizer)."""
        from llguidance import LLMatcher  # the engine runs without it until a request asks for structure

        if self.kind is ConstraintKind.JSON:
            options = {**JSON_FORMAT, "lenient": not self.strict}
            try:
                return LLMatcher.grammar_from_json_schema(self.text, overrides=options)
            except ValueError as exc:
                raise SamplingParamError(self.param, f"invalid JSON schema: {exc}") from None
        if self.kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind is ConstraintKind.CHOICE:
            # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(self.text)))
        return LLMatcher.grammar_from_lark(self.text)
