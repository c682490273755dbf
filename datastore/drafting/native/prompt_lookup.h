// Prompt lookup: each session's incremental n-gram index of its own context, and the tree of
// what followed the context's suffix earlier in it.
// Python: redraft.datastore.drafting.prompt_lookup
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "continuation.h"
#include "scratch.h"
#include "sources.h"
#include "tree.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

// Python's hash of a tuple of small non-negative ints (Objects/tupleobject.c, 64-bit): the
// key of an n-gram in the reference's index, reproduced so that even its collisions are.
// Python: redraft.datastore.drafting.prompt_lookup._key
inline uint64_t tuple_hash(const uint32_t* t, int n) {
    const uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL,
                   P5 = 2870177450012600261ULL;
    uint64_t acc = P5;
    for (int i = 0; i < n; ++i) {
        acc += static_cast<uint64_t>(t[i]) * P2;
        acc = (acc << 31) | (acc >> 33);
        acc *= P1;
    }
    acc += static_cast<uint64_t>(n) ^ (P5 ^ 3527539ULL);
    if (acc == static_cast<uint64_t>(-1)) return 1546275796ULL;
    return acc;
}

struct U64Hash {
    size_t operator()(uint64_t x) const {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        return static_cast<size_t>(x);
    }
};

// An open-addressing map from a 64-bit key to a non-negative 64-bit value (never erased),
// growing. A slot holds its key and value side by side (a lookup touches one cache line),
// a negative value marking it empty.
class FlatMap64 {
  public:
    FlatMap64() { rehash(64); }
    int64_t get(uint64_t key, int64_t missing) const {
        size_t h = U64Hash()(key) & mask_;
        while (slots_[h].value >= 0) {
            if (slots_[h].key == key) return slots_[h].value;
            h = (h + 1) & mask_;
        }
        return missing;
    }
    // Stores value (>= 0) for key; returns the previous value (or `missing`).
    int64_t put(uint64_t key, int64_t value, int64_t missing) {
        if (2 * (count_ + 1) > slots_.size()) rehash(slots_.size() * 2);
        size_t h = U64Hash()(key) & mask_;
        while (slots_[h].value >= 0) {
            if (slots_[h].key == key) {
                int64_t old = slots_[h].value;
                slots_[h].value = value;
                return old;
            }
            h = (h + 1) & mask_;
        }
        slots_[h] = {key, value};
        ++count_;
        return missing;
    }

  private:
    struct Slot {
        uint64_t key;
        int64_t value;  // < 0: empty
    };
    void rehash(size_t cap) {
        std::vector<Slot> old(cap, Slot{0, -1});
        old.swap(slots_);
        mask_ = cap - 1;
        count_ = 0;
        for (const Slot& e : old)
            if (e.value >= 0) put(e.key, e.value, 0);
    }
    std::vector<Slot> slots_;
    size_t mask_ = 0, count_ = 0;
};

// Python: redraft.datastore.drafting.prompt_lookup.PromptLookup
// The reference's index as hash chains: per level, the latest end of each n-gram key
// and, per end, the previous end with the same key, so walking a chain from its head is
// walking the reference's list of ends backwards.
class PromptIndex {
  public:
    PromptIndex(int max_ngram, int min_ngram) : max_ngram_(max_ngram), min_ngram_(min_ngram) {
        int long_level = std::min(max_ngram, std::max(min_ngram, 4));
        levels_[0] = long_level;
        levels_[1] = min_ngram;
        nlevels_ = long_level == min_ngram ? 1 : 2;  // sorted({min, long}, reverse=True)
    }
    // Index the n-grams ending at the positions of `toks` not indexed yet (a session's
    // context only grows). Called when drafting, not when tokens arrive: a batch extends its
    // sessions one after the other, but drafts them on all its threads.
    // Python: redraft.datastore.drafting.prompt_lookup.PromptLookup.extend
    void extend(const std::vector<uint32_t>& toks) {
        size_t from = indexed_;
        indexed_ = toks.size();
        for (int l = 0; l < nlevels_; ++l) {
            int n = levels_[l];
            prev_[l].resize(toks.size(), -1);
            for (size_t end = from; end < toks.size(); ++end)
                if (end + 1 >= static_cast<size_t>(n))
                    prev_[l][end] = static_cast<int32_t>(
                        head_[l].put(key(toks, end, n), static_cast<int64_t>(end), -1));
        }
    }
    // The reference's propose over the tokens indexed so far.
    // Python: redraft.datastore.drafting.prompt_lookup.PromptLookup.propose
    void propose(const std::vector<uint32_t>& toks, int64_t budget, int64_t max_depth,
                 Tree& out, Scratch& s) const {
        out.clear();
        if (budget <= 0 || max_depth <= 0 || toks.empty()) return;
        max_depth = std::min(max_depth, budget);
        int64_t last = static_cast<int64_t>(toks.size()) - 1;
        auto& found = s.found;  // (end, match length), in the order found
        found.clear();
        for (int l = 0; l < nlevels_; ++l) {
            int n = levels_[l];
            if (last + 1 < n || static_cast<int64_t>(found.size()) >= kMaxOccurrences) continue;
            int scanned = 0;
            for (int64_t end = head_[l].get(key(toks, static_cast<size_t>(last), n), -1);
                 end >= 0; end = prev_[l][end]) {
                if (end >= last) continue;
                bool seen = false;
                for (const auto& f : found)
                    if (f.first == end) {
                        seen = true;
                        break;
                    }
                if (seen) continue;
                found.emplace_back(end, match_len(toks, end));
                if (++scanned >= kScanLimit) break;
            }
        }
        auto& occ = s.occ;
        occ.clear();
        for (const auto& f : found)
            if (f.second >= min_ngram_) occ.push_back(f);
        if (occ.empty()) return;
        std::sort(occ.begin(), occ.end(), [](const auto& a, const auto& b) {
            if (a.second != b.second) return a.second > b.second;
            return a.first > b.first;
        });
        if (static_cast<int64_t>(occ.size()) > kMaxOccurrences) occ.resize(kMaxOccurrences);
        auto& conts = s.conts;
        conts.clear();
        for (const auto& o : occ) {
            int64_t start = o.first + 1;
            int64_t len = std::min<int64_t>(max_depth, static_cast<int64_t>(toks.size()) - start);
            conts.push_back({toks.data() + start, len, o.second});
        }
        continuation_tree(conts, budget, g_sources.pld, out, s);
    }

  private:
    static constexpr int64_t kMaxOccurrences = 8, kScanLimit = 16;
    static uint64_t key(const std::vector<uint32_t>& toks, size_t end, int n) {
        return n == 1 ? toks[end] : tuple_hash(toks.data() + end + 1 - n, n);
    }
    int64_t match_len(const std::vector<uint32_t>& toks, int64_t end) const {
        int64_t last = static_cast<int64_t>(toks.size()) - 1;
        int64_t m = 0;
        while (m < max_ngram_ && end - m >= 0 && toks[end - m] == toks[last - m]) ++m;
        return m;
    }
    int max_ngram_, min_ngram_;
    size_t indexed_ = 0;  // the context's tokens indexed so far
    int levels_[2];
    int nlevels_;
    FlatMap64 head_[2];
    std::vector<int32_t> prev_[2];  // a session's context stays far below 2**31 tokens
};

}  // namespace
