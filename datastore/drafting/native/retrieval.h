// Retrieval (REST): the longest suffix of the context that the datastore holds, a sample of
// what followed its occurrences, and the trie of those continuations as a tree.
// Python: redraft.datastore.drafting.retrieval
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "scratch.h"
#include "sources.h"
#include "suffix_array.h"
#include "tree.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

// The reference's weights: the integer mass of a tree's samples and the support under which
// a shorter match's continuations are mixed in.
// Python: redraft.datastore.drafting.retrieval._MASS
constexpr int64_t MASS = int64_t(1) << 40;
constexpr int64_t MIN_SUPPORT = 4;

// What a session's previous retrieval found: the longest match then (0: none) and its ranges,
// and the context's length then. Since, the context has only grown.
struct RestHint {
    bool valid = false;
    int64_t L = 0;
    size_t context_len = 0;
    std::vector<Range> ranges;
};

// Python: redraft.datastore.reader.Reader._longest
// Exponential, then binary search over the suffix length. The answer is the longest occurring
// suffix whatever the probes, so a session's previous answer narrows it: a match of m tokens now
// ends with the `added` new ones and starts with a match of m - added tokens then, so m <=
// max(previous, min_len - 1) + added; and the longest such candidate (the previous match and the
// new tokens) can only occur within the previous match's ranges, where it is looked up first.
int64_t longest(const Store& st, const std::vector<int32_t>& sel, const uint32_t* arr, int64_t n,
                const uint8_t* key, int64_t min_len, std::vector<Range>& ranges, Scratch& s,
                const RestHint& hint, size_t context_len) {
    const int w = st.width;
    int64_t lo = min_len - 1, hi = n, step = 1;
    auto& best = s.best;
    auto& hits = s.hits;
    best.clear();
    if (hint.valid) {
        int64_t added = static_cast<int64_t>(context_len - hint.context_len);
        hi = std::min(n, std::max(hint.L, min_len - 1) + added);
        int64_t m = hint.L + added;
        if (hint.L > 0 && added > 0 && m <= n && m > lo) {
            const uint8_t* k = key + (n - m) * w;
            size_t nb = static_cast<size_t>(m) * w;
            ranges.clear();
            for (const auto& r : hint.ranges) {
                const Shard& sh = st.shards[r.shard];
                int64_t i;
                if (st.lower_in(sh, k, nb, r.lo, r.hi, i))
                    ranges.push_back({r.shard, i, st.upper(sh, k, nb, i, r.hi)});
            }
            if (!ranges.empty()) return m;
            hi = m - 1;
        }
    }
    while (lo < hi) {
        int64_t mid = step ? std::min(lo + step, hi) : (lo + hi + 1) / 2;
        const uint8_t* k = key + (n - mid) * w;
        size_t nb = static_cast<size_t>(mid) * w;
        uint32_t t0 = arr[n - mid];
        hits.clear();
        for (int32_t s : sel) {
            int64_t i, bhi;
            if (st.lower(st.shards[s], k, nb, t0, i, bhi)) hits.push_back({s, i, bhi});
        }
        if (!hits.empty()) {
            lo = mid;
            best.swap(hits);
            step *= 2;
        } else {
            hi = mid - 1;
            step = 0;
        }
    }
    ranges.clear();
    if (lo < std::max<int64_t>(min_len, 1)) return 0;
    const uint8_t* k = key + (n - lo) * w;
    size_t nb = static_cast<size_t>(lo) * w;
    for (const auto& r : best)
        ranges.push_back({r.shard, r.lo, st.upper(st.shards[r.shard], k, nb, r.lo, r.hi)});
    return lo;
}

// Python: redraft.datastore.reader.Reader._sample
// The SA positions (and shards) of up to k_max occurrences spread evenly over the ranges, in the
// reference's column order. Returns their number.
int64_t sample(const Store& st, const std::vector<Range>& ranges, int64_t k_max,
               std::vector<int64_t>& positions, std::vector<int32_t>& shard_of) {
    int64_t total = 0;
    for (const auto& r : ranges) total += r.hi - r.lo;
    positions.clear();
    shard_of.clear();
    if (total == 0) return 0;
    int64_t k = std::min(total, k_max);
    size_t nseg = 0;
    for (const auto& r : ranges)
        if (r.hi > r.lo) ++nseg;
    positions.resize(k);  // each of the k samples falls in one range
    shard_of.resize(k);
    int64_t off = 0, j = 0;
    for (const auto& r : ranges) {
        if (r.hi <= r.lo) continue;
        int64_t cnt = r.hi - r.lo;
        const Shard& sh = st.shards[r.shard];
        int64_t from = j;
        for (int64_t i = 0; i < k; ++i) {
            int64_t g = (i * total) / k;
            if (nseg > 1 && (g < off || g >= off + cnt)) continue;
            int64_t local = nseg > 1 ? g - off : g;
            positions[j++] = r.lo + local;
            __builtin_prefetch(sh.sa + r.lo + local);
        }
        // The suffix-array entries were all asked for (above) before any is read here: the
        // misses overlap.
        for (int64_t q = from; q < j; ++q) {
            positions[q] = static_cast<int64_t>(load_le32(sh.sa + positions[q]));
            shard_of[q] = r.shard;
        }
        if (nseg > 1) off += cnt;
    }
    return k;
}

struct RestParams {
    int64_t budget, max_depth, max_match, min_match, max_occurrences;
};

// Big-endian bytes of token ids, the datastore's order (what the searches compare).
void encode_key(const uint32_t* tail, int64_t n, int w, std::vector<uint8_t>& key) {
    key.resize(static_cast<size_t>(n) * w);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t t = tail[i];
        if (w == 2) {
            key[2 * i] = static_cast<uint8_t>(t >> 8);
            key[2 * i + 1] = static_cast<uint8_t>(t);
        } else {
            key[4 * i] = static_cast<uint8_t>(t >> 24);
            key[4 * i + 1] = static_cast<uint8_t>(t >> 16);
            key[4 * i + 2] = static_cast<uint8_t>(t >> 8);
            key[4 * i + 3] = static_cast<uint8_t>(t);
        }
    }
}

// The REST tree of a context's tail is built in six steps, each a function below (a tree that
// differs from the reference's differs in the first step whose output differs):
//   1. match_levels: the longest suffix that occurs, and a shorter one to mix in when it has
//      too few occurrences (the reference's retrieval_tree);
//   2. read_continuations: the D tokens after a sample of their occurrences, one column each
//      (SuffixQuery.continuations), refusing damaged token arrays;
//   3. weigh_columns: the columns' order and weights (the reference's _tree);
//   4. trie_extents, 5. shared_nodes, 6. emit_best: the trie of the columns and its best
//      `budget` nodes, best first (the reference's _trie_tree).

// Step 1's answer: the longest match (L = 0: none; its ranges in Scratch::r1) and, where it
// has fewer than MIN_SUPPORT occurrences, the shorter match mixed in (`two`; its ranges in
// Scratch::r2).
struct RestLevels {
    int64_t L = 0;
    int64_t support = 0;  // the longest match's occurrences
    int64_t L2 = 0;
    bool two = false;
};

// Python: redraft.datastore.drafting.retrieval.retrieval_tree
// Step 1. The longest suffix of the context's tail (n tokens) that occurs, narrowed by the
// session's hint, which it updates; then, under MIN_SUPPORT, the longest shorter suffix with
// that support (or the shortest allowed one).
RestLevels match_levels(const Store& st, const std::vector<int32_t>& sel, const uint32_t* tail,
                        int64_t n, const RestParams& p, Scratch& s, RestHint& hint,
                        size_t context_len) {
    const int w = st.width;
    auto& key = s.key;
    encode_key(tail, n, w, key);
    auto& r1 = s.r1;
    RestLevels lv;
    lv.L = longest(st, sel, tail, n, key.data(), p.min_match, r1, s, hint, context_len);
    hint.valid = true;
    hint.L = lv.L;
    hint.context_len = context_len;
    hint.ranges.assign(r1.begin(), r1.end());
    if (lv.L == 0) return lv;
    for (const auto& r : r1) lv.support += r.hi - r.lo;
    if (lv.support < MIN_SUPPORT && lv.L > p.min_match) {
        for (lv.L2 = lv.L - 1; lv.L2 >= p.min_match; --lv.L2) {
            ranges_of(st, sel, key.data() + (n - lv.L2) * w, static_cast<size_t>(lv.L2) * w,
                      tail[n - lv.L2], s.r2);
            int64_t sup2 = 0;
            for (const auto& r : s.r2) sup2 += r.hi - r.lo;
            if (sup2 >= MIN_SUPPORT || lv.L2 == p.min_match) {
                lv.two = true;
                break;
            }
        }
    }
    return lv;
}

// Step 2's answer: k columns of D rows in Scratch::W, the first k1 sampled from the longest
// match, the rest from the shorter one; Scratch::seps: the separators in each.
struct RestColumns {
    int64_t k1 = 0, k = 0;
};

// The shard and first token position of column c.
inline const Shard& column_shard(const Store& st, const Scratch& s, const RestColumns& cs,
                                 int64_t c) {
    return st.shards[c < cs.k1 ? s.sh1[c] : s.sh2[c - cs.k1]];
}
inline int64_t column_start(const Scratch& s, const RestLevels& lv, const RestColumns& cs,
                            int64_t c) {
    return c < cs.k1 ? lv.L + s.pos1[c] : lv.L2 + s.pos2[c - cs.k1];
}

// Python: redraft.datastore.reader.SuffixQuery.continuations
// Python: redraft.datastore.reader._check_ids
// Step 2. Up to max_occurrences occurrences of each level, spread evenly over its ranges, and
// the D tokens after each (column c: the tokens at min(L + d + pos, length - 1) of its shard).
// False where a column holds an id past the separator: damaged token arrays of a Reader
// opened without verifying, which must never reach a draft (the reference raises
// DatastoreCorrupt for the same columns).
bool read_continuations(const Store& st, const RestLevels& lv, const RestParams& p, Scratch& s,
                        RestColumns& cs) {
    const int w = st.width;
    const int64_t D = p.max_depth;
    s.pos2.clear();
    s.sh2.clear();
    cs.k1 = sample(st, s.r1, p.max_occurrences, s.pos1, s.sh1);
    cs.k = cs.k1 + (lv.two ? sample(st, s.r2, p.max_occurrences, s.pos2, s.sh2) : 0);
    const int64_t k = cs.k;
    // Every column's cache lines (its first and last token's) are asked for before any is
    // read: the reads overlap.
    for (int64_t c = 0; c < k; ++c) {
        const Shard& sh = column_shard(st, s, cs, c);
        int64_t at = column_start(s, lv, cs, c);
        __builtin_prefetch(sh.tokens + std::min(at, sh.length - 1) * w);
        __builtin_prefetch(sh.tokens + std::min(at + D - 1, sh.length - 1) * w);
    }
    // While a column is read, its separators are counted (most columns hold none, and are
    // then all valid rows: see trie_extents).
    const uint32_t sep = st.sep;
    auto& W = s.W;
    W.resize(static_cast<size_t>(D * k));
    auto& seps = s.seps;
    seps.resize(k);
    for (int64_t c = 0; c < k; ++c) {
        const Shard& sh = column_shard(st, s, cs, c);
        int64_t at = column_start(s, lv, cs, c);
        uint32_t* col = W.data() + c * D;
        int64_t last = sh.length - 1;
        uint32_t n_sep = 0, top = 0;
        if (at + D - 1 <= last && w == 2) {
            const uint8_t* b = sh.tokens + at * w;
            for (int64_t d = 0; d < D; ++d) {
                col[d] = (uint32_t(b[2 * d]) << 8) | b[2 * d + 1];
                n_sep += col[d] == sep;
                top = std::max(top, col[d]);
            }
        } else {
            for (int64_t d = 0; d < D; ++d) {
                col[d] = st.token(sh, std::min(at + d, last));
                n_sep += col[d] == sep;
                top = std::max(top, col[d]);
            }
        }
        seps[c] = n_sep;
        if (top > sep) return false;  // damaged: no id past the vocabulary is ever drafted
    }
    return true;
}

// Python: redraft.datastore.drafting.retrieval._tree
// Step 3. The columns' order (Scratch::cols) and weights (Scratch::wt, in that order); returns
// the root's mass. One SA range sampled in order is already sorted (unit weights); otherwise
// columns are sorted as np.lexsort(W[::-1]) sorts them, each level's weighing its share of
// MASS (the longer one support / (support + 1)).
int64_t weigh_columns(const RestLevels& lv, const RestColumns& c, int64_t D, Scratch& s) {
    const int64_t k = c.k, k1 = c.k1, k2 = c.k - c.k1;
    auto& cols = s.cols;
    cols.resize(k);
    std::iota(cols.begin(), cols.end(), 0);
    auto& wt = s.wt;
    if (!lv.two && s.r1.size() == 1) {
        wt.assign(k, 1);
        return k;
    }
    double lam = lv.two ? static_cast<double>(lv.support) /
                              (static_cast<double>(lv.support) + 1.0)
                        : 1.0;
    auto weight = [](double share, int64_t ncols) {
        int64_t m = static_cast<int64_t>(static_cast<double>(MASS) * share) / ncols;
        return std::max<int64_t>(1, m);
    };
    int64_t a = weight(lam, k1), b = k2 ? weight(1.0 - lam, k2) : 0;
    const uint32_t* Wp = s.W.data();
    std::sort(cols.begin(), cols.end(), [&](int32_t x, int32_t y) {
        const uint32_t *cx = Wp + x * D, *cy = Wp + y * D;
        for (int64_t d = 0; d < D; ++d)
            if (cx[d] != cy[d]) return cx[d] < cy[d];
        return x < y;  // equal columns in their order, as lexsort (stable) keeps them
    });
    wt.resize(k);
    int64_t root = 0;
    for (int64_t i = 0; i < k; ++i) {
        wt[i] = cols[i] < k1 ? a : b;
        root += wt[i];
    }
    return root;
}

// Python: redraft.datastore.drafting.retrieval._trie_tree
// Step 4. The reference's trie, without building every node. In sorted order, column c opens a
// node at each depth d with lcp[c] <= d < vlen[c] (lcp: rows equal to the previous column's;
// vlen: rows before the first separator). A node's mass is the weight of the columns through
// it. The nodes column c opens below pd[c] = max(lcp[c], lcp[c + 1]) are shared with a
// neighbour (built by shared_nodes: there are few); those from pd[c] on are c's alone, a chain
// of mass wt[c] (enumerated by emit_best only as far as the budget reaches). Fills
// Scratch::lcp, vlen, pd; returns the number of nodes (the reference's trie size).
int64_t trie_extents(int64_t k, int64_t D, uint32_t sep, Scratch& s) {
    auto& lcp = s.lcp;
    auto& vlen = s.vlen;
    auto& pd = s.pd;
    const auto& cols = s.cols;
    lcp.assign(k + 1, 0);
    vlen.resize(k);
    pd.resize(k);
    for (int64_t c = 0; c < k; ++c) {
        const uint32_t* col = s.W.data() + static_cast<int64_t>(cols[c]) * D;
        int32_t v = static_cast<int32_t>(D);
        if (s.seps[cols[c]])
            for (v = 0; col[v] != sep;) ++v;
        vlen[c] = v;
        if (c > 0) {
            const uint32_t* prev = s.W.data() + static_cast<int64_t>(cols[c - 1]) * D;
            int32_t l = 0;
            while (l < v && col[l] == prev[l]) ++l;
            lcp[c] = l;
        }
    }
    int64_t nn = 0;
    for (int64_t c = 0; c < k; ++c) {
        pd[c] = std::min(vlen[c], std::max(lcp[c], lcp[c + 1]));
        nn += vlen[c] - lcp[c];
    }
    return nn;
}

// Python: redraft.datastore.drafting.retrieval._trie_tree
// Step 5. The shared nodes (those a column opens below pd[c]), depth-major: mass
// (Scratch::mass), depth (sdepth), opening column (scol), parent (tparent: a shared node or
// -1), token (ntok); and the shared node above each column's own chain (anchor, -1: the
// root). Returns their number.
int64_t shared_nodes(int64_t k, int64_t D, Scratch& s) {
    const auto& lcp = s.lcp;
    const auto& pd = s.pd;
    int64_t ns = 0;  // pd[c] >= lcp[c], as lcp[c] <= vlen[c]
    for (int64_t c = 0; c < k; ++c) ns += pd[c] - lcp[c];
    auto& smass = s.mass;
    auto& sdepth = s.sdepth;
    auto& scol = s.scol;
    auto& sparent = s.tparent;
    auto& stok = s.ntok;
    smass.assign(ns, 0);
    sdepth.resize(ns);
    scol.resize(ns);
    sparent.resize(ns);
    stok.resize(ns);
    auto& cur = s.cur;  // the shared node the current column passes at each depth
    cur.assign(D, -1);
    auto& anchor = s.anchor;
    anchor.resize(k);
    for (int64_t c = 0, id = 0; c < k; ++c) {
        const uint32_t* col = s.W.data() + static_cast<int64_t>(s.cols[c]) * D;
        for (int32_t d = lcp[c]; d < pd[c]; ++d, ++id) {
            sdepth[id] = d;
            scol[id] = static_cast<int32_t>(c);
            sparent[id] = d == 0 ? -1 : static_cast<int32_t>(cur[d - 1]);
            stok[id] = col[d];
            cur[d] = id;
        }
        int64_t wc = s.wt[c];
        for (int32_t d = 0; d < pd[c]; ++d) smass[cur[d]] += wc;
        anchor[c] = pd[c] > 0 ? static_cast<int32_t>(cur[pd[c] - 1]) : -1;
    }
    return ns;
}

// A node's rank: dep - mass * (D + 1) ascending, then node id (the reference's stable
// argsort), that is mass descending, then depth, then column (ids run depth-major).
inline u128 trie_rank(int64_t mass, int32_t d, int64_t c) {
    return (static_cast<u128>(UINT64_MAX - static_cast<uint64_t>(mass)) << 64) |
           (static_cast<uint64_t>(d) << 32) | static_cast<uint64_t>(c);
}

// The chain nodes of the columns of one weight, walked by depth then column.
struct ChainClass {
    int64_t weight;
    int32_t d, at, dmax;  // the next node: depth d, at-th column of the class
    std::vector<int32_t>& columns;
    u128 key;  // the next node's rank (all ones: none left)
};
constexpr u128 NO_NODE = ~static_cast<u128>(0);

// Moves the class to its next node (depth d, column columns[at]) and ranks it.
inline void advance(ChainClass& ch, const std::vector<int32_t>& pd,
                    const std::vector<int32_t>& vlen) {
    const int32_t* columns = ch.columns.data();
    const int32_t ncols = static_cast<int32_t>(ch.columns.size());
    for (; ch.d < ch.dmax; ++ch.d, ch.at = 0)
        for (; ch.at < ncols; ++ch.at) {
            int32_t col = columns[ch.at];
            if (pd[col] <= ch.d && ch.d < vlen[col]) {
                ch.key = trie_rank(ch.weight, ch.d, col);
                return;
            }
        }
    ch.key = NO_NODE;
}

// Python: redraft.datastore.drafting.retrieval._trie_tree
// Step 6. The best min(budget, nn) nodes into `out`, best first (trie_rank): the shared nodes
// sorted, and each class of chains of one weight walked depth by depth, merged. A node's
// probability is its mass over its parent's (root: `root`).
void emit_best(int64_t k, int64_t D, int64_t ns, int64_t nn, int64_t root, int64_t budget,
               Scratch& s, Tree& out) {
    const auto& pd = s.pd;
    const auto& vlen = s.vlen;
    const auto& wt = s.wt;
    const auto& smass = s.mass;
    const auto& sparent = s.tparent;
    const auto& stok = s.ntok;
    auto& keys = s.keys;
    keys.resize(ns);
    for (int64_t i = 0; i < ns; ++i) keys[i] = trie_rank(smass[i], s.sdepth[i], s.scol[i]);
    auto& sorder = s.sel;
    sorder.resize(ns);
    std::iota(sorder.begin(), sorder.end(), 0);
    std::sort(sorder.begin(), sorder.end(), [&](int32_t a, int32_t b) { return keys[a] < keys[b]; });
    // Columns weigh one of at most two values (one per level sampled): two classes.
    ChainClass classes[2] = {{0, INT32_MAX, 0, 0, s.class_columns[0], NO_NODE},
                             {0, INT32_MAX, 0, 0, s.class_columns[1], NO_NODE}};
    classes[0].columns.clear();
    classes[1].columns.clear();
    int nclass = 0;
    for (int64_t c = 0; c < k; ++c) {
        if (pd[c] >= vlen[c]) continue;
        int j = 0;
        while (j < nclass && classes[j].weight != wt[c]) ++j;
        if (j == nclass) classes[nclass++].weight = wt[c];
        ChainClass& ch = classes[j];
        ch.columns.push_back(static_cast<int32_t>(c));
        ch.d = std::min(ch.d, pd[c]);
        ch.dmax = std::max(ch.dmax, vlen[c]);
    }
    for (int j = 0; j < nclass; ++j) advance(classes[j], pd, vlen);
    const int64_t m = std::min<int64_t>(budget, nn);
    const uint8_t bit = g_sources.rest;
    auto& sout = s.remap;  // output index of each shared node
    sout.assign(ns, -1);
    auto& chain_out = s.chain_out;  // output index of each column's last chain node
    chain_out.assign(k, -1);
    out.resize(m);
    const Tree::Slots o = out.slots();
    int64_t next_shared = 0;
    for (int64_t i = 0; i < m; ++i) {
        int best = -1;  // -1: the next shared node; else a class
        u128 bk = next_shared < ns ? keys[sorder[next_shared]] : NO_NODE;
        for (int j = 0; j < nclass; ++j)
            if (classes[j].key < bk) {
                bk = classes[j].key;
                best = j;
            }
        if (best < 0) {
            int32_t node = sorder[next_shared++];
            int32_t par = sparent[node];
            double pm = static_cast<double>(par < 0 ? root : smass[par]);
            sout[node] = static_cast<int32_t>(i);
            o.set(i, stok[node], par < 0 ? -1 : sout[par],
                  static_cast<double>(smass[node]) / pm, bit);
        } else {
            ChainClass& ch = classes[best];
            int32_t bd = ch.d, bc = ch.columns[ch.at];
            ++ch.at;
            advance(ch, pd, vlen);
            const uint32_t* col = s.W.data() + static_cast<int64_t>(s.cols[bc]) * D;
            int64_t wc = wt[bc];
            int32_t parent;
            double pm;
            if (bd == pd[bc]) {
                int32_t a = s.anchor[bc];
                parent = a < 0 ? -1 : sout[a];
                pm = static_cast<double>(a < 0 ? root : smass[a]);
            } else {  // below its own chain node: wc / wc
                parent = chain_out[bc];
                pm = static_cast<double>(wc);
            }
            chain_out[bc] = static_cast<int32_t>(i);
            o.set(i, col[bd], parent, bd == pd[bc] ? static_cast<double>(wc) / pm : 1.0,
                  bit);
        }
    }
}

// Python: redraft.datastore.drafting.retrieval.retrieval_tree
// The REST tree of the context's tail (n tokens): the six steps above. False (and an empty
// tree) where the token arrays are damaged (read_continuations).
bool rest_propose(const Store& st, const std::vector<int32_t>& sel, const uint32_t* tail,
                  int64_t n, const RestParams& p, Tree& out, Scratch& s, RestHint& hint,
                  size_t context_len) {
    out.clear();
    if (p.budget == 0 || n < p.min_match) {
        hint.valid = false;
        return true;
    }
    const RestLevels lv = match_levels(st, sel, tail, n, p, s, hint, context_len);
    if (lv.L == 0) return true;
    RestColumns cols;
    if (!read_continuations(st, lv, p, s, cols)) {
        out.clear();
        return false;
    }
    if (cols.k == 0) return true;
    const int64_t D = p.max_depth;
    const int64_t root = weigh_columns(lv, cols, D, s);
    const int64_t nn = trie_extents(cols.k, D, st.sep, s);
    out.match_len = lv.L;
    if (nn == 0) return true;
    const int64_t ns = shared_nodes(cols.k, D, s);
    emit_best(cols.k, D, ns, nn, root, p.budget, s, out);
    return true;
}

}  // namespace
