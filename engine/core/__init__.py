"""The engine itself: the step loop (``LLMEngine``), loading the models it runs, and the audit that re-runs
finished requests without speculation.

May import every other subpackage of engine/ (it is the top of the house below the public face); nothing in
engine/ but the face (``engine/__init__.py``, ``engine/llm.py``) imports it."""
