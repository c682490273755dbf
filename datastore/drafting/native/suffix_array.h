// A datastore's shards as the core reads them (the mapped token and suffix arrays, and prefix
// tables built from them) and the suffix-array searches over them: the same answers as the
// Reader's bisections, with fewer and overlapping cache misses.
// Python: redraft.datastore.reader._Shard
//
// Part of the compiled drafting core: included by _core.cpp only, so that the core stays one
// translation unit (everything in the anonymous namespace, inlined as it was in one file).

#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {

inline uint32_t load_le32(const uint32_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

// The suffix-array range [lo, hi) of a pattern in one shard.
struct Range {
    int32_t shard;
    int64_t lo, hi;
};

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
    // (first SA index >= key, end of key's first-token bucket, found)
    // Python: redraft.datastore.reader._Shard.lower
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
    // The first SA index in [lo, hi) past every suffix starting with key.
    // Python: redraft.datastore.reader._Shard.upper
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

// The SA range of key in each selected shard where it occurs.
// Python: redraft.datastore.reader.Reader._ranges
void ranges_of(const Store& st, const std::vector<int32_t>& sel, const uint8_t* key, size_t nb,
               uint32_t t0, std::vector<Range>& out) {
    out.clear();
    for (int32_t s : sel) {
        const Shard& sh = st.shards[s];
        int64_t i, hi;
        if (st.lower(sh, key, nb, t0, i, hi)) out.push_back({s, i, st.upper(sh, key, nb, i, hi)});
    }
}

// Whether a shard's first-token bucket table (vocab + 2 entries) is ascending and within its
// length: checked once when a Store is made, so that a damaged table cannot send a lookup
// outside the arrays.
bool buckets_fit(const uint32_t* bk, uint64_t vocab, int64_t length) {
    for (uint64_t t = 0; t <= vocab; ++t)
        if (load_le32(bk + t) > load_le32(bk + t + 1) ||
            load_le32(bk + t + 1) > static_cast<uint64_t>(length))
            return false;
    return true;
}

}  // namespace
