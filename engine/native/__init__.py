"""C libraries of our own, built with the machine's compiler on first use and cached (``build.library``): the
CPU attention kernel (engine.layers) and the suffix trie (engine.speculative). Each caller keeps a Python or
torch path for a machine without a compiler.

May import nothing of the engine."""
