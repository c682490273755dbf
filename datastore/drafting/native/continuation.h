// The tree of copied continuations that prompt lookup and the learned outputs both draft: a
// trie of what followed earlier occurrences of the context's suffix, weighted by match length.
// Python: redraft.datastore.drafting.prompt_lookup.continuation_tree
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "scratch.h"
#include "tree.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// The estimated chance that the token after an m-token match is right.
// Python: redraft.datastore.drafting.prompt_lookup.match_confidence
inline double match_confidence(int64_t m) {
    double x = static_cast<double>(m) / (static_cast<double>(m) + 1.5);
    return x < 0.95 ? x : 0.95;
}

// The same for the small m of nearly every node, computed once (the same division: the
// same bits), instead of a division per node.
struct ConfidenceTable {
    static constexpr int64_t kSize = 128;
    double v[kSize];
    ConfidenceTable() {
        for (int64_t m = 0; m < kSize; ++m) v[m] = match_confidence(m);
    }
    double operator()(int64_t m) const {
        return m >= 0 && m < kSize ? v[m] : match_confidence(m);
    }
};
const ConfidenceTable confidence;

// Python: redraft.datastore.drafting.prompt_lookup.continuation_tree
// The trie of copied continuations (best first), identical ones walked once with their summed
// weight m*m.
void continuation_tree(const std::vector<Continuation>& conts, int64_t budget, uint8_t bit,
                       Tree& out, Scratch& s) {
    out.clear();
    if (conts.empty()) return;
    struct Vote {
        const uint32_t* tokens;
        int64_t len, w, m;
    };
    Vote stack[8];  // both callers merge at most 8 continuations
    std::vector<Vote> heap;
    Vote* votes = stack;
    if (conts.size() > 8) {
        heap.resize(conts.size());
        votes = heap.data();
    }
    size_t nv = 0;
    for (const auto& c : conts) {
        Vote* same = nullptr;
        for (size_t j = 0; j < nv; ++j)
            if (votes[j].len == c.len &&
                (c.len == 0 ||
                 std::memcmp(votes[j].tokens, c.tokens, c.len * sizeof(uint32_t)) == 0)) {
                same = &votes[j];
                break;
            }
        if (same == nullptr) {
            votes[nv++] = {c.tokens, c.len, c.match_len * c.match_len, c.match_len};
        } else {
            same->w += c.match_len * c.match_len;
            if (c.match_len > same->m) same->m = c.match_len;
        }
    }
    // The trie, vote by vote: a vote's first nodes are those of the earlier vote with which
    // it shares the longest prefix (every earlier vote with that prefix went through the
    // same nodes); its other tokens open new nodes, in order (the reference's numbering).
    auto& chain = s.ct_chain;  // each vote's walk (node ids), one after the other
    auto& start = s.ct_start;
    start.resize(nv + 1);
    start[0] = 0;
    for (size_t vi = 0; vi < nv; ++vi) start[vi + 1] = start[vi] + votes[vi].len;
    chain.resize(start[nv]);
    auto& own = s.ct_own;  // where each vote's own nodes start in `chain`
    own.resize(nv);
    // Sized for a node per vote token (no growth checks while building), n nodes used; raw
    // pointers from here on (see Tree::Slots).
    const size_t cap = static_cast<size_t>(start[nv]);
    s.ct_tokens.resize(cap);
    s.ct_parents.resize(cap);
    s.ct_depth.resize(cap);
    s.ct_weight.resize(cap);
    s.ct_best.resize(cap);
    s.ct_sibling.resize(cap + 1);
    s.ct_probs.resize(cap);
    s.path.resize(cap + 1);
    s.new_id.resize(cap);
    uint32_t* tokens = s.ct_tokens.data();
    int32_t* parents = s.ct_parents.data();
    int32_t* depth = s.ct_depth.data();
    int64_t* weight = s.ct_weight.data();
    int32_t* best = s.ct_best.data();
    int32_t n = 0;
    for (size_t vi = 0; vi < nv; ++vi) {
        const Vote& v = votes[vi];
        int64_t share = 0;
        size_t from = 0;
        for (size_t u = 0; u < vi; ++u) {
            int64_t lim = std::min(v.len, votes[u].len), l = 0;
            while (l < lim && votes[u].tokens[l] == v.tokens[l]) ++l;
            if (l > share) {
                share = l;
                from = u;
            }
        }
        int32_t* walk = chain.data() + start[vi];
        own[vi] = start[vi] + share;
        for (int64_t j = 0; j < share; ++j) {
            int32_t node = chain[start[from] + j];
            weight[node] += v.w;
            if (v.m > best[node]) best[node] = static_cast<int32_t>(v.m);
            walk[j] = node;
        }
        int32_t parent = share ? walk[share - 1] : -1;
        for (int64_t j = share; j < v.len; ++j) {
            int32_t node = n++;
            tokens[node] = v.tokens[j];
            parents[node] = parent;
            depth[node] = static_cast<int32_t>(j);
            weight[node] = v.w;
            best[node] = static_cast<int32_t>(v.m);
            walk[j] = node;
            parent = node;
        }
    }
    double* sibling = s.ct_sibling.data();
    std::fill(sibling, sibling + n + 1, 0.0);
    for (int32_t i = 0; i < n; ++i) {
        int32_t p = parents[i] < 0 ? n : parents[i];
        sibling[p] += static_cast<double>(weight[i]);
    }
    double* probs = s.ct_probs.data();
    double* path = s.path.data();
    path[n] = 1.0;  // the root's
    for (int32_t i = 0; i < n; ++i) {
        int32_t p = parents[i] < 0 ? n : parents[i];
        double conf = confidence(static_cast<int64_t>(best[i]) + depth[i]);
        double prob = conf * static_cast<double>(weight[i]) / sibling[p];
        probs[i] = prob;
        path[i] = path[p] * prob;
    }
    // take_top's order without sorting every node: each vote's walk is a chain whose keys
    // increase (a child's probability is at most 0.95, so its path probability is below
    // its parent's), and merging the chains in key order yields every node in that order.
    // A vote's chain starts at its first own node: the nodes it shares are on the chain of
    // the earlier vote it shares them with, so every node is on exactly one chain.
    out.clear(conts[0].match_len);
    const int64_t m = std::min<int64_t>(std::max<int64_t>(budget, 0), n);
    if (m == 0) return;
    struct Head {
        u128 key;
        int64_t at, end;  // the chain's next position in `chain`, and its end
    };
    Head heads_buf[8];
    std::vector<Head> heads_big;
    Head* heads = heads_buf;
    if (nv > 8) {
        heads_big.resize(nv);
        heads = heads_big.data();
    }
    auto after = [](const Head& a, const Head& b) { return a.key > b.key; };  // min-heap
    size_t nh = 0;
    for (size_t vi = 0; vi < nv; ++vi)
        if (own[vi] < start[vi + 1]) {
            int32_t i = chain[own[vi]];
            heads[nh++] = {rank_key(path[i], depth[i], i), own[vi], start[vi + 1]};
        }
    std::make_heap(heads, heads + nh, after);
    // The least head's chain moves on (or ends) in place, and sinks to where it belongs:
    // one pass down the heap per node instead of a pop and a push.
    auto sink = [&]() {
        size_t at = 0;
        for (;;) {
            size_t c = 2 * at + 1;
            if (c >= nh) break;
            if (c + 1 < nh && heads[c + 1].key < heads[c].key) ++c;
            if (heads[at].key < heads[c].key) break;
            std::swap(heads[at], heads[c]);
            at = c;
        }
    };
    int32_t* new_id = s.new_id.data();
    out.resize(m);
    const Tree::Slots o = out.slots();
    const int32_t* chains = chain.data();
    for (int32_t kept = 0; kept < m; ++kept) {
        Head& h = heads[0];
        int32_t i = chains[h.at];
        if (++h.at < h.end) {
            int32_t c = chains[h.at];
            h.key = rank_key(path[c], depth[c], c);
        } else {
            h = heads[--nh];
        }
        sink();
        int32_t p = parents[i];
        new_id[i] = kept;
        o.set(kept, tokens[i], p < 0 ? -1 : new_id[p], probs[i], bit);
    }
}

}  // namespace
