// What the service's metrics count of a batched step: the trees it drafted (a draft per tree
// of at least one node, a draft token per node), and the nodes of the trees drafted before
// that the step's accepted tokens followed from the root (accepted draft tokens, and by
// their depth), each by its sequence's counter key and the node's source bits.
// Python: redraft.datastore.service.metrics.count_batch
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include <algorithm>
#include <cstdint>

namespace {

// The counters a call adds to: one array of doubles laid out as the metrics' regions are,
// [drafts: keys][draft tokens: keys x bits][accepted: keys x bits][accepted by depth: depths].
// A node's source bits at or past `bits` count as 0 (unknown).
struct Tally {
    double* into;
    int64_t keys, bits, depths;
    double* drafts() const { return into; }
    double* tokens(int64_t key) const { return into + keys + key * bits; }
    double* accepted(int64_t key) const { return into + keys + keys * bits + key * bits; }
    double* by_depth() const { return into + keys + 2 * keys * bits; }
    int64_t bit(uint8_t b) const { return b < bits ? b : 0; }
};

// A tree drafted now (its n nodes' source bits): a draft under `key` if it has a node, and
// each node a draft token under its bits. With up to 8 combinations (the service's), the
// nodes are counted in the eight 8-bit lanes of one register (a shift and an add a node;
// emptied into the counters every 255 nodes): nodes mostly share a few combinations, and
// additions to the same counter in memory would wait for each other.
// Python: redraft.datastore.service.metrics.count_batch
void tally_tree(const Tally& t, int64_t key, const uint8_t* bits, int64_t n) {
    if (n <= 0) return;
    t.drafts()[key] += 1;
    double* tokens = t.tokens(key);
    if (t.bits > 8) {
        for (int64_t i = 0; i < n; ++i) tokens[t.bit(bits[i])] += 1;
        return;
    }
    for (int64_t i = 0; i < n;) {
        uint64_t lanes = 0;
        for (const int64_t end = std::min<int64_t>(n, i + 255); i < end; ++i)
            lanes += uint64_t{1} << (8 * t.bit(bits[i]));
        for (int64_t b = 0; b < t.bits; ++b)
            tokens[b] += static_cast<double>((lanes >> (8 * b)) & 0xff);
    }
}

// The m accepted tokens walked down a tree drafted before (n nodes, parents local to it):
// each node they follow from the root (the first node that holds the token and whose parent
// is the node before) is an accepted draft token under `key` and its bits, at its depth; the
// walk stops at the first token no child holds. Every tree the core and the reference build
// has its parents before their children, so a node's children are searched after it only.
// Python: redraft.datastore.service.metrics.walk_accepted
void tally_walk(const Tally& t, int64_t key, const uint32_t* tokens, const int32_t* parents,
                const uint8_t* bits, int64_t n, const uint32_t* accepted, int64_t m) {
    double* acc = t.accepted(key);
    double* depth = t.by_depth();
    int64_t cur = -1;
    for (int64_t d = 0; d < m; ++d) {
        const uint32_t token = accepted[d];
        int64_t i = cur + 1;  // the next node that holds the token, until its parent is cur
        while ((i = std::find(tokens + i, tokens + n, token) - tokens) < n && parents[i] != cur)
            ++i;
        if (i >= n) return;
        acc[t.bit(bits[i])] += 1;
        if (d < t.depths) depth[d] += 1;
        cur = i;
    }
}

}  // namespace
