// The compiled drafting core: one session step (new tokens in, merged tree out) in one call.
//
// Why C++ and the plain CPython API: the Python drafters (the reference, which stays) spend
// most of a step creating per-node objects; here a step runs over the datastore's mapped
// arrays and flat buffers only, and the extension builds from nothing with the compiler that
// builds CPython itself (no build-time package but setuptools).
//
// Every function mirrors one of the Python reference's, named in its comment, with the same
// operation order wherever a float is computed, so that trees are identical bit for bit:
//   Reader.propose / _longest / _sample / _tree / _trie_draft   -> Store, rest_propose
//   PromptLookup (incremental n-gram index) / continuation_tree -> PromptIndex, continuation_tree
//   LearnedIndex / LearnedWriter                                 -> Learned, Writer
//   SessionDrafter / calibrate / merge_drafts / take_top         -> session_propose, merge_trees
// Where the reference sorts every node, the core often gets the same order more cheaply
// (a heap over a tree's frontier, a counting sort, merged chains); each such place says
// why the order is the same. Python objects are created only for what a call returns.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// ---- source bits (draft.SOURCE_BITS) ---------------------------------------------------
constexpr uint8_t BIT_REST = 1, BIT_PLD = 2, BIT_LEARNED = 4;

// Error codes a step returns instead of a tree; the Python wrapper then asks the reference
// for the exact exception (the same message, type and precedence as the Python drafter's).
constexpr int ERR_REST = 1;  // retrieval would raise (bad settings, ids, corpora, closed,
                              // damaged arrays)
constexpr int ERR_TOKENS = 2;  // (batched step) the accepted tokens were not token ids

PyObject* g_labels[8] = {nullptr};  // source label of each bit set ("pld+rest" for 3)

// An allocator whose resize leaves new elements unset: a tree's arrays and most working
// arrays are resized, then written in full, every step; zeroing them first cost a memset
// per array per step. (assign and resize with a value still fill.)
template <class T>
struct Unset : std::allocator<T> {
    template <class U>
    struct rebind {
        using other = Unset<U>;
    };
    Unset() = default;
    template <class U>
    Unset(const Unset<U>&) noexcept {}
    template <class U, class... Args>
    void construct(U* p, Args&&... args) {
        if constexpr (sizeof...(Args) == 0)
            ::new (static_cast<void*>(p)) U;
        else
            ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
};
template <class T>
using Array = std::vector<T, Unset<T>>;

// ---- a tree under construction (draft.Draft as flat arrays) ----------------------------
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

using u128 = unsigned __int128;

// A copied continuation: the tokens after an earlier occurrence of the context's suffix.
struct Continuation {
    const uint32_t* tokens;
    int64_t len;
    int64_t match_len;
};

// The suffix-array range [lo, hi) of a pattern in one shard.
struct Range {
    int32_t shard;
    int64_t lo, hi;
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

struct LDoc;

// An occurrence a learned lookup found.
struct LearnedFound {
    uint64_t entry;
    int64_t m;
    const LDoc* doc;
    int64_t end;
};

// pow(q, power) remembered by q (direct-mapped): the calibrated REST probabilities are mostly
// ratios of small counts, the same ones step after step, and a pow costs a hundred cycles.
// A value is only ever the pow of its own arguments: the result is the same bits.
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
    std::vector<Py_ssize_t> later;  // a batch's sessions whose drafting waits for learning
    Tree batch;
    // prompt lookup and learned lookups
    std::vector<std::pair<int64_t, int64_t>> found, occ;
    std::vector<Continuation> conts;
    std::vector<LearnedFound> learned_found;
};

// The order of draft.take_top as one unique integer per node: path probability descending
// (the bits of a non-negative double order as the double does), then depth, then index.
inline u128 rank_key(double path, int32_t depth, int32_t i) {
    uint64_t bits;
    std::memcpy(&bits, &path, 8);
    return (static_cast<u128>(~bits) << 64) |
           (static_cast<u128>(static_cast<uint32_t>(depth)) << 32) | static_cast<uint32_t>(i);
}

// draft.take_top: the `budget` best nodes (path probability descending, then depth, then
// index: Python's stable sorts), best first; a node whose parent was not kept is dropped.
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

// pld.match_confidence
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

// pld.continuation_tree: the trie of copied continuations (best first), identical ones
// walked once with their summed weight m*m.
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

// ---- prompt lookup (pld.PromptLookup) --------------------------------------------------

// Python's hash of a tuple of small non-negative ints (Objects/tupleobject.c, 64-bit): the
// key of an n-gram in the reference's index, reproduced so that even its collisions are.
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

// pld.PromptLookup's index as hash chains: per level, the latest end of each n-gram key
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
    // PromptLookup.propose over the tokens indexed so far.
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
        continuation_tree(conts, budget, BIT_PLD, out, s);
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

// ---- learned outputs (learned.LearnedIndex) --------------------------------------------
constexpr int64_t PROMPT_TAIL = 16, KEEP = 16, MAX_MATCH = 32, MAX_OCCURRENCES = 8;
constexpr int POS_BITS = 24;
constexpr uint64_t POS_MASK = (1ULL << POS_BITS) - 1;
constexpr int64_t MAX_DOC_TOKENS = static_cast<int64_t>(POS_MASK);

using Key128 = unsigned __int128;  // learned._key packs 4 ids of up to 32 bits: 95 bits

struct Key128Hash {
    size_t operator()(Key128 k) const {
        uint64_t x = static_cast<uint64_t>(k) ^ (static_cast<uint64_t>(k >> 64) * 0x9E3779B97F4A7C15ULL);
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        return static_cast<size_t>(x);
    }
};

inline Key128 learned_key(const uint32_t* t, int64_t end, int n) {
    if (n == 2) return (static_cast<Key128>(t[end - 1]) << 21) | t[end];
    return (((((static_cast<Key128>(t[end - 3]) << 21) | t[end - 2]) << 21) | t[end - 1]) << 21) |
           t[end];
}

struct LDoc {
    uint64_t id = 0;
    size_t pool = 0;
    std::vector<uint32_t> tokens;
};

// The positions of one n-gram key, oldest first: at most KEEP (+1 while appending); most keys
// have one or two, kept inline (no allocation).
class PosList {
  public:
    PosList() : n_(0), cap_(kInline), in_{0, 0} {}
    PosList(const PosList&) = delete;
    PosList& operator=(const PosList&) = delete;
    PosList(PosList&& o) noexcept : n_(o.n_), cap_(o.cap_) {
        if (cap_ > kInline)
            heap_ = o.heap_;
        else
            std::memcpy(in_, o.in_, sizeof(in_));
        o.n_ = 0;
        o.cap_ = kInline;
    }
    PosList& operator=(PosList&& o) noexcept {
        if (this != &o) {
            this->~PosList();
            new (this) PosList(std::move(o));
        }
        return *this;
    }
    ~PosList() {
        if (cap_ > kInline) std::free(heap_);
    }
    uint32_t size() const { return n_; }
    bool empty() const { return n_ == 0; }
    const uint64_t* data() const { return cap_ > kInline ? heap_ : in_; }
    void push_back(uint64_t v) {
        if (n_ == cap_) grow();
        mutable_data()[n_++] = v;
    }
    void erase_at(uint32_t i) {
        uint64_t* d = mutable_data();
        std::memmove(d + i, d + i + 1, (n_ - i - 1) * sizeof(uint64_t));
        --n_;
    }
    int64_t index_of(uint64_t v) const {
        const uint64_t* d = data();
        for (uint32_t i = 0; i < n_; ++i)
            if (d[i] == v) return i;
        return -1;
    }

  private:
    static constexpr uint32_t kInline = 2;
    uint64_t* mutable_data() { return cap_ > kInline ? heap_ : in_; }
    void grow() {
        uint32_t cap = cap_ * 2;
        uint64_t* p = static_cast<uint64_t*>(std::malloc(cap * sizeof(uint64_t)));
        if (p == nullptr) throw std::bad_alloc();
        std::memcpy(p, data(), n_ * sizeof(uint64_t));
        if (cap_ > kInline) std::free(heap_);
        heap_ = p;
        cap_ = cap;
    }
    uint32_t n_, cap_;
    union {
        uint64_t in_[kInline];
        uint64_t* heap_;
    };
};

// One pool's n-gram index: key -> positions, open addressing (erased slots become
// tombstones, cleared when the table is rebuilt).
class Pool {
  public:
    Pool() { rebuild(16); }
    bool empty() const { return full_ == 0; }
    const PosList* find(Key128 key) const {
        size_t h = Key128Hash()(key) & mask_;
        while (slots_[h].state != kEmpty) {
            if (slots_[h].state == kFull && slots_[h].key == key) return &slots_[h].list;
            h = (h + 1) & mask_;
        }
        return nullptr;
    }
    PosList* find(Key128 key) {
        return const_cast<PosList*>(static_cast<const Pool*>(this)->find(key));
    }
    // Asks for the cache line where a lookup of key starts (the table is megabytes: a
    // lookup is a cache miss, and misses asked for together overlap).
    void prefetch(Key128 key) const {
        __builtin_prefetch(&slots_[Key128Hash()(key) & mask_]);
    }
    PosList& get_or_insert(Key128 key) {
        size_t h = Key128Hash()(key) & mask_;
        size_t grave = SIZE_MAX;
        while (slots_[h].state != kEmpty) {
            if (slots_[h].state == kFull && slots_[h].key == key) return slots_[h].list;
            if (slots_[h].state == kTomb && grave == SIZE_MAX) grave = h;
            h = (h + 1) & mask_;
        }
        if (grave == SIZE_MAX) {
            if (10 * (used_ + 1) > 7 * slots_.size()) {  // rebuild, then find the slot again
                rebuild(std::max<size_t>(16, next_pow2(4 * (full_ + 1))));
                return get_or_insert(key);
            }
            ++used_;
        } else {
            h = grave;
        }
        slots_[h].state = kFull;
        slots_[h].key = key;
        ++full_;
        return slots_[h].list;
    }
    void erase(Key128 key) {
        size_t h = Key128Hash()(key) & mask_;
        while (slots_[h].state != kEmpty) {
            if (slots_[h].state == kFull && slots_[h].key == key) {
                slots_[h].state = kTomb;
                slots_[h].list = PosList();
                --full_;
                return;
            }
            h = (h + 1) & mask_;
        }
    }

  private:
    static constexpr uint8_t kEmpty = 0, kFull = 1, kTomb = 2;
    struct Slot {  // a key, its positions and its state side by side: one cache miss a probe
        Key128 key = 0;
        PosList list;
        uint8_t state = kEmpty;
    };
    static size_t next_pow2(size_t n) {
        size_t c = 16;
        while (c < n) c <<= 1;
        return c;
    }
    void rebuild(size_t cap) {
        std::vector<Slot> slots(cap);
        size_t mask = cap - 1;
        for (Slot& e : slots_) {
            if (e.state != kFull) continue;
            size_t h = Key128Hash()(e.key) & mask;
            while (slots[h].state != kEmpty) h = (h + 1) & mask;
            slots[h].state = kFull;
            slots[h].key = e.key;
            slots[h].list = std::move(e.list);
        }
        slots_.swap(slots);
        mask_ = mask;
        used_ = full_;
    }
    std::vector<Slot> slots_;
    size_t mask_ = 0, full_ = 0, used_ = 0;  // used: full slots and tombstones
};

class Learned {
  public:
    Learned(int64_t max_tokens, bool shared) : max_tokens(max_tokens), shared(shared) {}

    int64_t max_tokens;
    bool shared;
    int64_t n_tokens = 0;
    std::shared_mutex mu;  // shared while drafting, exclusive while writing

    // LearnedIndex._new_doc's pool: the tenant's (every tenant's when shared), made anew
    // when it has none (its slot reused from a dropped pool).
    size_t pool_of(const std::string& tenant) {
        const std::string& name = shared ? empty_ : tenant;
        auto it = pool_ids_.find(name);
        if (it != pool_ids_.end()) return it->second;
        size_t id;
        if (!free_pools_.empty()) {
            id = free_pools_.back();
            free_pools_.pop_back();
        } else {
            id = pools_.size();
            pools_.emplace_back();
            pool_names_.emplace_back();
            pool_docs_.push_back(0);
        }
        pool_ids_.emplace(name, id);
        pool_names_[id] = name;
        return id;
    }
    bool alive(const LDoc* doc) const { return doc != nullptr && docs_.count(doc->id) != 0; }

    std::shared_ptr<LDoc> new_doc(const std::string& tenant, const uint32_t* head, size_t n) {
        auto doc = std::make_shared<LDoc>();
        doc->id = next_id_++;
        doc->pool = pool_of(tenant);
        ++pool_docs_[doc->pool];
        order_.push_back(doc);
        docs_.emplace(doc->id, std::prev(order_.end()));
        append(*doc, head, n);
        return doc;
    }
    void append(LDoc& doc, const uint32_t* toks, size_t n) {
        Pool& pool = pools_[doc.pool];
        uint64_t base = doc.id << POS_BITS;
        prefetch_keys(pool, doc.tokens, toks, n);
        for (size_t k = 0; k < n; ++k) {
            if (static_cast<int64_t>(doc.tokens.size()) >= MAX_DOC_TOKENS) break;
            doc.tokens.push_back(toks[k]);
            int64_t end = static_cast<int64_t>(doc.tokens.size()) - 1;
            for (int n_ : {4, 2}) {
                if (end + 1 < n_) continue;
                PosList& positions = pool.get_or_insert(learned_key(doc.tokens.data(), end, n_));
                positions.push_back(base | static_cast<uint64_t>(end));
                if (static_cast<int64_t>(positions.size()) > KEEP) positions.erase_at(0);
            }
            ++n_tokens;
        }
    }
    void evict(const LDoc* keep) {
        while (n_tokens > max_tokens && !order_.empty()) {
            auto doc = order_.front();
            if (doc.get() == keep && order_.size() > 1) {
                order_.splice(order_.end(), order_, order_.begin());
                continue;
            }
            drop(doc);
        }
    }
    void drop(const std::shared_ptr<LDoc>& doc) {
        auto it = docs_.find(doc->id);
        order_.erase(it->second);
        docs_.erase(it);
        n_tokens -= static_cast<int64_t>(doc->tokens.size());
        Pool& pool = pools_[doc->pool];
        uint64_t base = doc->id << POS_BITS;
        const auto& toks = doc->tokens;
        const int64_t len = static_cast<int64_t>(toks.size()), ahead = 8;
        for (int64_t end = 0; end < len; ++end) {
            // The lookups of a few tokens on are asked for now: the cache misses overlap.
            for (int n_ : {4, 2})
                if (end + ahead < len && end + ahead + 1 >= n_)
                    pool.prefetch(learned_key(toks.data(), end + ahead, n_));
            for (int n_ : {4, 2}) {
                if (end + 1 < n_) continue;
                Key128 key = learned_key(toks.data(), end, n_);
                PosList* positions = pool.find(key);
                if (positions == nullptr) continue;
                int64_t at = positions->index_of(base | static_cast<uint64_t>(end));
                if (at < 0) continue;  // pushed out by newer positions already
                positions->erase_at(static_cast<uint32_t>(at));
                if (positions->empty()) pool.erase(key);
            }
        }
        size_t keep = std::min<size_t>(PROMPT_TAIL, toks.size());
        doc->tokens.erase(doc->tokens.begin(), doc->tokens.end() - keep);
        if (--pool_docs_[doc->pool] == 0) {  // the tenant's last document: its pool goes too
            pool_ids_.erase(pool_names_[doc->pool]);
            pools_[doc->pool] = Pool();
            pool_names_[doc->pool].clear();
            free_pools_.push_back(doc->pool);
        }
    }

    // LearnedIndex.propose (the caller holds `mu`).
    void propose(const std::string& tenant, const uint32_t* context, int64_t clen, int64_t budget,
                 int64_t max_depth, Tree& out, Scratch& s) {
        out.clear();
        if (budget <= 0 || max_depth <= 0 || clen < 2) return;
        max_depth = std::min(max_depth, budget);
        const uint32_t* ctx = context + std::max<int64_t>(0, clen - MAX_MATCH);
        int64_t n = std::min<int64_t>(clen, MAX_MATCH);
        auto pid = pool_ids_.find(shared ? empty_ : tenant);
        if (pid == pool_ids_.end() || pools_[pid->second].empty()) return;
        const Pool& pool = pools_[pid->second];
        auto& found = s.learned_found;
        found.clear();
        for (int level : {4, 2}) {
            if (n < level || !found.empty()) continue;
            const PosList* entries = pool.find(learned_key(ctx, n - 1, level));
            if (entries == nullptr) continue;
            for (int64_t e = static_cast<int64_t>(entries->size()) - 1; e >= 0; --e) {
                uint64_t entry = entries->data()[e];
                bool seen = false;
                for (const auto& f : found)
                    if (f.entry == entry) {
                        seen = true;
                        break;
                    }
                if (seen) continue;
                auto d = docs_.find(entry >> POS_BITS);
                int64_t end = static_cast<int64_t>(entry & POS_MASK);
                if (d == docs_.end()) continue;
                const LDoc* doc = d->second->get();
                if (end + 1 >= static_cast<int64_t>(doc->tokens.size())) continue;
                int64_t m = match_len(doc->tokens, end, ctx, n, level);
                if (m) found.push_back({entry, m, doc, end});
            }
        }
        if (found.empty()) return;
        std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
            if (a.m != b.m) return a.m > b.m;
            return a.entry > b.entry;
        });
        if (static_cast<int64_t>(found.size()) > MAX_OCCURRENCES) found.resize(MAX_OCCURRENCES);
        auto& conts = s.conts;
        conts.clear();
        for (const auto& f : found) {
            int64_t start = f.end + 1;
            int64_t len = std::min<int64_t>(max_depth,
                                            static_cast<int64_t>(f.doc->tokens.size()) - start);
            conts.push_back({f.doc->tokens.data() + start, len, f.m});
        }
        continuation_tree(conts, budget, BIT_LEARNED, out, s);
    }

    // learned._match_len: `level` doubled while whole slices still agree.
    static int64_t match_len(const std::vector<uint32_t>& doc, int64_t end, const uint32_t* ctx,
                             int64_t n, int64_t level) {
        auto same = [&](int64_t m) {
            return std::memcmp(doc.data() + end + 1 - m, ctx + n - m, m * sizeof(uint32_t)) == 0;
        };
        if (end + 1 < level || !same(level)) return 0;
        int64_t m = level;
        while (m < n && m < end + 1) {
            int64_t m2 = std::min(std::min(2 * m, n), end + 1);
            if (!same(m2)) break;
            m = m2;
        }
        return m;
    }

    size_t n_docs() const { return docs_.size(); }
    size_t n_pools() const { return pool_ids_.size(); }

  private:
    // Asks for the table slots of the n-grams that appending toks (n of them) to a document
    // holding `doc` will look up, before any is: the cache misses overlap.
    static void prefetch_keys(const Pool& pool, const std::vector<uint32_t>& doc,
                              const uint32_t* toks, size_t n) {
        uint32_t t[PROMPT_TAIL];  // the last 3 tokens of doc, then toks (n up to 13 here)
        size_t keep = std::min<size_t>(3, doc.size());
        n = std::min<size_t>(n, PROMPT_TAIL - 3);
        std::copy(doc.end() - keep, doc.end(), t);
        std::copy(toks, toks + n, t + keep);
        for (size_t end = keep; end < keep + n; ++end)
            for (int n_ : {4, 2})
                if (end + 1 >= static_cast<size_t>(n_)) pool.prefetch(learned_key(t, end, n_));
    }
    std::list<std::shared_ptr<LDoc>> order_;  // oldest first (OrderedDict order)
    std::unordered_map<uint64_t, std::list<std::shared_ptr<LDoc>>::iterator> docs_;
    std::unordered_map<std::string, size_t> pool_ids_;  // live pools by name
    std::vector<Pool> pools_;
    std::vector<std::string> pool_names_;
    std::vector<int64_t> pool_docs_;  // documents per pool: 0 drops the pool
    std::vector<size_t> free_pools_;  // slots of dropped pools
    uint64_t next_id_ = 0;
    const std::string empty_;
};

// learned.LearnedWriter: one generation's document, created by its first accepted token.
struct Writer {
    std::string tenant;
    std::vector<uint32_t> head;
    std::shared_ptr<LDoc> doc;

    void extend(Learned& index, const uint32_t* toks, size_t n) {
        if (n == 0) return;
        std::lock_guard<std::shared_mutex> lock(index.mu);
        if (!doc || !index.alive(doc.get())) {
            std::vector<uint32_t> h = doc ? doc->tokens : head;
            if (doc && h.size() > static_cast<size_t>(PROMPT_TAIL))
                h.erase(h.begin(), h.end() - PROMPT_TAIL);
            doc = index.new_doc(tenant, h.data(), h.size());
        }
        index.append(*doc, toks, n);
        index.evict(doc.get());
    }
    void close(Learned& index) {
        std::lock_guard<std::shared_mutex> lock(index.mu);
        doc.reset();
    }
};

// ---- retrieval (reader.Reader.propose) -------------------------------------------------
constexpr int64_t MASS = int64_t(1) << 40;
constexpr int64_t MIN_SUPPORT = 4;

inline uint32_t load_le32(const uint32_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

struct Shard {
    const uint8_t* tokens;  // big-endian, `width` bytes each
    const uint32_t* sa;     // little-endian uint32
    const uint32_t* bucket;
    int64_t length;
    const struct Prefix* pref;  // the prefix table (Store::build_prefixes), or null
    const struct Prefix* top;   // every kTop-th entry of it
    int64_t ntop;
};

// The first bytes of a suffix as stored (big-endian tokens), zeros past the shard's end
// (which never decide a comparison: the shard's last token is a separator, above every id).
struct Prefix {
    static constexpr size_t kBytes = 32;  // 16 tokens of 2 bytes, 8 of 4
    uint8_t b[kBytes];
};

// Memory for a table searched at random: 2 MiB pages where the system grants them (fewer
// TLB misses than 4 KiB pages over a table of megabytes).
// A table under a page is plain heap memory (a shard of a few thousand tokens must not cost
// 2 MiB).
class HugeArray {
  public:
    HugeArray() = default;
    HugeArray(const HugeArray&) = delete;
    HugeArray& operator=(const HugeArray&) = delete;
    ~HugeArray() { std::free(data_); }
    Prefix* get() const { return data_; }
    Prefix* allocate(size_t n) {
        std::free(data_);
        data_ = nullptr;
        const size_t page = size_t(2) << 20;
        size_t want = std::max<size_t>(1, n) * sizeof(Prefix);
        void* p = nullptr;
        if (want < page) {
            p = std::malloc(want);
            if (p == nullptr) throw std::bad_alloc();
        } else {
            size_t bytes = (want + page - 1) / page * page;
            if (posix_memalign(&p, page, bytes) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
            madvise(p, bytes, MADV_HUGEPAGE);
#endif
        }
        data_ = static_cast<Prefix*>(p);
        return data_;
    }

  private:
    Prefix* data_ = nullptr;
};

// One shard's prefix table (Store::build_prefixes). Shared by the Stores of successive
// snapshots of a datastore when the shard is the same one of an immutable segment: a reload
// builds tables only for the segments it has not seen.
struct PrefixTable {
    std::string key;  // the shard's identity across snapshots ("" : none)
    int64_t length = 0;
    HugeArray pref;
    std::vector<Prefix> top;  // every kTop-th entry of it
};

class Store {
  public:
    int width = 2;
    uint32_t sep = 0, vocab = 0;
    std::vector<Shard> shards;

    // The prefix table: the first 32 bytes (16 or 8 tokens) of every kStride-th suffix of
    // the suffix array, in the process's memory (1 byte per token of the datastore), and
    // every kTop-th entry of it again (small enough to stay in cache). A search bisects
    // these, then the at most kStride suffixes between two samples, fetched at once:
    // instead of a chain of ~20 dependent cache misses on the mapped arrays, a few that
    // overlap. A search's answer is unique in a sorted suffix array: the reference's.
    static constexpr int64_t kStride = 32, kTop = 32;
    std::vector<std::shared_ptr<PrefixTable>> tables;

    // The tables of every shard: `keys[s]` names shard s across snapshots ("" : unique to
    // this one); a table of `earlier` with the same key and length is shared, not rebuilt.
    void build_prefixes(const std::vector<std::string>& keys, const Store* earlier) {
        tables.clear();
        for (size_t s = 0; s < shards.size(); ++s) {
            Shard& sh = shards[s];
            std::shared_ptr<PrefixTable> table;
            if (earlier != nullptr && !keys[s].empty())
                for (const auto& t : earlier->tables)
                    if (t->key == keys[s] && t->length == sh.length) table = t;
            if (!table) table = build_table(sh, keys[s]);
            tables.push_back(table);
            sh.pref = table->pref.get();
            sh.top = table->top.data();
            sh.ntop = static_cast<int64_t>(table->top.size());
        }
    }

    std::shared_ptr<PrefixTable> build_table(const Shard& sh, const std::string& key) const {
        auto table = std::make_shared<PrefixTable>();
        table->key = key;
        table->length = sh.length;
        {
            int64_t n = (sh.length + kStride - 1) / kStride;
            Prefix* pref = table->pref.allocate(n);
            const int64_t ahead = 16;
            for (int64_t j = 0; j < std::min(n, ahead); ++j)
                __builtin_prefetch(sh.tokens + int64_t(load_le32(sh.sa + j * kStride)) * width);
            for (int64_t j = 0; j < n; ++j) {
                if (j + ahead < n)
                    __builtin_prefetch(sh.tokens +
                                       int64_t(load_le32(sh.sa + (j + ahead) * kStride)) * width);
                int64_t p = load_le32(sh.sa + j * kStride);
                int64_t left = sh.length - p;
                size_t avail = left > 0 ? static_cast<size_t>(left) * width : 0;
                const uint8_t* b = sh.tokens + p * width;
                size_t k = std::min(avail, Prefix::kBytes);
                std::memcpy(pref[j].b, b, k);
                std::memset(pref[j].b + k, 0, Prefix::kBytes - k);
            }
            for (int64_t j = 0; j < n; j += kTop) table->top.push_back(pref[j]);
        }
        return table;
    }

    // The first sample j in [j0, j1) whose prefix (shifted to the key's length) is >= K
    // (strict: > K), or j1: the top table (cache-resident) first, then one block of the
    // table, fetched whole before it is bisected.
    // A key's first kb bytes as 4 native words (zeros past kb), and the masks that keep a
    // prefix's first kb bytes: a comparison is then up to 4 word comparisons, inlined.
    struct WordKey {
        uint64_t w[4], mask[4];
        WordKey(const uint8_t* key, size_t kb) {
            uint8_t buf[Prefix::kBytes] = {0}, m[Prefix::kBytes] = {0};
            std::memcpy(buf, key, kb);
            std::memset(m, 0xff, kb);
            for (int i = 0; i < 4; ++i) {
                w[i] = big_endian_word(buf + 8 * i);
                mask[i] = big_endian_word(m + 8 * i);
            }
        }
        static uint64_t big_endian_word(const uint8_t* b) {
            uint64_t x;
            std::memcpy(&x, b, 8);
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_BIG_ENDIAN__
            x = __builtin_bswap64(x);
#endif
            return x;
        }
        // memcmp(prefix, key, kb) < 0, == 0, > 0 as -1, 0, 1
        int compare(const Prefix& p) const {
            for (int i = 0; i < 4; ++i) {
                uint64_t x = big_endian_word(p.b + 8 * i) & mask[i];
                if (x != w[i]) return x < w[i] ? -1 : 1;
            }
            return 0;
        }
    };

    static int64_t first_sample(const Shard& sh, int64_t j0, int64_t j1, const WordKey& key,
                                bool strict) {
        auto pass = [&](const Prefix& v) {
            int c = key.compare(v);
            return strict ? c > 0 : c >= 0;
        };
        int64_t J0 = (j0 + kTop - 1) / kTop, J1 = std::min((j1 + kTop - 1) / kTop, sh.ntop);
        int64_t lo = J0, hi = J1;
        while (lo < hi) {
            int64_t mid = (lo + hi) / 2;
            if (pass(sh.top[mid]))
                hi = mid;
            else
                lo = mid + 1;
        }
        int64_t a = lo > J0 ? kTop * (lo - 1) + 1 : j0;  // top[lo - 1] failed
        int64_t b = lo < J1 ? kTop * lo : j1;            // top[lo] passed (or the end)
        for (int64_t j = a; j < b; j += 2) __builtin_prefetch(sh.pref + j);
        while (a < b) {
            int64_t mid = (a + b) / 2;
            if (pass(sh.pref[mid]))
                b = mid;
            else
                a = mid + 1;
        }
        return a;
    }

    // Before a search over [l, h): when it is short, every suffix it may compare is asked
    // for at once (its SA entries, then their tokens), so the misses overlap.
    void prefetch_range(const Shard& sh, int64_t l, int64_t h) const {
        if (h - l > 64) return;
        for (int64_t i = l; i < h; i += 16) __builtin_prefetch(sh.sa + i);
        for (int64_t i = l; i < h; ++i) {
            int64_t p = load_le32(sh.sa + i);
            if (p < sh.length) __builtin_prefetch(sh.tokens + p * width);
        }
    }

    // Narrows [l, h), within the key's first-token bucket, to where the first suffix that
    // is >= key (upper: > key) on its first nb bytes lies, from the prefix table. Samples
    // whose prefix is below (above) the key's are below (above) the key; equal ones are
    // equal to it when the key fits in the prefix, undecided otherwise.
    void narrow(const Shard& sh, const uint8_t* key, size_t nb, bool upper, int64_t& l,
                int64_t& h) const {
        if (sh.pref == nullptr) return;
        const int64_t S = kStride;
        int64_t j0 = (l + S - 1) / S, j1 = (h + S - 1) / S;  // the samples inside [l, h)
        if (j0 >= j1) return;
        size_t kb = std::min(nb, Prefix::kBytes);
        const bool exact = nb <= Prefix::kBytes;
        const WordKey wk(key, kb);
        int64_t a = first_sample(sh, j0, j1, wk, false);
        // A lower bound with a key that fits the prefixes needs only `a` (below).
        int64_t b = !upper && exact ? a : first_sample(sh, a, j1, wk, true);
        int64_t after = upper && exact ? b : a;   // samples before `after` precede the answer
        int64_t until = !upper && exact ? a : b;  // the sample `until` is at or past it
        if (after > j0) l = std::max(l, S * (after - 1) + 1);
        if (until < j1) h = std::min(h, S * until);
    }

    uint32_t token(const Shard& sh, int64_t p) const {
        const uint8_t* b = sh.tokens + p * width;
        return width == 2 ? (uint32_t(b[0]) << 8) | b[1]
                          : (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) |
                                (uint32_t(b[2]) << 8) | b[3];
    }
    // The suffix at p against key (nb bytes): <0, 0, >0 as Python's bytes comparison of
    // the suffix's first nb bytes (a suffix cut short by the shard's end sorts first).
    // Every suffix a search compares lies in the key's first-token bucket, so the first
    // token is equal and skipped; the rest is compared 8 bytes at a time as big-endian
    // integers (what memcmp does, inlined: most comparisons end within a few tokens).
    int cmp(const Shard& sh, int64_t p, const uint8_t* key, size_t nb) const {
        int64_t left = sh.length - p;  // a damaged suffix array's p past the end: nothing
        size_t avail = left > 0 ? static_cast<size_t>(left) * width : 0;
        size_t n = std::min(nb, avail);
        const uint8_t* a = sh.tokens + p * width;
        size_t i = std::min(static_cast<size_t>(width), n);
        for (; i + 8 <= n; i += 8) {
            uint64_t x, y;
            std::memcpy(&x, a + i, 8);
            std::memcpy(&y, key + i, 8);
            if (x != y) {
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_BIG_ENDIAN__
                x = __builtin_bswap64(x);
                y = __builtin_bswap64(y);
#endif
                return x < y ? -1 : 1;
            }
        }
        for (; i < n; ++i)
            if (a[i] != key[i]) return a[i] < key[i] ? -1 : 1;
        return avail < nb ? -1 : 0;
    }
    // _Shard.lower: (first SA index >= key, end of key's first-token bucket, found)
    bool lower(const Shard& sh, const uint8_t* key, size_t nb, uint32_t t0, int64_t& i,
               int64_t& hi) const {
        int64_t lo = load_le32(sh.bucket + t0);
        // Checked when the Store was made; bounded again here, as the map may have changed
        // since (a file rewritten in place, or truncated and read as zeros: _mapping.cpp).
        hi = std::min<int64_t>(load_le32(sh.bucket + t0 + 1), sh.length);
        if (lo >= hi) {
            i = hi;
            return false;
        }
        return lower_in(sh, key, nb, lo, hi, i);
    }
    // The same within [lo, hi), a range known to hold every suffix that starts with key.
    bool lower_in(const Shard& sh, const uint8_t* key, size_t nb, int64_t lo, int64_t hi,
                  int64_t& i) const {
        int64_t l = lo, h = hi;
        narrow(sh, key, nb, false, l, h);
        prefetch_range(sh, l, h);
        while (l < h) {
            int64_t mid = (l + h) / 2;
            // the next probe is in one half or the other: fetch both while comparing
            __builtin_prefetch(sh.sa + (l + mid) / 2);
            __builtin_prefetch(sh.sa + (mid + 1 + h) / 2);
            if (cmp(sh, load_le32(sh.sa + mid), key, nb) < 0)
                l = mid + 1;
            else
                h = mid;
        }
        i = l;
        return l < hi && cmp(sh, load_le32(sh.sa + l), key, nb) == 0;
    }
    // _Shard.upper: first SA index in [lo, hi) past every suffix starting with key
    int64_t upper(const Shard& sh, const uint8_t* key, size_t nb, int64_t lo, int64_t hi) const {
        narrow(sh, key, nb, true, lo, hi);
        prefetch_range(sh, lo, hi);
        while (lo < hi) {
            int64_t mid = (lo + hi) / 2;
            __builtin_prefetch(sh.sa + (lo + mid) / 2);
            __builtin_prefetch(sh.sa + (mid + 1 + hi) / 2);
            if (cmp(sh, load_le32(sh.sa + mid), key, nb) > 0)
                hi = mid;
            else
                lo = mid + 1;
        }
        return lo;
    }
};

// Reader._ranges: the SA range of key in each selected shard where it occurs.
void ranges_of(const Store& st, const std::vector<int32_t>& sel, const uint8_t* key, size_t nb,
               uint32_t t0, std::vector<Range>& out) {
    out.clear();
    for (int32_t s : sel) {
        const Shard& sh = st.shards[s];
        int64_t i, hi;
        if (st.lower(sh, key, nb, t0, i, hi)) out.push_back({s, i, st.upper(sh, key, nb, i, hi)});
    }
}

// Reader._longest: exponential, then binary search over the suffix length.
// What a session's previous retrieval found: the longest match then (0: none) and its ranges,
// and the context's length then. Since, the context has only grown.
struct RestHint {
    bool valid = false;
    int64_t L = 0;
    size_t context_len = 0;
    std::vector<Range> ranges;
};

// Reader._longest: exponential, then binary search over the suffix length. The answer is
// the longest occurring suffix whatever the probes, so a session's previous answer narrows
// it: a match of m tokens now ends with the `added` new ones and starts with a match of
// m - added tokens then, so m <= max(previous, min_len - 1) + added; and the longest such
// candidate (the previous match and the new tokens) can only occur within the previous
// match's ranges, where it is looked up first.
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

// Reader._sample: the SA positions (and shards) of up to k_max occurrences spread evenly
// over the ranges, in the reference's column order. Returns their number.
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

// Reader.propose (+ _tree, _trie_draft): the REST tree of the context's tail. False (and an
// empty tree) where a sampled continuation holds an id past the separator: damaged token
// arrays of a Reader opened without verifying, which must never reach a draft (the
// reference's Reader._sample raises DatastoreCorrupt for the same columns).
bool rest_propose(const Store& st, const std::vector<int32_t>& sel, const uint32_t* tail,
                  int64_t n, const RestParams& p, Tree& out, Scratch& s, RestHint& hint,
                  size_t context_len) {
    out.clear();
    if (p.budget == 0 || n < p.min_match) {
        hint.valid = false;
        return true;
    }
    const int w = st.width;
    auto& key = s.key;
    encode_key(tail, n, w, key);
    auto& r1 = s.r1;
    auto& r2 = s.r2;
    int64_t L = longest(st, sel, tail, n, key.data(), p.min_match, r1, s, hint, context_len);
    hint.valid = true;
    hint.L = L;
    hint.context_len = context_len;
    hint.ranges.assign(r1.begin(), r1.end());
    if (L == 0) return true;
    int64_t support = 0;
    for (const auto& r : r1) support += r.hi - r.lo;
    int64_t L2 = 0;
    bool two = false;
    if (support < MIN_SUPPORT && L > p.min_match) {
        for (L2 = L - 1; L2 >= p.min_match; --L2) {
            ranges_of(st, sel, key.data() + (n - L2) * w, static_cast<size_t>(L2) * w,
                      tail[n - L2], r2);
            int64_t sup2 = 0;
            for (const auto& r : r2) sup2 += r.hi - r.lo;
            if (sup2 >= MIN_SUPPORT || L2 == p.min_match) {
                two = true;
                break;
            }
        }
    }
    const int64_t D = p.max_depth;
    // Sampled occurrence positions of each level (one column each).
    auto &pos1 = s.pos1, &pos2 = s.pos2;
    auto &sh1 = s.sh1, &sh2 = s.sh2;
    pos2.clear();
    sh2.clear();
    int64_t k1 = sample(st, r1, p.max_occurrences, pos1, sh1);
    int64_t k2 = two ? sample(st, r2, p.max_occurrences, pos2, sh2) : 0;
    int64_t k = k1 + k2;
    if (k == 0) return true;
    // Column c (contiguous, D rows): the tokens at min(L + d + pos, length - 1) of its shard.
    // Every column's cache lines (its first and last token's) are asked for before any is
    // read: the reads overlap.
    for (int64_t c = 0; c < k; ++c) {
        bool first = c < k1;
        const Shard& sh = st.shards[first ? sh1[c] : sh2[c - k1]];
        int64_t at = (first ? L : L2) + (first ? pos1[c] : pos2[c - k1]);
        __builtin_prefetch(sh.tokens + std::min(at, sh.length - 1) * w);
        __builtin_prefetch(sh.tokens + std::min(at + D - 1, sh.length - 1) * w);
    }
    // While a column is read, its separators are counted (most columns hold none, and are
    // then all valid rows: see vlen below).
    const uint32_t sep = st.sep;
    auto& W = s.W;
    W.resize(static_cast<size_t>(D * k));
    auto& seps = s.seps;
    seps.resize(k);
    for (int64_t c = 0; c < k; ++c) {
        bool first = c < k1;
        const Shard& sh = st.shards[first ? sh1[c] : sh2[c - k1]];
        int64_t at = (first ? L : L2) + (first ? pos1[c] : pos2[c - k1]);
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
        if (top > sep) {  // damaged: no id past the vocabulary is ever drafted
            out.clear();
            return false;
        }
    }
    // Column order and weights: one SA range sampled in order is already sorted (unit
    // weights); otherwise columns sorted as np.lexsort(W[::-1]) sorts them, weighted.
    const bool unit = !two && r1.size() == 1;
    auto& cols = s.cols;
    cols.resize(k);
    std::iota(cols.begin(), cols.end(), 0);
    auto& wt = s.wt;
    int64_t root;
    if (unit) {
        wt.assign(k, 1);
        root = k;
    } else {
        double lam = two ? static_cast<double>(support) / (static_cast<double>(support) + 1.0)
                         : 1.0;
        auto weight = [](double share, int64_t ncols) {
            int64_t m = static_cast<int64_t>(static_cast<double>(MASS) * share) / ncols;
            return std::max<int64_t>(1, m);
        };
        int64_t a = weight(lam, k1), b = k2 ? weight(1.0 - lam, k2) : 0;
        const uint32_t* Wp = W.data();
        std::sort(cols.begin(), cols.end(), [&](int32_t x, int32_t y) {
            const uint32_t *cx = Wp + x * D, *cy = Wp + y * D;
            for (int64_t d = 0; d < D; ++d)
                if (cx[d] != cy[d]) return cx[d] < cy[d];
            return x < y;  // equal columns in their order, as lexsort (stable) keeps them
        });
        wt.resize(k);
        root = 0;
        for (int64_t c = 0; c < k; ++c) {
            wt[c] = cols[c] < k1 ? a : b;
            root += wt[c];
        }
    }
    // _trie_draft, without building every node. In sorted order, column c opens a node at
    // each depth d with lcp[c] <= d < vlen[c] (lcp: rows equal to the previous column's;
    // vlen: rows before the first separator). A node's mass is the weight of the columns
    // through it. The nodes column c opens below pd[c] = max(lcp[c], lcp[c + 1]) are
    // shared with a neighbour (built here: there are few); those from pd[c] on are c's
    // alone, a chain of mass wt[c] (enumerated only as far as the budget reaches).
    auto& lcp = s.lcp;
    auto& vlen = s.vlen;
    auto& pd = s.pd;
    lcp.assign(k + 1, 0);
    vlen.resize(k);
    pd.resize(k);
    for (int64_t c = 0; c < k; ++c) {
        const uint32_t* col = W.data() + static_cast<int64_t>(cols[c]) * D;
        int32_t v = static_cast<int32_t>(D);
        if (seps[cols[c]])
            for (v = 0; col[v] != sep;) ++v;
        vlen[c] = v;
        if (c > 0) {
            const uint32_t* prev = W.data() + static_cast<int64_t>(cols[c - 1]) * D;
            int32_t l = 0;
            while (l < v && col[l] == prev[l]) ++l;
            lcp[c] = l;
        }
    }
    int64_t nn = 0;  // every node: the reference's trie size
    for (int64_t c = 0; c < k; ++c) {
        pd[c] = std::min(vlen[c], std::max(lcp[c], lcp[c + 1]));
        nn += vlen[c] - lcp[c];
    }
    out.match_len = L;
    if (nn == 0) return true;
    // Shared nodes: mass, depth, opening column, parent (a shared node or -1), token.
    int64_t ns = 0;  // their number (pd[c] >= lcp[c], as lcp[c] <= vlen[c])
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
    auto& anchor = s.anchor;  // the shared node above each column's own chain (-1: root)
    anchor.resize(k);
    for (int64_t c = 0, id = 0; c < k; ++c) {
        const uint32_t* col = W.data() + static_cast<int64_t>(cols[c]) * D;
        for (int32_t d = lcp[c]; d < pd[c]; ++d, ++id) {
            sdepth[id] = d;
            scol[id] = static_cast<int32_t>(c);
            sparent[id] = d == 0 ? -1 : static_cast<int32_t>(cur[d - 1]);
            stok[id] = col[d];
            cur[d] = id;
        }
        int64_t wc = wt[c];
        for (int32_t d = 0; d < pd[c]; ++d) smass[cur[d]] += wc;
        anchor[c] = pd[c] > 0 ? static_cast<int32_t>(cur[pd[c] - 1]) : -1;
    }
    // Ranked by dep - mass * (D + 1) ascending, then node id (the reference's stable
    // argsort): mass descending, then depth, then column (ids run depth-major). Shared
    // nodes are sorted; each class of chains of one weight is walked depth by depth.
    auto rank = [](int64_t mass, int32_t d, int64_t c) {
        return (static_cast<u128>(UINT64_MAX - static_cast<uint64_t>(mass)) << 64) |
               (static_cast<uint64_t>(d) << 32) | static_cast<uint64_t>(c);
    };
    auto& keys = s.keys;
    keys.resize(ns);
    for (int64_t i = 0; i < ns; ++i) keys[i] = rank(smass[i], sdepth[i], scol[i]);
    auto& sorder = s.sel;
    sorder.resize(ns);
    std::iota(sorder.begin(), sorder.end(), 0);
    std::sort(sorder.begin(), sorder.end(), [&](int32_t a, int32_t b) { return keys[a] < keys[b]; });
    struct Chains {  // the chain nodes of the columns of one weight, by depth then column
        int64_t weight;
        int32_t d, at, dmax;  // the next node: depth d, at-th column of the class
        std::vector<int32_t>& columns;
        u128 key;  // the next node's rank (all ones: none left)
    };
    const u128 none = ~static_cast<u128>(0);
    // Columns weigh one of at most two values (one per level sampled): two classes.
    Chains classes[2] = {{0, INT32_MAX, 0, 0, s.class_columns[0], none},
                         {0, INT32_MAX, 0, 0, s.class_columns[1], none}};
    classes[0].columns.clear();
    classes[1].columns.clear();
    int nclass = 0;
    for (int64_t c = 0; c < k; ++c) {
        if (pd[c] >= vlen[c]) continue;
        int j = 0;
        while (j < nclass && classes[j].weight != wt[c]) ++j;
        if (j == nclass) classes[nclass++].weight = wt[c];
        Chains& ch = classes[j];
        ch.columns.push_back(static_cast<int32_t>(c));
        ch.d = std::min(ch.d, pd[c]);
        ch.dmax = std::max(ch.dmax, vlen[c]);
    }
    // Moves the class to its next node (depth d, column columns[at]) and ranks it.
    auto advance = [&](Chains& ch) {
        const int32_t* columns = ch.columns.data();
        const int32_t ncols = static_cast<int32_t>(ch.columns.size());
        for (; ch.d < ch.dmax; ++ch.d, ch.at = 0)
            for (; ch.at < ncols; ++ch.at) {
                int32_t col = columns[ch.at];
                if (pd[col] <= ch.d && ch.d < vlen[col]) {
                    ch.key = rank(ch.weight, ch.d, col);
                    return;
                }
            }
        ch.key = none;
    };
    for (int j = 0; j < nclass; ++j) advance(classes[j]);
    const int64_t m = std::min<int64_t>(p.budget, nn);
    auto& sout = s.remap;  // output index of each shared node
    sout.assign(ns, -1);
    auto& chain_out = s.chain_out;  // output index of each column's last chain node
    chain_out.assign(k, -1);
    out.resize(m);
    const Tree::Slots o = out.slots();
    int64_t next_shared = 0;
    for (int64_t i = 0; i < m; ++i) {
        int best = -1;  // -1: the next shared node; else a class
        u128 bk = next_shared < ns ? keys[sorder[next_shared]] : none;
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
                  static_cast<double>(smass[node]) / pm, BIT_REST);
        } else {
            Chains& ch = classes[best];
            int32_t bd = ch.d, bc = ch.columns[ch.at];
            ++ch.at;
            advance(ch);
            const uint32_t* col = W.data() + static_cast<int64_t>(cols[bc]) * D;
            int64_t wc = wt[bc];
            int32_t parent;
            double pm;
            if (bd == pd[bc]) {
                int32_t a = anchor[bc];
                parent = a < 0 ? -1 : sout[a];
                pm = static_cast<double>(a < 0 ? root : smass[a]);
            } else {  // below its own chain node: wc / wc
                parent = chain_out[bc];
                pm = static_cast<double>(wc);
            }
            chain_out[bc] = static_cast<int32_t>(i);
            o.set(i, col[bd], parent, bd == pd[bc] ? static_cast<double>(wc) / pm : 1.0,
                  BIT_REST);
        }
    }
    return true;
}

// merge.merge_drafts: shared prefixes merged (higher prob kept, source bits OR-ed), then
// the `budget` best nodes by path probability. A node's children are kept as a list (the
// first child, then each child's next sibling): they find a draft's node in the merged tree
// and, when no probability exceeds 1 (every child then ranks below its parent), give the
// best nodes in take_top's order from a heap of the frontier, without sorting the rest.
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

// ============================ Python types ==============================================

bool read_tokens(PyObject* obj, std::vector<uint32_t>& out, const char* what);

// ---- Store --------------------------------------------------------------------------
struct StoreObject {
    PyObject_HEAD
    Store store;
    std::vector<Py_buffer> views;  // held for the Store's life: the map stays mapped
    PyObject* reader;              // a weak reference, asked whether it was closed
    PyObject* weakrefs;            // the Store's own weak references (the wrapper keeps some)
};

void Store_dealloc(StoreObject* self) {
    if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(self));
    for (auto& v : self->views) PyBuffer_Release(&v);
    self->views.~vector();
    self->store.~Store();
    Py_XDECREF(self->reader);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyTypeObject StoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Store(reader, width, separator, vocab_size, [(tokens, sa, bucket, length, key), ...],
//       earlier=None): `key` names a shard across snapshots ("": none); the prefix tables of
// `earlier` (a Store of an older snapshot) are shared for the shards whose key it has.
int Store_init(StoreObject* self, PyObject* args, PyObject*) {
    PyObject *reader, *shards, *earlier = Py_None;
    int width;
    unsigned long sep, vocab;
    if (!PyArg_ParseTuple(args, "OikkO!|O", &reader, &width, &sep, &vocab, &PyList_Type, &shards,
                          &earlier))
        return -1;
    if (earlier != Py_None && !PyObject_TypeCheck(earlier, &StoreType)) {
        PyErr_SetString(PyExc_TypeError, "earlier must be a Store or None");
        return -1;
    }
    std::vector<std::string> keys;
    if (width != 2 && width != 4) {
        PyErr_SetString(PyExc_ValueError, "token width must be 2 or 4 bytes");
        return -1;
    }
    self->store.width = width;
    self->store.sep = static_cast<uint32_t>(sep);
    self->store.vocab = static_cast<uint32_t>(vocab);
    // Weak: the reader's own cache of its Store must not keep it alive.
    PyObject* ref = PyWeakref_NewRef(reader, nullptr);
    if (ref == nullptr) return -1;
    Py_XSETREF(self->reader, ref);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(shards); ++i) {
        PyObject *tok, *sa, *bucket;
        long long length;
        const char* key;
        Py_ssize_t klen;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(shards, i), "OOOLs#", &tok, &sa, &bucket, &length,
                              &key, &klen))
            return -1;
        keys.emplace_back(key, klen);
        Py_buffer b[3];
        PyObject* arrays[3] = {tok, sa, bucket};
        for (int j = 0; j < 3; ++j) {
            if (PyObject_GetBuffer(arrays[j], &b[j], PyBUF_C_CONTIGUOUS) < 0) {
                for (int q = 0; q < j; ++q) PyBuffer_Release(&b[q]);
                return -1;
            }
        }
        for (int j = 0; j < 3; ++j) self->views.push_back(b[j]);
        if (b[0].len != length * width || b[1].len != length * 4 ||
            b[2].len != static_cast<Py_ssize_t>(vocab + 2) * 4 || length < 0) {
            PyErr_Format(PyExc_ValueError, "shard %zd: array sizes do not fit its length", i);
            return -1;
        }
        // Every suffix-array index a lookup reads lies within a first-token bucket: checked
        // here once, a damaged bucket table cannot send a lookup outside the arrays.
        const uint32_t* bk = static_cast<const uint32_t*>(b[2].buf);
        for (unsigned long t = 0; t <= vocab; ++t) {
            if (load_le32(bk + t) > load_le32(bk + t + 1) ||
                load_le32(bk + t + 1) > static_cast<uint64_t>(length)) {
                PyErr_Format(PyExc_ValueError, "shard %zd: damaged first-token buckets", i);
                return -1;
            }
        }
        self->store.shards.push_back({static_cast<const uint8_t*>(b[0].buf),
                                      static_cast<const uint32_t*>(b[1].buf),
                                      static_cast<const uint32_t*>(b[2].buf), length, nullptr,
                                      nullptr, 0});
    }
    const Store* before =
        earlier == Py_None ? nullptr : &reinterpret_cast<StoreObject*>(earlier)->store;
    bool failed = false;
    Py_BEGIN_ALLOW_THREADS  // reads every 32nd suffix of the mapped arrays
    try {
        self->store.build_prefixes(keys, before);
    } catch (const std::bad_alloc&) {
        failed = true;
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

PyObject* Store_new(PyTypeObject* type, PyObject*, PyObject*) {
    StoreObject* self = reinterpret_cast<StoreObject*>(type->tp_alloc(type, 0));
    if (self == nullptr) return nullptr;
    new (&self->store) Store();
    new (&self->views) std::vector<Py_buffer>();
    self->reader = nullptr;
    self->weakrefs = nullptr;
    return reinterpret_cast<PyObject*>(self);
}

// ---- Learned ------------------------------------------------------------------------
struct LearnedObject {
    PyObject_HEAD
    Learned* index;
    Scratch* scratch;
};

PyObject* Learned_new(PyTypeObject* type, PyObject*, PyObject*) {
    LearnedObject* self = reinterpret_cast<LearnedObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) {
        self->index = nullptr;
        self->scratch = new Scratch();
    }
    return reinterpret_cast<PyObject*>(self);
}

int Learned_init(LearnedObject* self, PyObject* args, PyObject*) {
    long long max_tokens;
    int shared;
    if (!PyArg_ParseTuple(args, "Lp", &max_tokens, &shared)) return -1;
    if (max_tokens <= 0) {
        PyErr_Format(PyExc_ValueError, "max_tokens must be positive, got %lld", max_tokens);
        return -1;
    }
    delete self->index;
    self->index = new Learned(max_tokens, shared != 0);
    return 0;
}

void Learned_dealloc(LearnedObject* self) {
    delete self->index;
    delete self->scratch;
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* tree_to_python(const Tree& t, bool as_lists);

// propose(tenant, context, budget, max_depth, as_lists) -> tree tuple
PyObject* Learned_propose(LearnedObject* self, PyObject* args) {
    const char* tenant;
    Py_ssize_t tlen;
    PyObject* context;
    long long budget, max_depth;
    int as_lists = 1;
    if (!PyArg_ParseTuple(args, "y#OLL|p", &tenant, &tlen, &context, &budget, &max_depth,
                          &as_lists))
        return nullptr;
    std::vector<uint32_t> ctx;
    if (!read_tokens(context, ctx, "context")) return nullptr;
    Tree out;
    {
        std::shared_lock<std::shared_mutex> lock(self->index->mu);
        self->index->propose(std::string(tenant, tlen), ctx.data(),
                             static_cast<int64_t>(ctx.size()), budget, max_depth, out,
                             *self->scratch);
    }
    PyObject* tree = tree_to_python(out, as_lists != 0);
    if (tree == nullptr) return nullptr;
    return Py_BuildValue("(NL)", tree, static_cast<long long>(out.match_len));
}

// load([(tenant, tokens), ...]): finished, already persisted documents, oldest first
PyObject* Learned_load(LearnedObject* self, PyObject* arg) {
    PyObject* it = PyObject_GetIter(arg);
    if (it == nullptr) return nullptr;
    std::vector<std::pair<std::string, std::vector<uint32_t>>> docs;
    PyObject* item;
    while ((item = PyIter_Next(it)) != nullptr) {
        PyObject* tokens;
        const char* s;
        Py_ssize_t n;
        if (!PyArg_ParseTuple(item, "y#O", &s, &n, &tokens)) {
            Py_DECREF(item);
            Py_DECREF(it);
            return nullptr;
        }
        std::vector<uint32_t> toks;
        if (!read_tokens(tokens, toks, "tokens")) {
            Py_DECREF(item);
            Py_DECREF(it);
            return nullptr;
        }
        docs.emplace_back(std::string(s, n), std::move(toks));
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return nullptr;
    std::lock_guard<std::shared_mutex> lock(self->index->mu);
    for (auto& d : docs) self->index->new_doc(d.first, d.second.data(), d.second.size());
    self->index->evict(nullptr);
    Py_RETURN_NONE;
}

PyObject* Learned_stats(LearnedObject* self, PyObject*) {
    std::lock_guard<std::shared_mutex> lock(self->index->mu);
    return Py_BuildValue("{s:L,s:n,s:L,s:n}", "learned_tokens",
                         static_cast<long long>(self->index->n_tokens), "learned_docs",
                         static_cast<Py_ssize_t>(self->index->n_docs()), "learned_max_tokens",
                         static_cast<long long>(self->index->max_tokens), "learned_pools",
                         static_cast<Py_ssize_t>(self->index->n_pools()));
}

PyObject* Learned_get_n_tokens(LearnedObject* self, void*) {
    std::lock_guard<std::shared_mutex> lock(self->index->mu);
    return PyLong_FromLongLong(self->index->n_tokens);
}

PyTypeObject LearnedType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- Writer (a LearnedWriter) -----------------------------------------------------------
struct WriterObject {
    PyObject_HEAD
    PyObject* learned;  // LearnedObject
    Writer* writer;
};

PyObject* Writer_new(PyTypeObject* type, PyObject*, PyObject*) {
    WriterObject* self = reinterpret_cast<WriterObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) {
        self->learned = nullptr;
        self->writer = new Writer();
    }
    return reinterpret_cast<PyObject*>(self);
}

// Writer(learned, tenant, head)
int Writer_init(WriterObject* self, PyObject* args, PyObject*) {
    PyObject *learned, *head;
    const char* tenant;
    Py_ssize_t tlen;
    if (!PyArg_ParseTuple(args, "O!y#O", &LearnedType, &learned, &tenant, &tlen, &head))
        return -1;
    std::vector<uint32_t> h;
    if (!read_tokens(head, h, "prompt")) return -1;
    if (h.size() > static_cast<size_t>(PROMPT_TAIL)) h.erase(h.begin(), h.end() - PROMPT_TAIL);
    Py_INCREF(learned);
    Py_XSETREF(self->learned, learned);
    self->writer->tenant.assign(tenant, tlen);
    self->writer->head = std::move(h);
    self->writer->doc.reset();
    return 0;
}

void Writer_dealloc(WriterObject* self) {
    delete self->writer;
    Py_XDECREF(self->learned);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

Learned& learned_of(PyObject* obj) { return *reinterpret_cast<LearnedObject*>(obj)->index; }

PyObject* Writer_extend(WriterObject* self, PyObject* arg) {
    std::vector<uint32_t> toks;
    if (!read_tokens(arg, toks, "tokens")) return nullptr;
    self->writer->extend(learned_of(self->learned), toks.data(), toks.size());
    Py_RETURN_NONE;
}

PyObject* Writer_close(WriterObject* self, PyObject*) {
    self->writer->close(learned_of(self->learned));
    Py_RETURN_NONE;
}

PyTypeObject WriterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- Session (a SessionDrafter) -----------------------------------------------------------
struct SessionState {
    // retrieval
    PyObject* store = nullptr;  // StoreObject, or null: no retrieval
    std::vector<int32_t> shards;
    bool rest_ok = true;  // false: the reference's Reader.propose would raise
    RestParams rest{};
    double scale = 1.0, power = 1.0;
    RestHint hint;
    // prompt lookup
    std::unique_ptr<PromptIndex> pld;
    // learned outputs
    PyObject* learned = nullptr;  // LearnedObject, or null
    bool learned_drafts = false;
    Writer writer;
    // state
    std::vector<uint32_t> context;
    int64_t budget = 64, max_depth = 16;
    int64_t rest_match_len = 0, pld_match_len = 0, learned_match_len = 0;
    Tree t_rest, t_pld, t_learned, out;
    // the last batched step's: out's expected accepted tokens and the source bits it holds
    double expected = 0.0;
    uint8_t used = 0;
    std::vector<uint32_t> unlearned;  // a batched step's accepted tokens, until learned
};

struct SessionObject {
    PyObject_HEAD
    SessionState* s;
};

// Not inlined: the compiler would otherwise specialise its callers for this one object and
// reach every field through the thread-local lookup, on each use.
__attribute__((noinline)) Scratch& step_scratch() {
    static thread_local Scratch scratch;
    return scratch;
}

PyObject* Session_new(PyTypeObject* type, PyObject*, PyObject*) {
    SessionObject* self = reinterpret_cast<SessionObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) self->s = new SessionState();
    return reinterpret_cast<PyObject*>(self);
}

void Session_dealloc(SessionObject* self) {
    if (self->s != nullptr) {
        Py_XDECREF(self->s->store);
        Py_XDECREF(self->s->learned);
        delete self->s;
    }
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// The session's retrieval: `store`'s shards `shards` (store None: no retrieval). A new
// snapshot's shards are not the old one's: what the last search found is forgotten.
bool set_store(SessionState* s, PyObject* store, PyObject* shards, bool rest_ok) {
    if (store != Py_None && !PyObject_TypeCheck(store, &StoreType)) {
        PyErr_SetString(PyExc_TypeError, "store must be a Store or None");
        return false;
    }
    std::vector<int32_t> ids;
    if (store != Py_None) {
        const Store& st = reinterpret_cast<StoreObject*>(store)->store;
        PyObject* seq = PySequence_Fast(shards, "shards must be a sequence of shard ids");
        if (seq == nullptr) return false;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return false;
            }
            if (v < 0 || static_cast<size_t>(v) >= st.shards.size()) {
                Py_DECREF(seq);
                PyErr_SetString(PyExc_ValueError, "shard id out of range");
                return false;
            }
            ids.push_back(static_cast<int32_t>(v));
        }
        Py_DECREF(seq);
    }
    PyObject* old = s->store;
    s->store = store == Py_None ? nullptr : store;
    Py_XINCREF(s->store);
    Py_XDECREF(old);
    s->shards.swap(ids);
    s->rest_ok = rest_ok;
    s->hint = RestHint();
    return true;
}

// Session(prompt, budget, max_depth,
//         store, shards, rest_ok, max_match, min_match, max_occurrences, scale, power,
//         pld_max_ngram, pld_min_ngram (0: no prompt lookup),
//         learned, learned_drafts, tenant)
int Session_init(SessionObject* self, PyObject* args, PyObject*) {
    PyObject *prompt, *store, *shards, *learned;
    long long budget, max_depth, max_match, min_match, max_occ;
    int rest_ok, pld_max, pld_min, learned_drafts;
    double scale, power;
    const char* tenant;
    Py_ssize_t tlen;
    if (!PyArg_ParseTuple(args, "OLLOOpLLLddiiOpy#", &prompt, &budget, &max_depth, &store,
                          &shards, &rest_ok, &max_match, &min_match, &max_occ, &scale, &power,
                          &pld_max, &pld_min, &learned, &learned_drafts, &tenant, &tlen))
        return -1;
    SessionState* s = self->s;
    if (learned != Py_None && !PyObject_TypeCheck(learned, &LearnedType)) {
        PyErr_SetString(PyExc_TypeError, "learned must be a Learned or None");
        return -1;
    }
    if (!read_tokens(prompt, s->context, "prompt")) return -1;
    s->budget = budget;
    s->max_depth = max_depth;
    if (!set_store(s, store, shards, rest_ok != 0)) return -1;
    s->rest = {0, max_depth, max_match, min_match, max_occ};
    s->scale = scale;
    s->power = power;
    if (pld_max > 0) {
        s->pld.reset(new PromptIndex(pld_max, pld_min));
    }
    if (learned != Py_None) {
        Py_INCREF(learned);
        s->learned = learned;
        s->learned_drafts = learned_drafts != 0;
        s->writer.tenant.assign(tenant, tlen);
        size_t n = std::min<size_t>(PROMPT_TAIL, s->context.size());
        s->writer.head.assign(s->context.end() - n, s->context.end());
    }
    return 0;
}

// The accepted tokens into the context; learned now, or (learn_later: a batched step) kept
// in `unlearned` for learn_unlearned.
void session_extend(SessionState* s, const std::vector<uint32_t>& toks, bool learn_later = false) {
    s->context.insert(s->context.end(), toks.begin(), toks.end());
    if (s->learned == nullptr) return;
    if (learn_later)
        s->unlearned.insert(s->unlearned.end(), toks.begin(), toks.end());
    else
        s->writer.extend(learned_of(s->learned), toks.data(), toks.size());
}

void learn_unlearned(SessionState* s) {
    if (s->unlearned.empty()) return;
    s->writer.extend(learned_of(s->learned), s->unlearned.data(), s->unlearned.size());
    s->unlearned.clear();
}

// Whether the Reader behind a Store's weak reference was closed (or is gone).
bool reader_closed(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* reader = nullptr;
    if (PyWeakref_GetRef(ref, &reader) <= 0) {
        PyErr_Clear();
        return true;
    }
    PyObject* v = PyObject_GetAttrString(reader, "closed");
    Py_DECREF(reader);
#else
    PyObject* reader = PyWeakref_GetObject(ref);  // borrowed; None once the reader is gone
    if (reader == Py_None) return true;
    PyObject* v = PyObject_GetAttrString(reader, "closed");
#endif
    if (v == nullptr) {
        PyErr_Clear();
        return true;
    }
    int closed = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (closed < 0) PyErr_Clear();
    return closed != 0;
}

// SessionDrafter.propose, first part: the drafts from the session's own context (retrieval,
// prompt lookup). 0, or an error code (the tree is then empty, with no second part).
// `closed`: whether the session's Reader was closed, when known (-1: asked here, which
// needs the GIL; without it, every other step is plain C++ over the session's own state,
// the mapped arrays and the learned index under its shared lock).
int propose_own(SessionState* s, int64_t budget, Scratch& scratch, int closed = -1) {
    s->rest_match_len = s->pld_match_len = s->learned_match_len = 0;
    s->t_rest.clear();
    s->t_pld.clear();
    s->t_learned.clear();
    if (s->store != nullptr && !s->context.empty()) {
        auto* so = reinterpret_cast<StoreObject*>(s->store);
        const Store& st = so->store;
        int64_t n = std::min<int64_t>(s->rest.max_match, static_cast<int64_t>(s->context.size()));
        const uint32_t* tail = s->context.data() + s->context.size() - n;
        bool ok = s->rest_ok && budget >= 0;
        for (int64_t i = 0; ok && i < n; ++i) ok = tail[i] < st.vocab;
        if (!ok || (closed < 0 ? reader_closed(so->reader) : closed != 0)) {
            s->out.clear();
            return ERR_REST;
        }
        RestParams p = s->rest;
        p.budget = budget;
        if (!rest_propose(st, s->shards, tail, n, p, s->t_rest, scratch, s->hint,
                          s->context.size())) {
            s->hint.valid = false;
            s->out.clear();
            return ERR_REST;  // damaged arrays: the reference raises DatastoreCorrupt
        }
        s->rest_match_len = s->t_rest.match_len;
        if (!(s->scale == 1.0 && s->power == 1.0))
            for (auto& q : s->t_rest.probs)  // pow(1, y) is 1 exactly (most REST probs are 1)
                q = s->scale * (q == 1.0 ? 1.0 : scratch.pow.pow(q, s->power));
    }
    if (s->pld) {
        s->pld->extend(s->context);
        s->pld->propose(s->context, budget, s->max_depth, s->t_pld, scratch);
        s->pld_match_len = s->t_pld.match_len;
    }
    return 0;
}

// The second part: the learned outputs' draft (which must see every token learned before
// the step), and the merge.
void propose_learned(SessionState* s, int64_t budget, Scratch& scratch) {
    const Tree* drafts[3];
    int nd = 0;
    if (s->store != nullptr && !s->context.empty()) drafts[nd++] = &s->t_rest;
    if (s->pld) drafts[nd++] = &s->t_pld;
    if (s->learned != nullptr && s->learned_drafts) {
        Learned& index = learned_of(s->learned);
        {
            std::shared_lock<std::shared_mutex> lock(index.mu);
            index.propose(s->writer.tenant, s->context.data(),
                          static_cast<int64_t>(s->context.size()), budget, s->max_depth,
                          s->t_learned, scratch);
        }
        s->learned_match_len = s->t_learned.match_len;
        drafts[nd++] = &s->t_learned;
    }
    merge_trees(drafts, nd, budget, s->out, scratch);
    s->out.match_len = s->rest_match_len;
}

// SessionDrafter.propose: both parts. 0, or an error code.
int session_propose(SessionState* s, int64_t budget, Scratch& scratch) {
    int err = propose_own(s, budget, scratch);
    if (err == 0) propose_learned(s, budget, scratch);
    return err;
}

PyObject* Session_extend(SessionObject* self, PyObject* arg) {
    auto& toks = step_scratch().tokens_in;
    if (!read_tokens(arg, toks, "accepted")) return nullptr;
    session_extend(self->s, toks);
    Py_RETURN_NONE;
}

// propose(budget=None, as_lists=True) -> (tokens, parents, probs, sources), or an error
// code; the match lengths are then the session's attributes.
PyObject* Session_propose(SessionObject* self, PyObject* args) {
    PyObject* b = Py_None;
    int as_lists = 1;
    if (!PyArg_ParseTuple(args, "|Op", &b, &as_lists)) return nullptr;
    SessionState* s = self->s;
    long long budget = b == Py_None ? s->budget : PyLong_AsLongLong(b);
    if (budget == -1 && PyErr_Occurred()) return nullptr;
    int err = session_propose(s, budget, step_scratch());
    if (err) return PyLong_FromLong(err);
    return tree_to_python(s->out, as_lists != 0);
}

// step(accepted, budget=None, as_lists=True): extend, then propose, in one call.
PyObject* Session_step(SessionObject* self, PyObject* args) {
    PyObject *accepted, *b = Py_None;
    int as_lists = 1;
    if (!PyArg_ParseTuple(args, "O|Op", &accepted, &b, &as_lists)) return nullptr;
    SessionState* s = self->s;
    long long budget = b == Py_None ? s->budget : PyLong_AsLongLong(b);
    if (budget == -1 && PyErr_Occurred()) return nullptr;
    Scratch& scratch = step_scratch();
    if (!read_tokens(accepted, scratch.tokens_in, "accepted")) return nullptr;
    session_extend(s, scratch.tokens_in);
    int err = session_propose(s, budget, scratch);
    if (err) return PyLong_FromLong(err);
    return tree_to_python(s->out, as_lists != 0);
}

// use_store(store, shards, rest_ok): retrieval from another snapshot from the next step on
PyObject* Session_use_store(SessionObject* self, PyObject* args) {
    PyObject *store, *shards;
    int rest_ok;
    if (!PyArg_ParseTuple(args, "OOp", &store, &shards, &rest_ok)) return nullptr;
    if (!set_store(self->s, store, shards, rest_ok != 0)) return nullptr;
    Py_RETURN_NONE;
}

PyObject* Session_close(SessionObject* self, PyObject*) {
    SessionState* s = self->s;
    if (s->learned != nullptr) s->writer.close(learned_of(s->learned));
    Py_RETURN_NONE;
}

PyObject* Session_context(SessionObject* self, PyObject*) {
    const auto& c = self->s->context;
    PyObject* out = PyList_New(static_cast<Py_ssize_t>(c.size()));
    if (out == nullptr) return nullptr;
    for (size_t i = 0; i < c.size(); ++i) PyList_SET_ITEM(out, i, PyLong_FromUnsignedLong(c[i]));
    return out;
}

PyObject* Session_len(SessionObject* self, PyObject*) {
    return PyLong_FromSize_t(self->s->context.size());
}

PyObject* Session_get_rest(SessionObject* self, void*) {
    return PyLong_FromLongLong(self->s->rest_match_len);
}
PyObject* Session_get_pld(SessionObject* self, void*) {
    return PyLong_FromLongLong(self->s->pld_match_len);
}
PyObject* Session_get_learned(SessionObject* self, void*) {
    return PyLong_FromLongLong(self->s->learned_match_len);
}

PyTypeObject SessionType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- conversions ----------------------------------------------------------------------

// Token ids from a list/tuple of ints or a buffer of integers; each must fit in 32 bits.
bool read_tokens(PyObject* obj, std::vector<uint32_t>& out, const char* what) {
    out.clear();
    auto bad = [&](long long v) {
        PyErr_Format(PyExc_ValueError, "%s: token id %lld is outside [0, 2**32)", what, v);
        return false;
    };
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj) && !PyByteArray_Check(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return false;
        const char* f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') ++f;
        char c = *f;
        Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
        bool ok = true;
        out.resize(n);
        auto get = [&](auto* p) {
            for (Py_ssize_t i = 0; i < n && ok; ++i) {
                long long v = static_cast<long long>(p[i]);
                if (v < 0 || v > 0xFFFFFFFFLL) ok = bad(v);
                out[i] = static_cast<uint32_t>(v);
            }
        };
        if (f[1] != '\0') c = 0;
        switch (c) {
            case 'b': get(static_cast<const int8_t*>(view.buf)); break;
            case 'B': get(static_cast<const uint8_t*>(view.buf)); break;
            case 'h': get(static_cast<const int16_t*>(view.buf)); break;
            case 'H': get(static_cast<const uint16_t*>(view.buf)); break;
            case 'i': get(static_cast<const int32_t*>(view.buf)); break;
            case 'I': get(static_cast<const uint32_t*>(view.buf)); break;
            case 'l':
            case 'q':
                if (view.itemsize == 8)
                    get(static_cast<const int64_t*>(view.buf));
                else
                    get(static_cast<const int32_t*>(view.buf));
                break;
            case 'L':
            case 'Q':
                if (view.itemsize == 8) {
                    const uint64_t* p = static_cast<const uint64_t*>(view.buf);
                    for (Py_ssize_t i = 0; i < n && ok; ++i) {
                        if (p[i] > 0xFFFFFFFFULL)
                            ok = bad(static_cast<long long>(std::min<uint64_t>(p[i], INT64_MAX)));
                        out[i] = static_cast<uint32_t>(p[i]);
                    }
                } else {
                    get(static_cast<const uint32_t*>(view.buf));
                }
                break;
            default:
                PyErr_Format(PyExc_TypeError, "%s: token ids must be integers", what);
                ok = false;
        }
        PyBuffer_Release(&view);
        return ok;
    }
    PyObject* seq = PySequence_Fast(obj, "token ids must be a sequence of integers");
    if (seq == nullptr) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return false;
        }
        if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
            Py_DECREF(seq);
            return bad(overflow ? -1 : v);
        }
        out[i] = static_cast<uint32_t>(v);
    }
    Py_DECREF(seq);
    return true;
}

// A bytes object of n bytes at p (an empty vector's data() may be null).
PyObject* bytes_of(const void* p, size_t n) {
    return PyBytes_FromStringAndSize(n ? static_cast<const char*>(p) : "",
                                     static_cast<Py_ssize_t>(n));
}

// (tokens, parents, probs, sources) as lists (sources as labels), or as bytes of uint32,
// int32, float64 and uint8 (source bits) for numpy.frombuffer.
PyObject* tree_to_python(const Tree& t, bool as_lists) {
    Py_ssize_t n = static_cast<Py_ssize_t>(t.size());
    if (!as_lists) {
        return Py_BuildValue("(NNNN)", bytes_of(t.tokens.data(), n * 4),
                             bytes_of(t.parents.data(), n * 4), bytes_of(t.probs.data(), n * 8),
                             bytes_of(t.bits.data(), n));
    }
    PyObject* tokens = PyList_New(n);
    PyObject* parents = PyList_New(n);
    PyObject* probs = PyList_New(n);
    PyObject* sources = PyList_New(n);
    if (!tokens || !parents || !probs || !sources) {
        Py_XDECREF(tokens);
        Py_XDECREF(parents);
        Py_XDECREF(probs);
        Py_XDECREF(sources);
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyList_SET_ITEM(tokens, i, PyLong_FromUnsignedLong(t.tokens[i]));
        PyList_SET_ITEM(parents, i, PyLong_FromLong(t.parents[i]));
        PyList_SET_ITEM(probs, i, PyFloat_FromDouble(t.probs[i]));
        PyObject* label = g_labels[t.bits[i] & 7];
        Py_INCREF(label);
        PyList_SET_ITEM(sources, i, label);
    }
    return Py_BuildValue("(NNNN)", tokens, parents, probs, sources);
}

// ---- the batched step --------------------------------------------------------------------

// Tree.expected_accepted: the sum of the nodes' path probabilities, in node order.
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

// tree.best_chain: the root-to-leaf path of at most max_len nodes with the largest sum of
// path probabilities, in place of the tree (parents i - 1; the same operations in the same
// order as the reference, so that ties and sums come out alike).
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

// Threads kept for the batched step (each keeps its own working memory warm): run(n, job)
// calls job(0) here and job(1..n-1) on n - 1 of them, and returns when all are done.
class Workers {
  public:
    void run(int n, const std::function<void(int)>& job) {
        std::unique_lock<std::mutex> lock(mu_);
        while (static_cast<int>(threads_.size()) < n - 1) {
            int index = static_cast<int>(threads_.size()) + 1;
            std::thread t([this, index] { serve(index); });
            t.detach();  // they live as long as the process
            threads_.push_back(index);
        }
        job_ = &job;
        wanted_ = n - 1;
        pending_ = n - 1;
        ++generation_;
        wake_.notify_all();
        lock.unlock();
        job(0);
        lock.lock();
        done_.wait(lock, [this] { return pending_ == 0; });
        job_ = nullptr;
    }

  private:
    void serve(int index) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            wake_.wait(lock, [&] { return generation_ != seen; });
            seen = generation_;
            if (index > wanted_) continue;  // not needed this time
            const std::function<void(int)>* job = job_;
            lock.unlock();
            (*job)(index);
            lock.lock();
            if (--pending_ == 0) done_.notify_one();
        }
    }
    std::mutex mu_;
    std::condition_variable wake_, done_;
    std::vector<int> threads_;  // the indexes of the threads started
    const std::function<void(int)>* job_ = nullptr;
    int wanted_ = 0, pending_ = 0;
    uint64_t generation_ = 0;
};

// The batched step's threads, and the lock that lets one batch at a time use them. Neither
// is ever destroyed (the threads outlive main()). A forked child has none of its parent's
// threads, and may have inherited the lock held or the threads' condition variables waited
// on (a batch running in another thread): it starts afresh, the parent's objects left alone.
std::mutex* g_batch_lock = new std::mutex();
Workers* g_workers = nullptr;  // made by the first batch on more than one thread

void fresh_workers_after_fork() {
    g_batch_lock = new std::mutex();
    g_workers = nullptr;
}

Workers& workers() {  // the caller holds *g_batch_lock
    if (g_workers == nullptr) g_workers = new Workers();
    return *g_workers;
}

// ---- batched steps ----------------------------------------------------------------------
// A batch's sessions from a Python sequence of Session objects, each at most once (a
// session stepped twice in one batch would draft from a context its caller never saw).
bool batch_sessions(PyObject* ss, std::vector<SessionState*>& st) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ss);
    st.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* o = PySequence_Fast_ITEMS(ss)[i];
        if (!PyObject_TypeCheck(o, &SessionType)) {
            PyErr_SetString(PyExc_TypeError, "sessions must be Session objects");
            return false;
        }
        st[i] = reinterpret_cast<SessionObject*>(o)->s;
    }
    std::vector<SessionState*> sorted(st);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        PyErr_SetString(PyExc_ValueError, "a session appears twice in one batch");
        return false;
    }
    return true;
}

// Whether each session's Reader was closed: asked once per Store (the sessions of one
// snapshot share it), with the GIL, before the drafting lets it go.
std::vector<int32_t> closed_readers(const std::vector<SessionState*>& st) {
    std::vector<int32_t> closed(st.size(), 0);
    PyObject* last_store = nullptr;
    bool last_closed = false;
    for (size_t i = 0; i < st.size(); ++i) {
        PyObject* store = st[i]->store;
        if (store != nullptr && store != last_store) {
            last_store = store;
            last_closed = reader_closed(reinterpret_cast<StoreObject*>(store)->reader);
        }
        closed[i] = store != nullptr && last_closed;
    }
    return closed;
}

// The drafting of a batched step, once every session holds its accepted tokens (extended
// with learn_later): every session's tokens are learned, in order, and every session drafts
// with its budget, so that a session's tree is the same whatever the order or the threads.
// status[i] != 0: session i drafts nothing (an empty tree). Called with the GIL; drafts
// without it (on `threads` threads when > 1): the sessions must not be used elsewhere.
void draft_batch(const std::vector<SessionState*>& st, const std::vector<int64_t>& budget,
                 std::vector<int32_t>& status, int threads, long long chain, Scratch& scratch) {
    Py_ssize_t n = static_cast<Py_ssize_t>(st.size());
    std::vector<int32_t> closed = closed_readers(st);
    // A thread writes only to the sessions it drafts (and to `status` on a failure, which
    // is rare): threads drafting neighbours do not share cache lines.
    auto draft_own = [&](Py_ssize_t i, Scratch& sc) {
        int err = status[i];
        if (err == 0 && (err = propose_own(st[i], budget[i], sc, closed[i])) != 0)
            status[i] = err;
    };
    auto draft_finish = [&](Py_ssize_t i, Scratch& sc) {
        SessionState* s = st[i];
        if (status[i]) {
            s->out.clear();
            s->rest_match_len = s->pld_match_len = s->learned_match_len = 0;
        } else {
            propose_learned(s, budget[i], sc);
            if (chain > 0) best_chain(s->out, chain, sc);
        }
        s->expected = expected_accepted(s->out, sc);
        s->used = 0;
        for (uint8_t bit : s->out.bits) s->used |= bit;
    };
    int nt = static_cast<int>(std::max<Py_ssize_t>(1, std::min<Py_ssize_t>(threads, n)));
    // The drafting reads only the sessions, the mapped arrays and the learned index (under
    // its lock): other Python threads run meanwhile (a server's event loop, say).
    Py_BEGIN_ALLOW_THREADS
    if (nt == 1) {
        for (Py_ssize_t i = 0; i < n; ++i) learn_unlearned(st[i]);
        for (Py_ssize_t i = 0; i < n; ++i) {
            draft_own(i, scratch);
            draft_finish(i, scratch);
        }
    } else {
        std::lock_guard<std::mutex> lock(*g_batch_lock);
        // The first thread learns every session's tokens, in order, while the others
        // start drafting from the sessions' own contexts; the learned drafts wait until
        // it is done (a thread that drafted a session's first part before then keeps the
        // second for later). Sessions are handed out one at a time as threads come free:
        // a thread woken late or given long drafts does not hold the others back.
        std::atomic<bool> learned{false};
        std::atomic<Py_ssize_t> next{0};
        workers().run(nt, [&](int t) {
            Scratch& sc = step_scratch();
            if (t == 0) {
                for (Py_ssize_t i = 0; i < n; ++i) learn_unlearned(st[i]);
                learned.store(true, std::memory_order_release);
            }
            auto& later = sc.later;
            later.clear();
            for (Py_ssize_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
                draft_own(i, sc);
                if (learned.load(std::memory_order_acquire))
                    draft_finish(i, sc);
                else
                    later.push_back(i);
            }
            while (!later.empty() && !learned.load(std::memory_order_acquire))
                std::this_thread::yield();
            for (Py_ssize_t i : later) draft_finish(i, sc);
        });
    }
    Py_END_ALLOW_THREADS
}

// A drafted batch as bytes: (status, counts, tokens, parents, probs, bits, match_lens,
// expected, used), and with `flat` probs as float32 (what the wire carries; float64
// otherwise) and each session's context length (uint64) after them.
PyObject* batch_result(const std::vector<SessionState*>& st, const std::vector<int32_t>& status,
                       Scratch& scratch, bool flat) {
    size_t n = st.size();
    std::vector<int32_t> counts(n, 0);
    std::vector<int64_t> mls(3 * n, 0);
    std::vector<double> expected(n, 0.0);
    std::vector<uint8_t> used(n, 0);
    std::vector<uint64_t> lens(n, 0);
    auto& b = scratch.batch;  // the trees, concatenated
    b.clear();
    for (size_t i = 0; i < n; ++i) {
        const Tree& t = st[i]->out;
        counts[i] = static_cast<int32_t>(t.size());
        b.tokens.insert(b.tokens.end(), t.tokens.begin(), t.tokens.end());
        b.parents.insert(b.parents.end(), t.parents.begin(), t.parents.end());
        b.probs.insert(b.probs.end(), t.probs.begin(), t.probs.end());
        b.bits.insert(b.bits.end(), t.bits.begin(), t.bits.end());
        mls[3 * i] = st[i]->rest_match_len;
        mls[3 * i + 1] = st[i]->pld_match_len;
        mls[3 * i + 2] = st[i]->learned_match_len;
        expected[i] = st[i]->expected;
        used[i] = st[i]->used;
        lens[i] = st[i]->context.size();
    }
    size_t m = b.size();
    std::vector<float> p32(flat ? m : 0);
    std::copy_n(b.probs.begin(), p32.size(), p32.begin());
    PyObject* items[] = {
        bytes_of(status.data(), n * 4), bytes_of(counts.data(), n * 4),
        bytes_of(b.tokens.data(), m * 4), bytes_of(b.parents.data(), m * 4),
        flat ? bytes_of(p32.data(), m * 4) : bytes_of(b.probs.data(), m * 8),
        bytes_of(b.bits.data(), m), bytes_of(mls.data(), 3 * n * 8),
        bytes_of(expected.data(), n * 8), bytes_of(used.data(), n),
        flat ? bytes_of(lens.data(), n * 8) : nullptr};
    Py_ssize_t k = flat ? 10 : 9;
    PyObject* out = PyTuple_New(k);
    for (Py_ssize_t i = 0; i < k; ++i) {
        if (out != nullptr && items[i] != nullptr) {
            PyTuple_SET_ITEM(out, i, items[i]);
        } else {
            Py_XDECREF(items[i]);
            Py_CLEAR(out);
        }
    }
    return out;
}

// step_batch(sessions, accepted, budgets, threads=1, chain=0) -> (status, counts, tokens,
// parents, probs, bits, match_lens, expected, used), all as bytes. Every session is first
// extended by its accepted tokens (None: none), then the batch drafts (draft_batch) with
// each session's budget (None, or budgets None: the session's own). The trees come
// concatenated, counts[i] nodes each; status[i] != 0: session i failed and drafted nothing;
// match_lens holds (rest, pld, learned) per session; chain > 0: each tree's best chain.
PyObject* step_batch(PyObject*, PyObject* args) {
    PyObject *sessions, *accepted, *budgets;
    int threads = 1;
    long long chain = 0;
    if (!PyArg_ParseTuple(args, "OOO|iL", &sessions, &accepted, &budgets, &threads, &chain))
        return nullptr;
    PyObject* ss = PySequence_Fast(sessions, "sessions must be a sequence");
    if (ss == nullptr) return nullptr;
    PyObject* as = PySequence_Fast(accepted, "accepted must be a sequence");
    if (as == nullptr) {
        Py_DECREF(ss);
        return nullptr;
    }
    PyObject* bs = nullptr;  // None: every session's own budget
    if (budgets != Py_None && (bs = PySequence_Fast(budgets, "budgets must be a sequence")) ==
                                  nullptr) {
        Py_DECREF(ss);
        Py_DECREF(as);
        return nullptr;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ss);
    PyObject* result = nullptr;
    std::vector<SessionState*> st;
    std::vector<int64_t> budget(n);
    std::vector<int32_t> status(n, 0);
    bool ok = true;
    if (PySequence_Fast_GET_SIZE(as) != n || (bs && PySequence_Fast_GET_SIZE(bs) != n)) {
        PyErr_SetString(PyExc_ValueError, "sessions, accepted and budgets differ in length");
        ok = false;
    }
    ok = ok && batch_sessions(ss, st);
    for (Py_ssize_t i = 0; i < n && ok; ++i) {
        PyObject* b = bs ? PySequence_Fast_ITEMS(bs)[i] : Py_None;
        budget[i] = b == Py_None ? st[i]->budget : PyLong_AsLongLong(b);
        if (budget[i] == -1 && PyErr_Occurred()) ok = false;
    }
    if (ok) {
        Scratch& scratch = step_scratch();
        for (Py_ssize_t i = 0; i < n; ++i) {  // a session's refused tokens fail only it
            PyObject* a = PySequence_Fast_ITEMS(as)[i];
            if (a == Py_None) continue;
            if (read_tokens(a, scratch.tokens_in, "accepted")) {
                session_extend(st[i], scratch.tokens_in, true);
            } else {  // the wrapper says why
                PyErr_Clear();
                status[i] = ERR_TOKENS;
            }
        }
        draft_batch(st, budget, status, threads, chain, scratch);
        result = batch_result(st, status, scratch, false);
    }
    Py_DECREF(ss);
    Py_DECREF(as);
    Py_XDECREF(bs);
    return result;
}

// A read-only contiguous buffer of `n` elements of `size` bytes (a bytes object, a numpy
// array, ...), or an error naming `what`. Releases itself.
struct FlatView {
    Py_buffer view{};
    bool held = false;
    bool get(PyObject* obj, size_t size, Py_ssize_t n, const char* what) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return false;
        held = true;
        if (view.len != static_cast<Py_ssize_t>(size) * n) {
            PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not %zd", what, view.len,
                         static_cast<Py_ssize_t>(size) * n);
            return false;
        }
        return true;
    }
    ~FlatView() {
        if (held) PyBuffer_Release(&view);
    }
};

// step_flat(sessions, accepted, counts, budgets, threads=1, chain=0) -> step_batch's arrays
// with probs as float32 (what the wire carries) and then each session's context length
// (uint64, after the step), all as bytes: step_batch's step over flat arrays, for the
// service's packed steps (no Python object per sequence's tokens). `accepted`: uint32
// tokens of every session concatenated, counts[i] (uint32) of them session i's; `budgets`:
// uint32 per session (0: the session's own) or None. Token ids are not checked against a
// vocabulary here (the caller did).
PyObject* step_flat(PyObject*, PyObject* args) {
    PyObject *sessions, *accepted, *counts_in, *budgets;
    int threads = 1;
    long long chain = 0;
    if (!PyArg_ParseTuple(args, "OOOO|iL", &sessions, &accepted, &counts_in, &budgets, &threads,
                          &chain))
        return nullptr;
    PyObject* ss = PySequence_Fast(sessions, "sessions must be a sequence");
    if (ss == nullptr) return nullptr;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ss);
    FlatView cv, bv, av;
    bool ok = cv.get(counts_in, 4, n, "counts") &&
              (budgets == Py_None || bv.get(budgets, 4, n, "budgets"));
    const uint32_t* cnt = ok ? static_cast<const uint32_t*>(cv.view.buf) : nullptr;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; ok && i < n; ++i) total += cnt[i];
    ok = ok && av.get(accepted, 4, total, "accepted");
    std::vector<SessionState*> st;
    ok = ok && batch_sessions(ss, st);
    PyObject* result = nullptr;
    if (ok) {
        std::vector<int64_t> budget(n);
        for (Py_ssize_t i = 0; i < n; ++i) {
            uint32_t b = budgets == Py_None ? 0 : static_cast<const uint32_t*>(bv.view.buf)[i];
            budget[i] = b ? static_cast<int64_t>(b) : st[i]->budget;
        }
        // Extending only appends (learning and indexing wait for draft_batch, without the
        // GIL): a long step costs a copy here.
        Scratch& scratch = step_scratch();
        const uint32_t* tok = static_cast<const uint32_t*>(av.view.buf);
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (cnt[i] == 0) continue;
            scratch.tokens_in.assign(tok, tok + cnt[i]);
            tok += cnt[i];
            session_extend(st[i], scratch.tokens_in, true);
        }
        std::vector<int32_t> status(n, 0);
        draft_batch(st, budget, status, threads, chain, scratch);
        result = batch_result(st, status, scratch, true);
    }
    Py_DECREF(ss);
    return result;
}

// set_labels([label of bits 0..7]): the source strings trees carry as lists
PyObject* set_labels(PyObject*, PyObject* arg) {
    PyObject* seq = PySequence_Fast(arg, "labels must be a sequence of 8 strings");
    if (seq == nullptr) return nullptr;
    if (PySequence_Fast_GET_SIZE(seq) != 8) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "labels must be a sequence of 8 strings");
        return nullptr;
    }
    for (int i = 0; i < 8; ++i) {
        PyObject* s = PySequence_Fast_ITEMS(seq)[i];
        Py_INCREF(s);
        Py_XSETREF(g_labels[i], s);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

// ---- type and module tables ------------------------------------------------------------
PyMethodDef Learned_methods[] = {
    {"propose", reinterpret_cast<PyCFunction>(Learned_propose), METH_VARARGS,
     "propose(tenant, context, budget, max_depth, as_lists=True) -> (tree, match_len)"},
    {"load", reinterpret_cast<PyCFunction>(Learned_load), METH_O, "load([(tenant, tokens)])"},
    {"stats", reinterpret_cast<PyCFunction>(Learned_stats), METH_NOARGS, "stats() -> dict"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef Learned_getset[] = {
    {"n_tokens", reinterpret_cast<getter>(Learned_get_n_tokens), nullptr, "tokens held", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef Writer_methods[] = {
    {"extend", reinterpret_cast<PyCFunction>(Writer_extend), METH_O, "extend(tokens)"},
    {"close", reinterpret_cast<PyCFunction>(Writer_close), METH_NOARGS, "close()"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef Session_methods[] = {
    {"extend", reinterpret_cast<PyCFunction>(Session_extend), METH_O, "extend(accepted)"},
    {"propose", reinterpret_cast<PyCFunction>(Session_propose), METH_VARARGS,
     "propose(budget=None, as_lists=True) -> tree, or an error code"},
    {"step", reinterpret_cast<PyCFunction>(Session_step), METH_VARARGS,
     "step(accepted, budget=None, as_lists=True): extend, then propose"},
    {"close", reinterpret_cast<PyCFunction>(Session_close), METH_NOARGS, "close()"},
    {"use_store", reinterpret_cast<PyCFunction>(Session_use_store), METH_VARARGS,
     "use_store(store, shards, rest_ok)"},
    {"context", reinterpret_cast<PyCFunction>(Session_context), METH_NOARGS, "context()"},
    {"context_len", reinterpret_cast<PyCFunction>(Session_len), METH_NOARGS, "context_len()"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef Session_getset[] = {
    {"rest_match_len", reinterpret_cast<getter>(Session_get_rest), nullptr,
     "the last step's retrieval match length", nullptr},
    {"pld_match_len", reinterpret_cast<getter>(Session_get_pld), nullptr,
     "the last step's prompt-lookup match length", nullptr},
    {"learned_match_len", reinterpret_cast<getter>(Session_get_learned), nullptr,
     "the last step's learned-output match length", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef module_methods[] = {
    {"step_batch", step_batch, METH_VARARGS,
     "step_batch(sessions, accepted, budgets, threads=1) -> (status, counts, tokens, parents, "
     "probs, bits, match_lens) as bytes"},
    {"step_flat", step_flat, METH_VARARGS,
     "step_flat(sessions, accepted, counts, budgets, threads=1, chain=0) -> (status, counts, "
     "tokens, parents, probs, bits, match_lens, expected, used, context_lens) as bytes"},
    {"set_labels", set_labels, METH_O, "set_labels(labels)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_core",
                          "The compiled drafting core (see redraft.datastore.drafting.native).",
                          -1, module_methods};

bool ready(PyTypeObject& t, const char* name, size_t size, newfunc tp_new, initproc init,
           destructor dealloc, PyMethodDef* methods, PyGetSetDef* getset, const char* doc) {
    t.tp_name = name;
    t.tp_basicsize = static_cast<Py_ssize_t>(size);
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_new = tp_new;
    t.tp_init = init;
    t.tp_dealloc = dealloc;
    t.tp_methods = methods;
    t.tp_getset = getset;
    t.tp_doc = doc;
    return PyType_Ready(&t) == 0;
}

}  // namespace

PyMODINIT_FUNC PyInit__core(void) {
    static bool fork_handler = false;  // once per process, however often the module loads
    if (!fork_handler) {
        if (pthread_atfork(nullptr, nullptr, fresh_workers_after_fork) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "cannot register the fork handler");
            return nullptr;
        }
        fork_handler = true;
    }
    StoreType.tp_weaklistoffset = offsetof(StoreObject, weakrefs);
    if (!ready(StoreType, "redraft.datastore.drafting.native._core.Store", sizeof(StoreObject),
               Store_new, reinterpret_cast<initproc>(Store_init),
               reinterpret_cast<destructor>(Store_dealloc), nullptr, nullptr,
               "A datastore's mapped shard arrays") ||
        !ready(LearnedType, "redraft.datastore.drafting.native._core.Learned",
               sizeof(LearnedObject), Learned_new, reinterpret_cast<initproc>(Learned_init),
               reinterpret_cast<destructor>(Learned_dealloc), Learned_methods, Learned_getset,
               "Learned outputs, per tenant, bounded") ||
        !ready(WriterType, "redraft.datastore.drafting.native._core.Writer",
               sizeof(WriterObject), Writer_new, reinterpret_cast<initproc>(Writer_init),
               reinterpret_cast<destructor>(Writer_dealloc), Writer_methods, nullptr,
               "One generation's learned document") ||
        !ready(SessionType, "redraft.datastore.drafting.native._core.Session",
               sizeof(SessionObject), Session_new, reinterpret_cast<initproc>(Session_init),
               reinterpret_cast<destructor>(Session_dealloc), Session_methods, Session_getset,
               "One generation's drafting state"))
        return nullptr;
    // draft.source_label of each set of source bits (the wrapper sets them again from it)
    const char* labels[8] = {"unknown",      "rest",         "pld",         "pld+rest",
                             "learned",      "learned+rest", "learned+pld", "learned+pld+rest"};
    for (int i = 0; i < 8; ++i)
        if (g_labels[i] == nullptr && (g_labels[i] = PyUnicode_InternFromString(labels[i])) ==
                                          nullptr)
            return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    PyTypeObject* types[] = {&StoreType, &LearnedType, &WriterType, &SessionType};
    const char* names[] = {"Store", "Learned", "Writer", "Session"};
    for (int i = 0; i < 4; ++i) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], reinterpret_cast<PyObject*>(types[i])) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return nullptr;
        }
    }
    return m;
}
