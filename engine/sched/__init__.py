"""Scheduling, with no torch: who runs each step and with how many tokens (``scheduler``), the paged KV
cache's blocks and prefix cache (``block_manager``), stop conditions (``stop``).

May import types/ only."""
