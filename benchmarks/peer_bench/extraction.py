"""extraction: one JSON schema over many inputs, as a structured-extraction job sends it.

Each prompt is a held-out function (its source, dedented) and a comment asking for it as JSON; every
request carries the same response_format (json_schema: the function's name, arguments and docstring).
The grammar forces keys and punctuation, and the values copy the prompt.
"""

from __future__ import annotations

import ast
import functools
import textwrap

from .heldout import context_of, held_out_files
from .workload import Request

ASK = "\n\n# The function above as JSON: its name, arguments and docstring.\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
        "docstring": {"type": "string", "maxLength": 160},
    },
    "required": ["name", "arguments", "docstring"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}


@functools.cache
def _functions(max_chars: int) -> tuple[str, ...]:
    """Held-out functions and methods with a docstring, at most max_chars of source, in file order."""
    out = []
    for f in held_out_files():
        text = f.read()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.split("\n")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
                source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
                if 120 <= len(source) <= max_chars:
                    out.append(source)
    return tuple(out)


def extraction_prompts(tokenizer: object, n: int) -> list[Request]:
    # About 3 characters a token in this code: the source leaves room for the answer in the context.
    functions = _functions(max(600, 3 * (context_of(tokenizer) - 200)))
    picked = [functions[(k * len(functions)) // n % len(functions)] if n <= len(functions)
              else functions[k % len(functions)] for k in range(n)]
    return [Request(source + ASK, {"response_format": RESPONSE_FORMAT}) for source in picked]
