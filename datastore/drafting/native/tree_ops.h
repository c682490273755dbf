// What is done to whole trees: the best-first cut, the merge of several drafts into one, a
// tree's expected accepted tokens and its best chain.
// Python: redraft.proto.tree
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "scratch.h"
#include "tree.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace {

// The `budget` best nodes (path probability descending, then depth, then index: Python's stable
// sorts), best first; a node whose parent was not kept is dropped.
// Python: redraft.proto.tree.take_top
void take_top(const uint32_t* tokens, const int32_t* parents, const double* probs,
              const uint8_t* bits, const double* path, const int32_t* depth, int32_t n,
              int64_t budget, int64_t match_len, Tree& out, Scratch& s) {
    out.clear(match_len);
    int64_t b = std::max<int64_t>(budget, 0);
    auto& keys = s.keys;
    keys.resize(n);
    for (int32_t i = 0; i < n; ++i) keys[i] = rank_key(path[i], depth[i], i);
    int32_t m = static_cast<int32_t>(std::min<int64_t>(b, n));
    smallest_first(keys, m);
    auto& new_id = s.new_id;
    new_id.assign(n, -2);
    out.resize(m);
    const Tree::Slots o = out.slots();
    int32_t kept = 0;
    for (int32_t k = 0; k < m; ++k) {
        int32_t i = static_cast<int32_t>(static_cast<uint32_t>(keys[k]));
        int32_t p = parents[i];
        int32_t np = p < 0 ? -1 : new_id[p];
        if (np == -2) continue;
        new_id[i] = kept;
        o.set(kept++, tokens[i], np, probs[i], bits[i]);
    }
    out.resize(kept);
}

// Python: redraft.proto.tree.merge
// Shared prefixes merged (higher prob kept, source bits OR-ed), then the `budget` best nodes by
// path probability. A node's children are kept as a list (the first child, then each child's next
// sibling): they find a draft's node in the merged tree and, when no probability exceeds 1 (every
// child then ranks below its parent), give the best nodes in take_top's order from a heap of the
// frontier, without sorting the rest.
void merge_trees(const Tree* const* drafts, int nd, int64_t budget, Tree& out, Scratch& s) {
    const Tree* full[3];
    int nf = 0;
    for (int i = 0; i < nd; ++i)
        if (drafts[i]->size()) full[nf++] = drafts[i];
    if (nf == 1 && static_cast<int64_t>(full[0]->size()) <= budget) {
        out = *full[0];
        return;
    }
    out.clear();
    if (nf == 0 || budget <= 0) return;
    // Sized for every node of every draft (no growth checks while merging), n used.
    size_t cap = 0;
    for (int f = 0; f < nf; ++f) cap += full[f]->size();
    s.m_tokens.resize(cap);
    s.m_parents.resize(cap);
    s.m_probs.resize(cap);
    s.m_bits.resize(cap);
    s.kids.resize(cap);
    s.first.assign(cap + 1, -1);
    s.path.resize(cap + 1);
    s.depth.resize(cap + 1);
    s.new_id.resize(cap);
    // Raw pointers from here on (see Tree::Slots).
    uint32_t* tokens = s.m_tokens.data();
    int32_t* parents = s.m_parents.data();
    double* probs = s.m_probs.data();
    uint8_t* bits = s.m_bits.data();
    int32_t* first = s.first.data();  // first child of node p at first[p + 1] (-1: none)
    int32_t* next = s.kids.data();    // next sibling of each node (-1: none)
    int32_t n = 0;
    bool monotone = true;  // no probability above 1 (nor NaN)
    for (int f = 0; f < nf; ++f) {
        const Tree& d = *full[f];
        const size_t dn = d.size();
        const uint32_t* d_tokens = d.tokens.data();
        const int32_t* d_parents = d.parents.data();
        const double* d_probs = d.probs.data();
        const uint8_t* d_bits = d.bits.data();
        s.remap.resize(dn);
        int32_t* remap = s.remap.data();
        for (size_t j = 0; j < dn; ++j) {
            int32_t mp = d_parents[j] < 0 ? -1 : remap[d_parents[j]];
            uint32_t tok = d_tokens[j];
            int32_t node = -1;
            if (f > 0)  // the first draft's nodes are all distinct
                for (int32_t c = first[mp + 1]; c >= 0; c = next[c])
                    if (tokens[c] == tok) {
                        node = c;
                        break;
                    }
            double q = d_probs[j];
            monotone = monotone && q <= 1.0;
            if (node < 0) {
                node = n++;
                tokens[node] = tok;
                parents[node] = mp;
                probs[node] = q;
                bits[node] = d_bits[j];
                next[node] = first[mp + 1];
                first[mp + 1] = node;
            } else {
                if (q > probs[node]) probs[node] = q;
                bits[node] |= d_bits[j];
            }
            remap[j] = node;
        }
    }
    double* path = s.path.data();
    int32_t* depth = s.depth.data();
    path[n] = 1.0;  // the root's
    depth[n] = -1;
    for (int32_t i = 0; i < n; ++i) {
        int32_t p = parents[i] < 0 ? n : parents[i];
        path[i] = path[p] * probs[i];
        depth[i] = depth[p] + 1;
    }
    if (!monotone) {
        take_top(tokens, parents, probs, bits, path, depth, n, budget, 0, out, s);
        return;
    }
    // The next node in take_top's order is the least of the frontier (the children of the
    // nodes taken so far). The best child of the node just taken is held aside rather than
    // pushed: it is often the next node (a chain, the common shape), taken without a heap
    // operation.
    const int64_t m = std::min<int64_t>(budget, n);
    auto& heap = s.frontier;
    u128 held = 0;
    bool holding = false;
    int32_t* new_id = s.new_id.data();
    out.resize(m);
    const Tree::Slots o = out.slots();
    bool hole = false;  // the heap's least was just taken: its slot awaits a child
    auto add_children = [&](int32_t p) {
        for (int32_t c = first[p + 1]; c >= 0; c = next[c]) {
            u128 key = rank_key(path[c], depth[c], c);
            if (!holding) {
                held = key;
                holding = true;
                continue;
            }
            if (key < held) std::swap(key, held);
            if (hole) {
                heap.replace_least(key);
                hole = false;
            } else {
                heap.push(key);
            }
        }
        if (hole) heap.pop_least();
        hole = false;
    };
    heap.clear();
    add_children(-1);
    for (int32_t kept = 0; kept < m; ++kept) {
        u128 key;
        if (holding && (heap.empty() || held < heap.least())) {
            key = held;
            holding = false;
        } else {
            key = heap.least();
            hole = true;
        }
        int32_t i = static_cast<int32_t>(static_cast<uint32_t>(key));
        int32_t p = parents[i];
        new_id[i] = kept;
        o.set(kept, tokens[i], p < 0 ? -1 : new_id[p], probs[i], bits[i]);
        add_children(i);
    }
}

// The sum of the nodes' path probabilities, in node order.
// Python: redraft.proto.tree.Tree.expected_accepted
double expected_accepted(const Tree& t, Scratch& s) {
    size_t n = t.size();
    auto& path = s.path;
    path.resize(n);
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) {
        int32_t p = t.parents[i];
        path[i] = (p < 0 ? 1.0 : path[p]) * t.probs[i];
        sum += path[i];
    }
    return sum;
}

// Python: redraft.proto.tree.best_chain
// The root-to-leaf path of at most max_len nodes with the largest sum of path probabilities, in
// place of the tree (parents i - 1; the same operations in the same order as the reference, so that
// ties and sums come out alike).
void best_chain(Tree& t, int64_t max_len, Scratch& s) {
    int32_t n = static_cast<int32_t>(t.size());
    if (n == 0) return;
    auto& path = s.path;
    auto& depth = s.depth;
    auto& best_child = s.new_id;
    auto& gain = s.ct_sibling;
    path.resize(n);
    depth.resize(n);
    gain.assign(n, 0.0);
    best_child.assign(n, -1);
    for (int32_t i = 0; i < n; ++i) {
        int32_t p = t.parents[i];
        path[i] = (p < 0 ? 1.0 : path[p]) * t.probs[i];
        depth[i] = p < 0 ? 1 : depth[p] + 1;
    }
    int32_t root_best = -1;
    double root_gain = 0.0;
    for (int32_t i = n - 1; i >= 0; --i) {
        if (depth[i] > max_len) continue;
        gain[i] += path[i];
        int32_t p = t.parents[i];
        if (p < 0) {
            if (root_best < 0 || gain[i] > root_gain) {
                root_best = i;
                root_gain = gain[i];
            }
        } else if (best_child[p] < 0 || gain[i] > gain[best_child[p]]) {
            if (best_child[p] >= 0) gain[p] -= gain[best_child[p]];
            best_child[p] = i;
            gain[p] += gain[i];
        }
    }
    int32_t k = 0;
    const Tree::Slots o = t.slots();
    for (int32_t node = root_best; node >= 0; node = best_child[node], ++k)
        // node >= k always (a child comes after its parent): the chain overwrites in place
        o.set(k, o.tokens[node], k - 1, o.probs[node], o.bits[node]);
    t.resize(k);
}

}  // namespace
