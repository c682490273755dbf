// A draft tree as flat arrays, the order in which trees are cut (rank keys: best first), and
// the heap that merges walk in that order.
// Python: redraft.proto.tree
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "arrays.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A tree under construction: flat arrays, parents before children, as the reference's.
// Python: redraft.proto.tree.Tree
struct Tree {
    Array<uint32_t> tokens;
    Array<int32_t> parents;
    Array<double> probs;
    Array<uint8_t> bits;
    int64_t match_len = 0;

    void clear(int64_t ml = 0) {
        tokens.clear();
        parents.clear();
        probs.clear();
        bits.clear();
        match_len = ml;
    }
    size_t size() const { return tokens.size(); }
    void resize(size_t n) {
        tokens.resize(n);
        parents.resize(n);
        probs.resize(n);
        bits.resize(n);
    }
    // The node arrays as raw pointers (valid until the next resize), for the loops that fill
    // a tree: a node's source bit stored through a vector would make the compiler load every
    // vector's bounds again.
    struct Slots {
        uint32_t* tokens;
        int32_t* parents;
        double* probs;
        uint8_t* bits;
        void set(size_t i, uint32_t t, int32_t p, double q, uint8_t b) const {
            tokens[i] = t;
            parents[i] = p;
            probs[i] = q;
            bits[i] = b;
        }
    };
    Slots slots() { return {tokens.data(), parents.data(), probs.data(), bits.data()}; }
};

// Puts the m smallest of `keys` first, ascending (the rest in any order). Keys are unique
// (each ends with its node's index), so the result is exactly that of a full stable sort.
void smallest_first(std::vector<u128>& keys, size_t m) {
    if (m < keys.size()) {
        std::nth_element(keys.begin(), keys.begin() + m, keys.end());
        std::sort(keys.begin(), keys.begin() + m);
    } else {
        std::sort(keys.begin(), keys.end());
    }
}

// A binary min-heap of rank keys that can put a new key in the place of its least (one pass
// down instead of a pop and a push: the merge takes a node, then adds its children).
class KeyHeap {
  public:
    void clear() { k_.clear(); }
    bool empty() const { return k_.empty(); }
    u128 least() const { return k_[0]; }
    void push(u128 key) {
        size_t at = k_.size();
        k_.push_back(key);
        while (at > 0) {
            size_t up = (at - 1) / 2;
            if (!(key < k_[up])) break;
            k_[at] = k_[up];
            at = up;
        }
        k_[at] = key;
    }
    void replace_least(u128 key) { sink(key); }
    void pop_least() {
        u128 last = k_.back();
        k_.pop_back();
        if (!k_.empty()) sink(last);
    }

  private:
    void sink(u128 key) {  // key goes in at the top, and down to where it belongs
        size_t n = k_.size(), at = 0;
        for (;;) {
            size_t c = 2 * at + 1;
            if (c >= n) break;
            if (c + 1 < n && k_[c + 1] < k_[c]) ++c;
            if (!(k_[c] < key)) break;
            k_[at] = k_[c];
            at = c;
        }
        k_[at] = key;
    }
    std::vector<u128> k_;
};

// The order of take_top as one unique integer per node: path probability descending
// (the bits of a non-negative double order as the double does), then depth, then index.
// Python: redraft.proto.tree.best_first
inline u128 rank_key(double path, int32_t depth, int32_t i) {
    uint64_t bits;
    std::memcpy(&bits, &path, 8);
    return (static_cast<u128>(~bits) << 64) |
           (static_cast<u128>(static_cast<uint32_t>(depth)) << 32) | static_cast<uint32_t>(i);
}

}  // namespace
