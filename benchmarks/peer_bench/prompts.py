"""The prompt sets, each defined by its shape and cut from the default pair's held-out split (files the
models never saw). A 14M-parameter code model copies rather than follows instructions, so each set is
built from what the model will do with it, not from what a comment asks.

code:         ~96 tokens of a held-out file, cut at a line end; the model continues the file. The
              default pair's home ground: the draft was distilled on exactly this kind of text.
code_newline: the same with a trailing newline: the prompt ends at a bare newline token (this tokenizer
              merges a newline with the next line's indentation), a boundary the model never saw.
edit:         a ~160-token held-out snippet, a comment asking for a revised copy, and the snippet's first
              line; the model writes the snippet again. Input-grounded output, where n-gram lookup over
              the prompt finds long matches.
agentic:      multi-turn; each turn resends the conversation so far (agentic.py).
extraction:   one JSON schema via response_format over many held-out functions (extraction.py).
quoting:      a long prompt whose continuation copies a function from it (quoting.py).
prose:        held-out docstrings concatenated (prose.py).
random:       uniform random tokens: nothing to match (random_tokens.py).
"""

from __future__ import annotations

from .agentic import agentic_prompts
from .extraction import extraction_prompts
from .heldout import snippets
from .prose import prose_prompts
from .quoting import quoting_prompts
from .random_tokens import random_prompts

_snippets = snippets  # the name other benchmarks (prefix_cache.py, token_healing.py) import
EDIT_INSTRUCTION = "\n\n# Revised version of the code above: same behaviour, clearer names.\n"


def code_prompts(tokenizer: object, n: int) -> list[str]:
    return snippets(tokenizer, n, 96)


def code_newline_prompts(tokenizer: object, n: int) -> list[str]:
    return [p + "\n" for p in code_prompts(tokenizer, n)]


def edit_prompts(tokenizer: object, n: int) -> list[str]:
    out = []
    for snippet in snippets(tokenizer, n, 160):
        out.append(snippet + EDIT_INSTRUCTION + snippet.split("\n", 1)[0])
    return out


# Each: (tokenizer, n) -> n items (str, workload.Request or workload.Conversation), the same on every run.
PROMPT_SETS = {
    "code": code_prompts, "code_newline": code_newline_prompts, "edit": edit_prompts, "agentic": agentic_prompts,
    "extraction": extraction_prompts, "quoting": quoting_prompts, "prose": prose_prompts, "random": random_prompts,
}
DEFAULT_SETS = ("code", "edit")  # compare.py's default; the others by --sets
