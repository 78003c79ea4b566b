"""The two prompt sets, both cut from the default pair's held-out split (files the models never saw).

code:  ~96 tokens of a held-out file, cut at a line end; the model continues the file. The default
       pair's home ground: the draft was distilled on exactly this kind of text.
edit:  a ~160-token held-out snippet, a comment asking for a revised copy, and the snippet's first
       line; the model writes the snippet again. Input-grounded output, where n-gram lookup over the
       prompt finds long matches. (A 14M-parameter code model does not follow instructions; what it
       does here is copy with small changes, which is what an editing request's output looks like.)
"""

from __future__ import annotations

from recipe.corpus import split, stdlib_files

EDIT_INSTRUCTION = "\n\n# Revised version of the code above: same behaviour, clearer names.\n"


def _snippets(tokenizer: object, n: int, tokens: int) -> list[str]:
    """n snippets of >= ``tokens`` tokens of whole lines, from the middle of n held-out files spread
    through the split; each starts at a non-blank line and ends without a trailing newline (this
    tokenizer merges a newline with the next line's indentation, so a prompt ending in a bare newline
    is a token boundary the model never saw)."""
    _, held_out = split(stdlib_files())
    files = sorted((f for f in held_out if f.read().count("\n") > 60), key=lambda f: f.relpath)
    out = []
    for k in range(n):
        # Spread over the files; a file used again starts at another point of its text.
        f = files[(k * max(1, len(files) // n)) % len(files)]
        lines = f.read().split("\n")
        # Start at a top-level or class-level statement from a third of the way in (wrapping round),
        # so the snippet stands on its own; the first start with enough lines after it wins.
        first = int(len(lines) * ((1 / 3 + 0.29 * (k // len(files))) % 1.0))
        for i in [*range(first, len(lines)), *range(first)]:
            if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= 4:
                taken: list[str] = []
                j = i
                while j < len(lines) and len(tokenizer.encode("\n".join(taken))) < tokens:
                    taken.append(lines[j])
                    j += 1
                if len(tokenizer.encode("\n".join(taken))) >= tokens:
                    out.append("\n".join(taken).rstrip())
                    break
    return out


def code_prompts(tokenizer: object, n: int) -> list[str]:
    return _snippets(tokenizer, n, 96)


def edit_prompts(tokenizer: object, n: int) -> list[str]:
    out = []
    for snippet in _snippets(tokenizer, n, 160):
        out.append(snippet + EDIT_INSTRUCTION + snippet.split("\n", 1)[0])
    return out


PROMPT_SETS = {"code": code_prompts, "edit": edit_prompts}
