"""prose: natural-language text, the docstrings of held-out files concatenated.

The corpus is Python source, so its prose is its docstrings: paragraphs of them (doctest examples and
paragraphs over 400 characters left out) joined by blank lines until a prompt has >= 96 tokens, from
files spread through the split. Text the draft model was not distilled on and where exact repeats are
rare.
"""

from __future__ import annotations

import ast
import functools

from .heldout import held_out_files

TOKENS = 96


@functools.cache
def _paragraphs() -> tuple[tuple[str, ...], ...]:
    """Per held-out file (in order), its docstrings' paragraphs, each unwrapped onto one line."""
    out = []
    for f in held_out_files():
        try:
            tree = ast.parse(f.read())
        except SyntaxError:
            continue
        paras = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node) or ""
                for para in doc.split("\n\n"):
                    line = " ".join(para.split())
                    if 40 <= len(line) <= 400 and ">>>" not in para:  # a long one alone would overflow
                        paras.append(line)
        if paras:
            out.append(tuple(paras))
    return tuple(out)


def prose_prompts(tokenizer: object, n: int) -> list[str]:
    files = _paragraphs()
    flat = [p for paras in files for p in paras]
    starts = [sum(len(x) for x in files[:i]) for i in range(len(files))]  # each file's first paragraph in flat
    out = []
    for k in range(n):
        i = starts[(k * max(1, len(files) // n)) % len(files)] + k // len(files)  # a file used again starts later
        taken: list[str] = []
        while len(tokenizer.encode("\n\n".join(taken))) < TOKENS:
            taken.append(flat[i % len(flat)])
            i += 1
        out.append("\n\n".join(taken))
    return out
