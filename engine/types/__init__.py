"""Plain data, no torch: configuration, sampling parameters and their errors, constraints, the sequence and
its drafting state, the schedule, outputs and step stats, incremental detokenization.

Imports nothing from the rest of engine/; everything else may import it."""
