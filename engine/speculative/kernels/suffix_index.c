/* The suffix trie of engine/speculative/suffix_index.py, in C: the same trie, the same counts, the same most
 * frequent child ("best", ties kept by insertion order), so the same drafts, at a small fraction of the cost
 * (benchmarks/suffix_cost.py). The Python class stays the reference and the fallback where no compiler is
 * found; tests/engine/speculative/test_suffix_native.py checks the two against each other.
 *
 * Layout: nodes are int32 ids into flat arrays; every child is found through one open-addressing hash table
 * keyed by (parent, token), and each node's children also form a list in insertion order (first, next, and
 * prev, which is circular: prev of the first child is the last), so a node's most frequent child can be found
 * again, first in insertion order as Python's max() over a dict finds it. A stream (its tokens, for removal,
 * and the nodes of its current suffixes) lives here too. No call allocates per token; arrays double. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NONE (-1)
#define EMPTY UINT64_MAX
#define ROOT 0

typedef int32_t i32;

typedef struct {
    i32 *tokens;
    int64_t n, cap;
    i32 *active; /* nodes of the inserted tokens' suffixes of lengths 1 .. depth - 1 */
    i32 nactive;
} Stream;

typedef struct {
    i32 depth;
    i32 *count, *token, *best, *first, *next, *prev;
    int64_t size, cap; /* ids handed out so far (the root is 0), and room */
    i32 *freed;
    int64_t nfreed, freedcap;
    int64_t num_nodes;
    uint64_t *keys;
    i32 *vals;
    int64_t hcap, hsize;
    i32 *scratch; /* active suffixes under construction: depth entries */
    int64_t *buf; /* a draft's context and drafts: 2 * depth + room */
    int64_t bufcap;
} Index;

static inline uint64_t key_of(i32 parent, i32 token) { return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token; }

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static i32 hget(const Index *ix, i32 parent, i32 token) {
    uint64_t key = key_of(parent, token), mask = (uint64_t)ix->hcap - 1;
    for (uint64_t i = mix(key) & mask;; i = (i + 1) & mask) {
        if (ix->keys[i] == key) return ix->vals[i];
        if (ix->keys[i] == EMPTY) return NONE;
    }
}

static int hgrow(Index *ix) {
    int64_t old = ix->hcap, cap = old * 2;
    uint64_t *keys = malloc(cap * sizeof *keys);
    i32 *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    memset(keys, 0xff, cap * sizeof *keys);
    uint64_t mask = (uint64_t)cap - 1;
    for (int64_t j = 0; j < old; j++) {
        if (ix->keys[j] == EMPTY) continue;
        uint64_t i = mix(ix->keys[j]) & mask;
        while (keys[i] != EMPTY) i = (i + 1) & mask;
        keys[i] = ix->keys[j];
        vals[i] = ix->vals[j];
    }
    free(ix->keys);
    free(ix->vals);
    ix->hcap = cap;
    ix->keys = keys;
    ix->vals = vals;
    return 0;
}

static int hput(Index *ix, i32 parent, i32 token, i32 child) {
    if ((ix->hsize + 1) * 10 > ix->hcap * 7 && hgrow(ix) != 0) return -1;
    uint64_t key = key_of(parent, token), mask = (uint64_t)ix->hcap - 1;
    uint64_t i = mix(key) & mask;
    while (ix->keys[i] != EMPTY) i = (i + 1) & mask;
    ix->keys[i] = key;
    ix->vals[i] = child;
    ix->hsize++;
    return 0;
}

/* Linear probing's deletion by backward shift: later entries of the run move up, so no tombstones pile up. */
static void hdel(Index *ix, i32 parent, i32 token) {
    uint64_t key = key_of(parent, token), mask = (uint64_t)ix->hcap - 1;
    uint64_t i = mix(key) & mask;
    while (ix->keys[i] != key) {
        if (ix->keys[i] == EMPTY) return;
        i = (i + 1) & mask;
    }
    for (uint64_t j = (i + 1) & mask; ix->keys[j] != EMPTY; j = (j + 1) & mask) {
        uint64_t home = mix(ix->keys[j]) & mask;
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            ix->keys[i] = ix->keys[j];
            ix->vals[i] = ix->vals[j];
            i = j;
        }
    }
    ix->keys[i] = EMPTY;
    ix->hsize--;
}

static int grow_nodes(Index *ix) {
    int64_t cap = ix->cap * 2;
    i32 **arrays[] = {&ix->count, &ix->token, &ix->best, &ix->first, &ix->next, &ix->prev};
    for (int a = 0; a < 6; a++) {
        i32 *p = realloc(*arrays[a], cap * sizeof(i32));
        if (!p) return -1;
        *arrays[a] = p;
    }
    ix->cap = cap;
    return 0;
}

static i32 new_node(Index *ix, i32 token) {
    i32 c;
    if (ix->nfreed) {
        c = ix->freed[--ix->nfreed];
    } else {
        if (ix->size == ix->cap && grow_nodes(ix) != 0) return NONE;
        c = (i32)ix->size++;
    }
    ix->count[c] = 1;
    ix->token[c] = token;
    ix->best[c] = ix->first[c] = ix->next[c] = ix->prev[c] = NONE;
    ix->num_nodes++;
    return c;
}

static int link_child(Index *ix, i32 parent, i32 c) {
    if (hput(ix, parent, ix->token[c], c) != 0) return -1;
    i32 head = ix->first[parent];
    if (head == NONE) {
        ix->first[parent] = c;
        ix->prev[c] = c;
    } else {
        i32 last = ix->prev[head];
        ix->next[last] = c;
        ix->prev[c] = last;
        ix->prev[head] = c;
    }
    ix->next[c] = NONE;
    return 0;
}

static void unlink_sibling(Index *ix, i32 parent, i32 c) {
    i32 head = ix->first[parent], nxt = ix->next[c], prv = ix->prev[c];
    if (head == c) {
        ix->first[parent] = nxt;
        if (nxt != NONE) ix->prev[nxt] = prv; /* prv: the last child */
    } else {
        ix->next[prv] = nxt;
        if (nxt != NONE)
            ix->prev[nxt] = prv;
        else
            ix->prev[head] = prv;
    }
}

/* A most frequent child of `node`, the first such in insertion order. */
static i32 argmax_child(const Index *ix, i32 node) {
    i32 best = ix->first[node];
    for (i32 c = ix->next[best]; c != NONE; c = ix->next[c])
        if (ix->count[c] > ix->count[best]) best = c;
    return best;
}

/* `node`'s child `t`, created or counted once more; best[node] kept a most frequent child. */
static i32 increment(Index *ix, i32 node, i32 t) {
    i32 c = hget(ix, node, t);
    if (c == NONE) {
        c = new_node(ix, t);
        if (c == NONE || link_child(ix, node, c) != 0) return NONE;
        if (ix->best[node] == NONE) ix->best[node] = c;
        return c;
    }
    ix->count[c]++;
    i32 b = ix->best[node];
    if (c != b && ix->count[c] > ix->count[b]) ix->best[node] = c;
    return c;
}

static int ensure_buf(Index *ix, int64_t n) {
    if (n <= ix->bufcap) return 0;
    int64_t *p = realloc(ix->buf, n * sizeof *p);
    if (!p) return -1;
    ix->buf = p;
    ix->bufcap = n;
    return 0;
}

void si_delete(Index *ix);

Index *si_new(int32_t depth) {
    Index *ix = calloc(1, sizeof *ix);
    if (!ix) return NULL;
    ix->depth = depth;
    ix->cap = 1024;
    ix->hcap = 2048;
    i32 **arrays[] = {&ix->count, &ix->token, &ix->best, &ix->first, &ix->next, &ix->prev};
    for (int a = 0; a < 6; a++) *arrays[a] = malloc(ix->cap * sizeof(i32));
    ix->keys = malloc(ix->hcap * sizeof *ix->keys);
    ix->vals = malloc(ix->hcap * sizeof *ix->vals);
    ix->scratch = malloc((size_t)depth * sizeof *ix->scratch);
    if (!ix->count || !ix->token || !ix->best || !ix->first || !ix->next || !ix->prev || !ix->keys || !ix->vals ||
        !ix->scratch || ensure_buf(ix, 4 * (int64_t)depth) != 0) {
        si_delete(ix);
        return NULL;
    }
    memset(ix->keys, 0xff, ix->hcap * sizeof *ix->keys);
    ix->size = 1;
    ix->count[ROOT] = 0;
    ix->token[ROOT] = ix->best[ROOT] = ix->first[ROOT] = ix->next[ROOT] = ix->prev[ROOT] = NONE;
    return ix;
}

void si_delete(Index *ix) {
    if (!ix) return;
    free(ix->count), free(ix->token), free(ix->best), free(ix->first), free(ix->next), free(ix->prev);
    free(ix->freed), free(ix->keys), free(ix->vals), free(ix->scratch), free(ix->buf);
    free(ix);
}

Stream *si_stream_new(void) { return calloc(1, sizeof(Stream)); }

void si_stream_delete(Stream *s) {
    if (!s) return;
    free(s->tokens);
    free(s->active);
    free(s);
}

int64_t si_stream_len(const Stream *s) { return s->n; }

void si_stream_tokens(const Stream *s, int64_t *out) {
    for (int64_t i = 0; i < s->n; i++) out[i] = s->tokens[i];
}

int64_t si_num_nodes(const Index *ix) { return ix->num_nodes; }

/* Bytes held: the node arrays, the hash table and the free list (streams are their owners'). */
int64_t si_bytes(const Index *ix) {
    return ix->cap * 6 * (int64_t)sizeof(i32) + ix->hcap * (int64_t)(sizeof(uint64_t) + sizeof(i32)) +
           ix->freedcap * (int64_t)sizeof(i32);
}

/* Appends `tokens` to `s`: each new token extends every suffix of length < depth that ends before it, so a
 * token costs depth child lookups. 0, or -1 out of memory (the index then holds a prefix of the tokens). */
int si_extend(Index *ix, Stream *s, const int64_t *tokens, int64_t n) {
    i32 keep = ix->depth - 1;
    if (!s->active && !(s->active = malloc((size_t)ix->depth * sizeof(i32)))) return -1;
    if (s->n + n > s->cap) {
        int64_t cap = s->cap ? s->cap : 64;
        while (cap < s->n + n) cap *= 2;
        i32 *p = realloc(s->tokens, cap * sizeof *p);
        if (!p) return -1;
        s->tokens = p;
        s->cap = cap;
    }
    for (int64_t j = 0; j < n; j++) {
        i32 t = (i32)tokens[j];
        i32 first = hget(ix, ROOT, t);
        if (first == NONE) {
            first = new_node(ix, t);
            if (first == NONE || link_child(ix, ROOT, first) != 0) return -1;
        } else {
            ix->count[first]++;
        }
        i32 *next = ix->scratch, m = 0;
        next[m++] = first;
        for (i32 a = 0; a < s->nactive; a++) {
            i32 c = increment(ix, s->active[a], t);
            if (c == NONE) return -1;
            next[m++] = c;
        }
        s->nactive = m < keep ? m : keep;
        memcpy(s->active, next, (size_t)s->nactive * sizeof(i32));
        s->tokens[s->n++] = t;
    }
    return 0;
}

static void unlink_node(Index *ix, i32 parent, i32 c) {
    hdel(ix, parent, ix->token[c]);
    unlink_sibling(ix, parent, c);
    if (parent == ROOT) return;
    i32 head = ix->first[parent];
    if (head == NONE)
        ix->best[parent] = NONE;
    else if (ix->next[head] == NONE)
        ix->best[parent] = head;
    else if (ix->best[parent] == c)
        ix->best[parent] = argmax_child(ix, parent);
}

static int push_freed(Index *ix, i32 c) {
    if (ix->nfreed == ix->freedcap) {
        int64_t cap = ix->freedcap ? ix->freedcap * 2 : 1024;
        i32 *p = realloc(ix->freed, cap * sizeof *p);
        if (!p) return -1;
        ix->freed = p;
        ix->freedcap = cap;
    }
    ix->freed[ix->nfreed++] = c;
    ix->num_nodes--;
    return 0;
}

/* A node at count 0 and the chain of this stream's count-1 nodes below it along tokens[i:end]. */
static void free_chain(Index *ix, i32 c, int64_t i, int64_t end) {
    for (;;) {
        i32 nxt = ix->best[c];
        if (nxt != NONE) hdel(ix, c, ix->token[nxt]);
        ix->first[c] = ix->best[c] = NONE;
        if (push_freed(ix, c) != 0) return; /* out of memory: the id is lost, the index stays sound */
        if (i >= end || nxt == NONE) return;
        c = nxt;
        i++;
    }
}

/* Takes every suffix path of `s` back out and empties it. */
void si_remove(Index *ix, Stream *s) {
    const i32 *tokens = s->tokens;
    int64_t n = s->n;
    for (int64_t j = 0; j < n; j++) {
        i32 parent = ROOT;
        int64_t end = j + ix->depth < n ? j + ix->depth : n;
        for (int64_t i = j; i < end; i++) {
            i32 c = hget(ix, parent, tokens[i]);
            if (c == NONE) return; /* not this index's stream: Python's version asserts */
            if (--ix->count[c] == 0) {
                unlink_node(ix, parent, c);
                free_chain(ix, c, i + 1, end);
                break;
            }
            if (parent != ROOT && ix->best[parent] == c && ix->next[ix->first[parent]] != NONE)
                ix->best[parent] = argmax_child(ix, parent);
            parent = c;
        }
    }
    s->n = 0;
    s->nactive = 0;
}

static i32 walk(const Index *ix, const int64_t *path, int64_t n) {
    i32 node = ROOT;
    for (int64_t i = 0; i < n && node != NONE; i++) node = hget(ix, node, (i32)path[i]);
    return node;
}

/* The count of the path's node, 0 where the index has not seen it. */
int64_t si_count(const Index *ix, const int64_t *path, int64_t n) {
    i32 node = walk(ix, path, n);
    return node == NONE ? 0 : ix->count[node];
}

/* The longest suffix of context[0:n] (at most depth - 1 tokens) seen followed by something: its length, its
 * node in *node_out (NONE and 0 if not even the last token was). A binary search over the length, as the
 * property holds for a suffix whenever it holds for a longer one. */
int64_t si_match(const Index *ix, const int64_t *context, int64_t n, int32_t *node_out) {
    int64_t lo = 0, hi = ix->depth - 1 < n ? ix->depth - 1 : n;
    i32 found = NONE;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        i32 node = walk(ix, context + n - mid, mid);
        if (node != NONE && ix->best[node] != NONE) {
            lo = mid;
            found = node;
        } else {
            hi = mid - 1;
        }
    }
    *node_out = found;
    return lo;
}

/* The most frequent continuation of the longest match, as SuffixIndex.draft: follows best while the running
 * probability stays >= min_prob, at most min(limit, match * factor + offset) tokens, into out; a path reaching
 * the depth goes on from the longest match of the context and what it drafted. Returns the tokens drafted
 * (-1 out of memory); *score the sum of the running probabilities. `context`: its last depth tokens at most. */
int64_t si_draft(Index *ix, const int64_t *context, int64_t n, int64_t limit, double min_prob, double factor,
                 double offset, int64_t min_match, int64_t *out, double *score) {
    *score = 0.0;
    i32 node;
    int64_t m = si_match(ix, context, n, &node);
    if (node == NONE || m < min_match) return 0;
    int64_t cap = (int64_t)((double)m * factor + offset);
    if (limit < cap) cap = limit;
    int64_t tail = n < ix->depth ? n : ix->depth;
    if (ensure_buf(ix, tail + (cap > 0 ? cap : 0)) != 0) return -1;
    int64_t *buf = ix->buf; /* the context's tail, then the drafts: where a path past the depth matches again */
    memcpy(buf, context + n - tail, (size_t)tail * sizeof *buf);
    int64_t k = 0, depth = m;
    double p = 1.0, total = 0.0;
    while (k < cap) {
        i32 c = ix->best[node];
        if (c == NONE) {
            if (depth < ix->depth) break;
            int64_t len = tail + k < ix->depth - 1 ? tail + k : ix->depth - 1;
            depth = si_match(ix, buf + tail + k - len, len, &node);
            if (node == NONE) break;
            continue;
        }
        p *= (double)ix->count[c] / (double)ix->count[node];
        if (p < min_prob) break;
        out[k] = ix->token[c];
        buf[tail + k] = ix->token[c];
        k++;
        total += p;
        node = c;
        depth++;
    }
    *score = total;
    return k;
}
