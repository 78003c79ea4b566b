"""A suffix trie of bounded depth with counts: every substring of up to ``depth`` tokens of the streams
inserted, each node counting the occurrences of its path. Streams grow token by token and can be
removed again (their counts taken back out, nodes at zero freed).

Nodes are integer ids into flat arrays (count, token, most frequent child), not Python objects: about
a third of the memory, and nothing for Python's cyclic garbage collector to walk (a trie of millions of
node objects made every full collection take seconds). A node with one child holds it in ``best``
alone (most nodes of a deep trie have one); a node with two or more also has a dict of them in
``kids``. ``best`` is always a most frequent child, so a draft follows ``best`` without looking at the
others.
"""

from __future__ import annotations

from array import array

ROOT = 0
NONE = -1


class Stream:
    """One token stream in an index: what of it is inserted, and the nodes of its current suffixes."""

    __slots__ = ("active", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []  # inserted so far (removal walks them again)
        self.active: list[int] = []  # nodes of the inserted tokens' suffixes of lengths 1 .. depth - 1

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixIndex:
    def __init__(self, depth: int = 24) -> None:
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.count = array("q", [0])  # by node id; the root is 0
        self.token = array("q", [NONE])
        self.best = array("q", [NONE])  # a most frequent child (the only one where a node has no kids entry)
        self.kids: dict[int, dict[int, int]] = {ROOT: {}}  # token -> child, of the root and every branching node
        self.free: list[int] = []  # ids of freed nodes, reused first
        self.num_nodes = 0  # root excluded

    # ---- growing and shrinking -------------------------------------------------------------------

    def stream(self) -> Stream:
        return Stream()

    def _new(self, token: int) -> int:
        self.num_nodes += 1
        if self.free:
            c = self.free.pop()
            self.count[c], self.token[c], self.best[c] = 1, token, NONE
            return c
        self.count.append(1)
        self.token.append(token)
        self.best.append(NONE)
        return len(self.count) - 1

    def extend(self, stream: Stream, tokens: list[int]) -> None:
        """Appends ``tokens`` to ``stream``: each new token extends every suffix of length < depth that ends
        before it (Arctic's incremental insertion), so a token costs ``depth`` child lookups."""
        keep, root_kids, count = self.depth - 1, self.kids[ROOT], self.count
        for t in tokens:
            first = root_kids.get(t)
            if first is None:
                first = root_kids[t] = self._new(t)
            else:
                count[first] += 1
            active = [first]
            for node in stream.active:
                active.append(self._increment(node, t))
            stream.active = active[:keep]
            stream.tokens.append(t)

    def _increment(self, node: int, t: int) -> int:
        """``node``'s child ``t``, created or counted once more; ``best[node]`` kept a most frequent child."""
        best, count = self.best, self.count
        b = best[node]
        kids = self.kids.get(node)
        if kids is None:
            if b == NONE:
                best[node] = c = self._new(t)
                return c
            if self.token[b] == t:
                count[b] += 1
                return b
            c = self._new(t)
            self.kids[node] = {self.token[b]: b, t: c}  # best stays: its count is >= 1
            return c
        c = kids.get(t, NONE)
        if c == NONE:
            c = kids[t] = self._new(t)
            return c
        count[c] += 1
        if c != b and count[c] > count[b]:
            best[node] = c
        return c

    def child(self, node: int, t: int) -> int:
        kids = self.kids.get(node)
        if kids is not None:
            return kids.get(t, NONE)
        b = self.best[node]
        return b if b != NONE and self.token[b] == t else NONE

    def remove(self, stream: Stream) -> None:
        """Takes every suffix path of ``stream`` back out. A node whose count reaches 0 is unlinked with
        what hangs below it on this path: counts never grow down a path, so that is a chain of count-1
        nodes of this stream alone, freed."""
        tokens, depth, count = stream.tokens, self.depth, self.count
        n = len(tokens)
        for j in range(n):
            parent, end = ROOT, min(j + depth, n)
            for i in range(j, end):
                c = self.child(parent, tokens[i])
                assert c != NONE, "removing a stream that is not in the index"
                count[c] -= 1
                if count[c] == 0:
                    self._unlink(parent, c)
                    self._free_chain(c, tokens, i + 1, end)
                    break
                if parent != ROOT and self.best[parent] == c and parent in self.kids:
                    self.best[parent] = max(self.kids[parent].values(), key=count.__getitem__)
                parent = c
        stream.tokens, stream.active = [], []

    def _free_chain(self, c: int, tokens: list[int], i: int, end: int) -> None:
        while True:
            self.free.append(c)
            self.num_nodes -= 1
            nxt = self.best[c]
            self.kids.pop(c, None)  # a count-1 node has at most one child: never an entry, kept for safety
            if i >= end or nxt == NONE:
                return
            c, i = nxt, i + 1

    def _unlink(self, parent: int, c: int) -> None:
        kids = self.kids.get(parent)
        if kids is None:
            self.best[parent] = NONE
            return
        del kids[self.token[c]]
        if parent == ROOT:
            return
        if len(kids) == 1:
            self.best[parent] = next(iter(kids.values()))
            del self.kids[parent]
        elif self.best[parent] == c:
            self.best[parent] = max(kids.values(), key=self.count.__getitem__)

    # ---- reading ---------------------------------------------------------------------------------

    def walk(self, tokens: list[int]) -> int:
        """The node of path ``tokens``, or NONE. ``child`` inlined: this loop is most of a draft's time."""
        node, all_kids, best, token = ROOT, self.kids, self.best, self.token
        for t in tokens:
            kids = all_kids.get(node)
            if kids is not None:
                node = kids.get(t, NONE)
            else:
                b = best[node]
                node = b if b != NONE and token[b] == t else NONE
            if node == NONE:
                return NONE
        return node

    def occurrences(self, path: list[int]) -> int:
        """Occurrences of ``path`` counted (0 if never seen)."""
        node = self.walk(path)
        return self.count[node] if node != NONE else 0

    def match(self, context: list[int]) -> tuple[int, int]:
        """The node of the longest suffix of ``context`` (at most depth - 1 tokens) that the index has seen
        followed by something, and its length; (NONE, 0) if not even the last token was. "Seen followed by
        something" holds for a suffix whenever it holds for a longer one (the index holds every substring of
        what it holds), so a binary search over the length finds it in log2(depth) walks."""
        lo, hi, found = 0, min(self.depth - 1, len(context)), NONE
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.walk(context[-mid:])
            if node != NONE and self.best[node] != NONE:
                lo, found = mid, node
            else:
                hi = mid - 1
        return found, lo

    def draft(self, context: list[int], limit: int, min_prob: float, factor: float = 1.0, offset: float = 0.0,
              min_match: int = 1) -> tuple[list[int], float]:
        """The most frequent continuation of the longest match: follow ``best`` while the running
        probability prod(count[child] / count[node]) stays >= ``min_prob``, at most
        min(limit, match_len * factor + offset) tokens. Returns (tokens, score), score the sum of the
        running probabilities along the path (the expected number of drafts accepted, if the counts were
        the truth). A path that reaches the depth goes on from the longest match of what it drafted so far.
        A match shorter than ``min_match`` drafts nothing."""
        node, m = self.match(context)
        if node == NONE or m < min_match:
            return [], 0.0
        cap = min(limit, int(m * factor + offset))
        best, count, token = self.best, self.count, self.token
        out: list[int] = []
        p, score, depth = 1.0, 0.0, m
        while len(out) < cap:
            c = best[node]
            if c == NONE:
                if depth < self.depth:
                    break  # the end of every stream through here: nothing more was seen
                node, depth = self.match((context[-self.depth:] + out)[-(self.depth - 1):])
                if node == NONE:
                    break
                continue
            p *= count[c] / count[node]
            if p < min_prob:
                break
            out.append(token[c])
            score += p
            node, depth = c, depth + 1
        return out, score
