"""specd's OpenAI-compatible HTTP server over the engine (``specd serve``)."""
