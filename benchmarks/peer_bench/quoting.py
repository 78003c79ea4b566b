"""quoting: a long held-out prompt whose continuation copies a span of it.

Each prompt is a run of whole lines from a held-out file, then "# the function X again:" and X's def
line as it appears above, so the model goes on to copy X's body: long exact matches for any drafter
that looks back over the prompt. The issue-sized prompt is 1-2k tokens; it is capped at 5/8 of the
model's context so the copy fits (320 tokens on the embedded pair's 512).
"""

from __future__ import annotations

import re

from .heldout import context_of, snippets

DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)")


ROOM = 128  # the tokens compare.py asks for (--max-tokens): the copy must fit after the prompt


def prompt_tokens(context: int) -> int:
    return min(1536, context * 5 // 8)


def quoting_prompts(tokenizer: object, n: int) -> list[str]:
    context = context_of(tokenizer)
    out = []
    for k, text in enumerate(snippets(tokenizer, n, prompt_tokens(context))):
        defs = [(m.group(1), line) for line in text.split("\n") if (m := DEF.match(line))]
        if defs:
            name, line = defs[k % len(defs)]
            out.append(fitted(tokenizer, text, line, f"\n\n# the function {name} again:\n{line}", context - ROOM))
        else:  # no function in the cut: ask for its first line's statement instead
            first = text.split("\n", 1)[0]
            out.append(fitted(tokenizer, text, first, f"\n\n# the code above again:\n{first}", context - ROOM))
    return out


def fitted(tokenizer: object, text: str, keep: str, ask: str, budget: int) -> str:
    """``text + ask``, whole lines of ``text`` dropped from its end, or its start where they would reach the
    ``keep`` line, until it is at most ``budget`` tokens. A snippet ends at the line that took it past its size,
    which may be long: one of 2,081 prompts came to 385 tokens, and with 128 to generate it was a 400."""
    lines = text.split("\n")
    at = lines.index(keep)
    while len(tokenizer.encode("\n".join(lines) + ask)) > budget and len(lines) > 1:
        if len(lines) - 1 > at + 1:
            lines.pop()
        elif at > 0:
            lines.pop(0)
            at -= 1
        else:
            break
    return "\n".join(lines).rstrip() + ask
