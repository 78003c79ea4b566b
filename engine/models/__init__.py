"""Model surgery and heads that are not the target's own: the early exit (the target's first layers as a
model of their own), the trained exit head, the EAGLE-3 head.

May import layers/ and types/ only."""
