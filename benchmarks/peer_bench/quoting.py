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


def prompt_tokens(context: int) -> int:
    return min(1536, context * 5 // 8)


def quoting_prompts(tokenizer: object, n: int) -> list[str]:
    out = []
    for k, text in enumerate(snippets(tokenizer, n, prompt_tokens(context_of(tokenizer)))):
        defs = [(m.group(1), line) for line in text.split("\n") if (m := DEF.match(line))]
        if defs:
            name, line = defs[k % len(defs)]
            out.append(f"{text}\n\n# the function {name} again:\n{line}")
        else:  # no function in the cut: ask for its first line's statement instead
            out.append(f"{text}\n\n# the code above again:\n{text.split(chr(10), 1)[0]}")
    return out
