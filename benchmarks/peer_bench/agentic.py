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
# Tokens an output may gain when resent as text: its tokens decoded and encoded again beside the next
# text (the embedded pair's tokenizer: at most 2 over 200 outputs of held-out snippets)
RESEND_SLACK = 4


def snippet_tokens(context: int) -> int:
    """Snippet length that leaves the last turn room: every turn adds up to MAX_NEW tokens of output and
    a short comment, and whole lines overshoot the target length."""
    return max(32, min(160, (context - TURNS * MAX_NEW) // 3))


def agentic_prompts(tokenizer: object, n: int) -> list[Conversation]:
    context = context_of(tokenizer)
    out: list[Conversation] = []
    # A snippet whose first line alone leaves the last turn no room is dropped, and the shortfall drawn from a
    # larger spread of the split (the first n draws stay as they were).
    for pool in (n, 2 * n, 4 * n):
        for snippet in snippets(tokenizer, pool, snippet_tokens(context)):
            conv = fitted(tokenizer, snippet, context)
            if conv is not None and all(conv.first != c.first for c in out):
                out.append(conv)
            if len(out) == n:
                return out
    return out


def last_turn_tokens(tokenizer: object, conv: Conversation) -> int:
    """The most tokens the last turn's prompt and output can take: every output MAX_NEW tokens, plus the
    RESEND_SLACK that resending it as text may add."""
    follow_up = len(tokenizer.encode(conv.follow_up))
    return len(tokenizer.encode(conv.first)) + (conv.turns - 1) * (MAX_NEW + RESEND_SLACK + follow_up) + MAX_NEW


def fitted(tokenizer: object, snippet: str, context: int) -> Conversation | None:
    """The conversation over ``snippet``, cut by whole lines until its last turn fits the context (a prompt
    plus max_tokens past it is a 400, which ends the conversation); None where one line is too long."""
    while True:
        follow_up = AGAIN + snippet.split("\n", 1)[0]
        conv = Conversation(first=snippet + follow_up, turns=TURNS, follow_up=follow_up)
        if last_turn_tokens(tokenizer, conv) <= context:
            return conv
        if "\n" not in snippet:
            return None
        snippet = snippet.rsplit("\n", 1)[0].rstrip()
