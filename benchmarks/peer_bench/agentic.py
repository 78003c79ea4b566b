"""agentic: multi-turn conversations in which every turn resends the conversation so far.

Turn 1 is a held-out snippet, a comment asking for the code again, and the snippet's first line; each
later turn is the previous turn's prompt, the model's output to it, and the same comment and first line
again. What an agent loop sends: the context grows by the model's own text, which lookup drafters
(over the prompt, or over earlier outputs) can match.
"""

from __future__ import annotations

from .heldout import context_of, snippets
from .workload import Conversation

AGAIN = "\n\n# The code above again:\n"
TURNS = 3
MAX_NEW = 128  # compare.py's default --max-tokens; the snippets are sized so the last turn fits the context


def snippet_tokens(context: int) -> int:
    """Snippet length that leaves the last turn room: every turn adds up to MAX_NEW tokens of output and
    a short comment, and whole lines overshoot the target length."""
    return max(32, min(160, (context - TURNS * MAX_NEW) // 3))


def agentic_prompts(tokenizer: object, n: int) -> list[Conversation]:
    context = context_of(tokenizer)
    cap = (context - TURNS * MAX_NEW) // 2  # a long last line must not push the last turn past the context
    out = []
    for snippet in snippets(tokenizer, n, snippet_tokens(context)):
        while "\n" in snippet and len(tokenizer.encode(snippet)) > cap:
            snippet = snippet.rsplit("\n", 1)[0].rstrip()
        follow_up = AGAIN + snippet.split("\n", 1)[0]
        out.append(Conversation(first=snippet + follow_up, turns=TURNS, follow_up=follow_up))
    return out
