// The working memory of one thread of drafting, reused across steps (no allocation per step
// once warm), and what the lookups leave in it for the trees to be built from.
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include "arrays.h"
#include "suffix_array.h"
#include "tree.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

namespace {

// pow(q, power) remembered by q (direct-mapped): the calibrated REST probabilities are mostly
// ratios of small counts, the same ones step after step, and a pow costs a hundred cycles.
// A value is only ever the pow of its own arguments: the result is the same bits.
// Python: redraft.datastore.drafting.retrieval.calibrate
class PowMemo {
  public:
    double pow(double q, double power) {
        uint64_t qb = bits_of(q), pb = bits_of(power);
        if (pb != power_ || !ready_) {
            std::fill(std::begin(q_), std::end(q_), kEmpty);
            power_ = pb;
            ready_ = true;
        }
        size_t h = static_cast<size_t>((qb * 0x9E3779B97F4A7C15ULL) >> (64 - kBits));
        if (q_[h] != qb || qb == kEmpty) {
            q_[h] = qb;
            r_[h] = std::pow(q, power);
        }
        return r_[h];
    }

  private:
    static constexpr int kBits = 9;
    static constexpr uint64_t kEmpty = 0x3FF0000000000000ULL;  // 1.0: the caller's own case
    static uint64_t bits_of(double x) {
        uint64_t b;
        std::memcpy(&b, &x, 8);
        return b;
    }
    uint64_t q_[size_t(1) << kBits];
    double r_[size_t(1) << kBits];
    uint64_t power_ = 0;
    bool ready_ = false;
};

// A copied continuation: the tokens after an earlier occurrence of the context's suffix.
struct Continuation {
    const uint32_t* tokens;
    int64_t len;
    int64_t match_len;
};

struct LDoc;

// An occurrence a learned lookup found.
struct LearnedFound {
    uint64_t entry;
    int64_t m;
    const LDoc* doc;
    int64_t end;
};

// Working memory of one thread of drafting, reused across steps (no allocation per step
// once warm).
struct Scratch {
    KeyHeap frontier;
    PowMemo pow;
    std::vector<u128> keys;
    Array<int32_t> new_id, depth, first, kids;
    Array<double> path;
    // continuation_tree
    Array<uint32_t> ct_tokens;
    Array<int32_t> ct_parents, ct_depth, ct_best;
    Array<int64_t> ct_weight;
    Array<double> ct_probs, ct_sibling;
    Array<int32_t> ct_chain;
    Array<int64_t> ct_start, ct_own;
    // merge
    Array<uint32_t> m_tokens;
    Array<int32_t> m_parents, remap;
    Array<double> m_probs;
    Array<uint8_t> m_bits;
    // retrieval
    std::vector<uint8_t> key;
    Array<uint32_t> W, seps;  // sampled columns (D rows each), separators in each
    std::vector<int64_t> wt;
    std::vector<int32_t> cols, lcp, vlen, pd, tparent, sel, sdepth, scol, anchor, chain_out;
    std::vector<int64_t> mass, cur;
    std::vector<int32_t> class_columns[2];
    std::vector<uint32_t> ntok;
    std::vector<int64_t> pos1, pos2;
    std::vector<int32_t> sh1, sh2;
    std::vector<Range> r1, r2, best, hits;
    // calls
    std::vector<uint32_t> tokens_in;
    std::vector<int64_t> later;  // a batch's sessions whose drafting waits for learning
    Tree batch;
    // prompt lookup and learned lookups
    std::vector<std::pair<int64_t, int64_t>> found, occ;
    std::vector<Continuation> conts;
    std::vector<LearnedFound> learned_found;
};

// Each thread's own (the batched step's threads keep theirs warm). Not inlined: the compiler
// would otherwise specialise its callers for this one object and reach every field through
// the thread-local lookup, on each use.
__attribute__((noinline)) Scratch& step_scratch() {
    static thread_local Scratch scratch;
    return scratch;
}

}  // namespace
