"""Drafting: the draft sources behind one Protocol (draft model, EAGLE head, the target's early layers,
prompt lookup, grammar-forced tokens), the planner that picks a source and k per sequence per step, and the
goodput controller behind it (each source's acceptance, the step-cost model, the solver).

May import sample/, worker/, models/, sched/, structured/, layers/ and types/; never core/ or the face."""
