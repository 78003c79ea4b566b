"""Sampling and verification: logits processing and draws (``sampling``), batch-independent random numbers
(``rng``), the lossless acceptance rule as pure tensor functions (``verify``), and the verifier that applies
it to a step's target logits.

May import structured/, layers/ and types/; never worker/, speculative/, core/ or the face."""
