"""Structured output: the grammar backend (llguidance) that masks logits, forces tokens and rolls back, and
token healing.

May import types/ only."""
