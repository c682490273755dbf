// The learned outputs: earlier generations' accepted tokens per tenant's pool, bounded (the
// oldest documents evicted first), indexed by their 2- and 4-grams for drafting.
// Python: redraft.datastore.drafting.learned_index
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
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// The reference's bounds and the layout of an index entry (document id, position).
// Python: redraft.datastore.drafting.learned_index.KEEP
constexpr int64_t PROMPT_TAIL = 16, KEEP = 16, MAX_MATCH = 32, MAX_OCCURRENCES = 8;
constexpr int POS_BITS = 24;
constexpr uint64_t POS_MASK = (1ULL << POS_BITS) - 1;
constexpr int64_t MAX_DOC_TOKENS = static_cast<int64_t>(POS_MASK);

using Key128 = unsigned __int128;  // the reference's key packs 4 ids of up to 32 bits: 95 bits

struct Key128Hash {
    size_t operator()(Key128 k) const {
        uint64_t x = static_cast<uint64_t>(k) ^ (static_cast<uint64_t>(k >> 64) * 0x9E3779B97F4A7C15ULL);
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        return static_cast<size_t>(x);
    }
};

// The n-gram (n = 2 or 4) ending at `end` as one key.
// Python: redraft.datastore.drafting.learned_index._key
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

// Python: redraft.datastore.drafting.learned_index.LearnedIndex
class Learned {
  public:
    Learned(int64_t max_tokens, bool shared) : max_tokens(max_tokens), shared(shared) {}

    int64_t max_tokens;
    bool shared;
    int64_t n_tokens = 0;
    std::shared_mutex mu;  // shared while drafting, exclusive while writing

    // The new document's pool: the tenant's (every tenant's when shared), made anew
    // when it has none (its slot reused from a dropped pool).
    // Python: redraft.datastore.drafting.learned_index.LearnedIndex._new_doc
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

    // Python: redraft.datastore.drafting.learned_index.LearnedIndex._new_doc
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
    // Python: redraft.datastore.drafting.learned_index.LearnedIndex._append
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
    // Python: redraft.datastore.drafting.learned_index.LearnedIndex._evict
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
    // Python: redraft.datastore.drafting.learned_index.LearnedIndex._drop
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

    // A tree continuing the context from the tenant's pool (the caller holds `mu`).
    // Python: redraft.datastore.drafting.learned_index.LearnedIndex.propose
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
        continuation_tree(conts, budget, g_sources.learned, out, s);
    }

    // How many of the context's last tokens end at `end`: `level` doubled while whole slices still
    // agree.
    // Python: redraft.datastore.drafting.learned_index._match_len
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

// One generation's document, created by its first accepted token.
// Python: redraft.datastore.drafting.learned_index.LearnedWriter
struct Writer {
    std::string tenant;
    std::vector<uint32_t> head;
    std::shared_ptr<LDoc> doc;

    // Python: redraft.datastore.drafting.learned_index.LearnedWriter.extend
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

}  // namespace
