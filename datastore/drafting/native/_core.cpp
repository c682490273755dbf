// The compiled drafting core: one session step (new tokens in, merged tree out) in one call,
// and many sessions' steps in one call. This file is its CPython glue only (the types, the
// argument and result conversions, the GIL); the drafting is in the headers, one per concept:
//
//   sources.h        the source bits (given by the Python side at import)
//   arrays.h         working arrays whose resize leaves new elements unset
//   tree.h           a tree as flat arrays, rank keys (best first), the merge's heap
//   suffix_array.h   a datastore's mapped shards, prefix tables, suffix-array searches
//   scratch.h        each thread's working memory, reused across steps
//   tree_ops.h       best-first cut, merge of drafts, expected accepted tokens, best chain
//   continuation.h   the trie of copied continuations (prompt lookup, learned outputs)
//   prompt_lookup.h  a session's incremental n-gram index of its own context
//   learned.h        the learned outputs: per-tenant pools, bounded, indexed by n-grams
//   retrieval.h      the REST tree: longest match, sampled continuations, their trie
//   session.h        one generation's state and step
//   batch.h          many sessions' steps on threads kept for them
//   tally.h          what the service's metrics count of a batched step
//
// Why C++ and the plain CPython API: the Python drafters (the reference, which stays) spend
// most of a step creating per-node objects; here a step runs over the datastore's mapped
// arrays and flat buffers only, and the extension builds from nothing with the compiler that
// builds CPython itself (no build-time package but setuptools).
//
// Every function mirrors one of the Python reference's, cited in its comment by a line that
// starts with "Python:" and gives the full dotted name (a test imports every name so cited),
// with the same operation order wherever a float is computed, so that trees are identical
// bit for bit.
// Where the reference sorts every node, the core often gets the same order more cheaply
// (a heap over a tree's frontier, a counting sort, merged chains); each such place says
// why the order is the same. Python objects are created only for what a call returns.
// Tested by: tests/datastore/drafting/native/test_native_session.py,
// tests/datastore/drafting/native/test_native_batch.py,
// tests/datastore/drafting/native/test_native_learned.py,
// tests/datastore/drafting/native/test_native_sources.py,
// tests/datastore/drafting/native/test_native_tally.py,
// tests/datastore/drafting/native/test_core_citations.py
// Python: redraft.datastore.drafting.native.native_session.NativeSessionDrafter

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "batch.h"
#include "learned.h"
#include "scratch.h"
#include "session.h"
#include "sources.h"
#include "suffix_array.h"
#include "tally.h"
#include "tree.h"
#include "tree_ops.h"

#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

PyObject* g_labels[256] = {nullptr};  // the label of each set of source bits ("pld+rest" for 3)

bool read_tokens(PyObject* obj, std::vector<uint32_t>& out, const char* what);

// Whether set_sources was called (a RuntimeError if not): no Session or Learned index is made
// before the source bits they draft with are known.
bool sources_set() {
    if (g_sources.set) return true;
    PyErr_SetString(PyExc_RuntimeError, "the core's source bits are not set (importing "
                                        "redraft.datastore.drafting.native sets them)");
    return false;
}

// ---- Store --------------------------------------------------------------------------
// Python: redraft.datastore.drafting.native.mapped_store.store_of
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
        if (!buckets_fit(static_cast<const uint32_t*>(b[2].buf), vocab, length)) {
            PyErr_Format(PyExc_ValueError, "shard %zd: damaged first-token buckets", i);
            return -1;
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
// Python: redraft.datastore.drafting.learned_index.LearnedIndex
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
    if (!sources_set()) return -1;
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

// ---- Writer -----------------------------------------------------------------------------
// Python: redraft.datastore.drafting.learned_index.LearnedWriter
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

// ---- Session ----------------------------------------------------------------------------
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter
struct SessionObject {
    PyObject_HEAD
    SessionState* s;
    PyObject* store;    // the StoreObject of s->store, or null
    PyObject* learned;  // the LearnedObject of s->learned, or null
};

PyObject* Session_new(PyTypeObject* type, PyObject*, PyObject*) {
    SessionObject* self = reinterpret_cast<SessionObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) {
        self->s = new SessionState();
        self->store = nullptr;
        self->learned = nullptr;
    }
    return reinterpret_cast<PyObject*>(self);
}

void Session_dealloc(SessionObject* self) {
    delete self->s;
    Py_XDECREF(self->store);
    Py_XDECREF(self->learned);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// The session's retrieval: `store`'s shards `shards` (store None: no retrieval). A new
// snapshot's shards are not the old one's: what the last search found is forgotten.
// Python: redraft.datastore.drafting.session_drafter.SessionDrafter.use_reader
bool set_store(SessionObject* self, PyObject* store, PyObject* shards, bool rest_ok) {
    SessionState* s = self->s;
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
    PyObject* old = self->store;
    self->store = store == Py_None ? nullptr : store;
    Py_XINCREF(self->store);
    Py_XDECREF(old);
    s->store = self->store ? &reinterpret_cast<StoreObject*>(self->store)->store : nullptr;
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
    if (!sources_set()) return -1;
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
    if (!set_store(self, store, shards, rest_ok != 0)) return -1;
    s->rest = {0, max_depth, max_match, min_match, max_occ};
    s->scale = scale;
    s->power = power;
    if (pld_max > 0) {
        s->pld.reset(new PromptIndex(pld_max, pld_min));
    }
    if (learned != Py_None) {
        Py_INCREF(learned);
        Py_XSETREF(self->learned, learned);
        s->learned = &learned_of(learned);
        s->learned_drafts = learned_drafts != 0;
        s->writer.tenant.assign(tenant, tlen);
        size_t n = std::min<size_t>(PROMPT_TAIL, s->context.size());
        s->writer.head.assign(s->context.end() - n, s->context.end());
    }
    return 0;
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

// Whether the session's Reader was closed, asked only where its step would read the Store
// (which needs the GIL: the drafting itself is plain C++).
bool session_closed(SessionObject* self) {
    const SessionState* s = self->s;
    return s->store != nullptr && !s->context.empty() &&
           reader_closed(reinterpret_cast<StoreObject*>(self->store)->reader);
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
    int err = session_propose(s, budget, step_scratch(), session_closed(self));
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
    int err = session_propose(s, budget, scratch, session_closed(self));
    if (err) return PyLong_FromLong(err);
    return tree_to_python(s->out, as_lists != 0);
}

// use_store(store, shards, rest_ok): retrieval from another snapshot from the next step on
PyObject* Session_use_store(SessionObject* self, PyObject* args) {
    PyObject *store, *shards;
    int rest_ok;
    if (!PyArg_ParseTuple(args, "OOp", &store, &shards, &rest_ok)) return nullptr;
    if (!set_store(self, store, shards, rest_ok != 0)) return nullptr;
    Py_RETURN_NONE;
}

PyObject* Session_close(SessionObject* self, PyObject*) {
    SessionState* s = self->s;
    if (s->learned != nullptr) s->writer.close(*s->learned);
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
        PyObject* label = g_labels[t.bits[i]];
        Py_INCREF(label);
        PyList_SET_ITEM(sources, i, label);
    }
    return Py_BuildValue("(NNNN)", tokens, parents, probs, sources);
}

// ---- batched steps ----------------------------------------------------------------------
// A batch's sessions from a Python sequence of Session objects, each at most once (a
// session stepped twice in one batch would draft from a context its caller never saw).
bool batch_sessions(PyObject* ss, std::vector<SessionObject*>& obj,
                    std::vector<SessionState*>& st) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ss);
    obj.resize(n);
    st.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* o = PySequence_Fast_ITEMS(ss)[i];
        if (!PyObject_TypeCheck(o, &SessionType)) {
            PyErr_SetString(PyExc_TypeError, "sessions must be Session objects");
            return false;
        }
        obj[i] = reinterpret_cast<SessionObject*>(o);
        st[i] = obj[i]->s;
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
std::vector<int32_t> closed_readers(const std::vector<SessionObject*>& st) {
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

// The drafting of a batched step (batch.h's draft_sessions), without the GIL: it reads only
// the sessions, the mapped arrays and the learned index (under its lock), so other Python
// threads run meanwhile (a server's event loop, say).
void draft_batch(const std::vector<SessionObject*>& obj, const std::vector<SessionState*>& st,
                 const std::vector<int64_t>& budget, std::vector<int32_t>& status, int threads,
                 long long chain, Scratch& scratch) {
    std::vector<int32_t> closed = closed_readers(obj);
    Py_BEGIN_ALLOW_THREADS
    draft_sessions(st, budget, status, closed, threads, chain, scratch);
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
    std::vector<SessionObject*> obj;
    std::vector<SessionState*> st;
    std::vector<int64_t> budget(n);
    std::vector<int32_t> status(n, 0);
    bool ok = true;
    if (PySequence_Fast_GET_SIZE(as) != n || (bs && PySequence_Fast_GET_SIZE(bs) != n)) {
        PyErr_SetString(PyExc_ValueError, "sessions, accepted and budgets differ in length");
        ok = false;
    }
    ok = ok && batch_sessions(ss, obj, st);
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
        draft_batch(obj, st, budget, status, threads, chain, scratch);
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
    std::vector<SessionObject*> obj;
    std::vector<SessionState*> st;
    ok = ok && batch_sessions(ss, obj, st);
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
        draft_batch(obj, st, budget, status, threads, chain, scratch);
        result = batch_result(st, status, scratch, true);
    }
    Py_DECREF(ss);
    return result;
}

// set_sources(rest, pld, learned, labels): the bit of each source, distinct single bits, and
// the label of every set of bits (256 strings), which trees carry as lists.
// Python: redraft.proto.tree.SOURCE_BITS
// Python: redraft.proto.tree.source_label
PyObject* set_sources(PyObject*, PyObject* args) {
    int rest, pld, learned;
    PyObject* labels;
    if (!PyArg_ParseTuple(args, "iiiO", &rest, &pld, &learned, &labels)) return nullptr;
    auto one_bit = [](int b) { return b > 0 && b < 256 && (b & (b - 1)) == 0; };
    if (!one_bit(rest) || !one_bit(pld) || !one_bit(learned) || rest == pld || rest == learned ||
        pld == learned) {
        PyErr_Format(PyExc_ValueError, "source bits must be distinct single bits below 256, got "
                     "%d, %d, %d", rest, pld, learned);
        return nullptr;
    }
    PyObject* seq = PySequence_Fast(labels, "labels must be a sequence of 256 strings");
    if (seq == nullptr) return nullptr;
    if (PySequence_Fast_GET_SIZE(seq) != 256) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "labels must be a sequence of 256 strings");
        return nullptr;
    }
    for (int i = 0; i < 256; ++i) {
        if (!PyUnicode_Check(PySequence_Fast_ITEMS(seq)[i])) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_TypeError, "labels must be a sequence of 256 strings");
            return nullptr;
        }
    }
    for (int i = 0; i < 256; ++i) {
        PyObject* s = PySequence_Fast_ITEMS(seq)[i];
        Py_INCREF(s);
        Py_XSETREF(g_labels[i], s);
    }
    Py_DECREF(seq);
    g_sources.rest = static_cast<uint8_t>(rest);
    g_sources.pld = static_cast<uint8_t>(pld);
    g_sources.learned = static_cast<uint8_t>(learned);
    g_sources.set = true;
    Py_RETURN_NONE;
}

// A contiguous buffer of whole elements of `size` bytes (a bytes object, a numpy array, ...),
// or an error naming `what`. Releases itself.
struct CountedView {
    Py_buffer view{};
    bool held = false;
    Py_ssize_t n = 0;
    bool get(PyObject* obj, Py_ssize_t size, const char* what, bool writable = false) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) <
            0)
            return false;
        held = true;
        n = view.len / size;
        if (view.len % size) {
            PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not whole %zd-byte elements",
                         what, view.len, size);
            return false;
        }
        return true;
    }
    template <class T> const T* of() const { return static_cast<const T*>(view.buf); }
    ~CountedView() {
        if (held) PyBuffer_Release(&view);
    }
};

// A call's trees as count_batch is given them: (offsets, tokens, parents, bits).
struct TreesView {
    PyObject* obj = nullptr;
    CountedView offsets, tokens, parents, bits;
    ~TreesView() { Py_XDECREF(obj); }
    bool get(PyObject* trees) {
        Py_INCREF(trees);
        obj = trees;
        if (!PyTuple_Check(trees) || PyTuple_GET_SIZE(trees) != 4) {
            PyErr_SetString(PyExc_TypeError, "trees must be (offsets, tokens, parents, bits)");
            return false;
        }
        if (!offsets.get(PyTuple_GET_ITEM(trees, 0), 8, "offsets") ||
            !tokens.get(PyTuple_GET_ITEM(trees, 1), 4, "tokens") ||
            !parents.get(PyTuple_GET_ITEM(trees, 2), 4, "parents") ||
            !bits.get(PyTuple_GET_ITEM(trees, 3), 1, "bits"))
            return false;
        if (parents.n < tokens.n || bits.n < tokens.n) {
            PyErr_SetString(PyExc_ValueError, "trees: fewer parents or bits than tokens");
            return false;
        }
        return true;
    }
    // Row `row`'s nodes [a, b), or false (an error set) if it has none such.
    bool row(long long r, int64_t& a, int64_t& b) const {
        const int64_t* o = offsets.of<int64_t>();
        if (r < 0 || r + 1 >= offsets.n || o[r] < 0 || o[r] > o[r + 1] || o[r + 1] > tokens.n) {
            PyErr_Format(PyExc_ValueError, "trees: no row %lld", r);
            return false;
        }
        a = o[r];
        b = o[r + 1];
        return true;
    }
};

// count_batch(tallies, trees, accepted, counts, into, n_keys, n_bits): what the service's
// metrics count of a batched step (tally.h), added to `into` (float64, writable: [drafts:
// n_keys][draft tokens: n_keys x n_bits][accepted: n_keys x n_bits][by depth]). Sequence i's
// tally is a list [counter, last, row]: it counts under its counter (< n_keys); its tree now
// is row i of `trees` = (offsets, tokens, parents, bits) (int64, uint32, int32, uint8); `last`
// is None or the trees of its call before, down whose row `row` its counts[i] (uint32) tokens
// of `accepted` (uint32) walk; then its last is `trees` and its row i. A list each, read and
// set here: attributes, or a loop in the interpreter over an engine's sequences, were most of
// what a call's counting cost. Everything is checked before anything is counted.
// Python: redraft.datastore.service.metrics.count_batch
PyObject* count_batch(PyObject*, PyObject* args) {
    PyObject *tallies, *now_trees, *accepted, *counts_in, *into_in;
    long long n_keys, n_bits;
    if (!PyArg_ParseTuple(args, "OOOOOLL", &tallies, &now_trees, &accepted, &counts_in,
                          &into_in, &n_keys, &n_bits))
        return nullptr;
    PyObject* ts = PySequence_Fast(tallies, "tallies must be a sequence");
    if (ts == nullptr) return nullptr;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ts);
    PyObject* const* items = PySequence_Fast_ITEMS(ts);
    CountedView acc, cnt, into;
    TreesView now;
    std::deque<TreesView> trees;  // each distinct one before, its buffers held until the end
    std::vector<const TreesView*> prev(n, nullptr);
    std::vector<int64_t> key(n), from(n), to(n), at(n + 1);
    bool ok = now.get(now_trees) && acc.get(accepted, 4, "accepted") &&
              cnt.get(counts_in, 4, "counts") && into.get(into_in, 8, "into", true);
    if (ok && (cnt.n != n || now.offsets.n != n + 1)) {
        PyErr_SetString(PyExc_ValueError, "tallies, counts and the trees' rows differ in number");
        ok = false;
    }
    if (ok && (n_keys < 1 || n_bits < 1 || into.n < n_keys * (1 + 2 * n_bits))) {
        PyErr_SetString(PyExc_ValueError, "into is smaller than n_keys * (1 + 2 * n_bits)");
        ok = false;
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; ok && i < n; ++i) {
        total += cnt.of<uint32_t>()[i];
        PyObject* tally = items[i];
        if (!PyList_Check(tally) || PyList_GET_SIZE(tally) != 3) {
            PyErr_SetString(PyExc_TypeError, "a tally must be a list [counter, last, row]");
            ok = false;
            break;
        }
        key[i] = PyLong_AsLongLong(PyList_GET_ITEM(tally, 0));
        if (key[i] == -1 && PyErr_Occurred()) {
            ok = false;
        } else if (key[i] < 0 || key[i] >= n_keys) {
            PyErr_Format(PyExc_ValueError, "counter %lld is outside [0, %lld)",
                         static_cast<long long>(key[i]), n_keys);
            ok = false;
        }
        ok = ok && now.row(i, at[i], at[i + 1]);
        PyObject* t = PyList_GET_ITEM(tally, 1);
        if (!ok || t == Py_None) continue;
        const TreesView* view = i > 0 && prev[i - 1] != nullptr && prev[i - 1]->obj == t
                                    ? prev[i - 1] : nullptr;
        for (auto it = trees.begin(); view == nullptr && it != trees.end(); ++it)
            if (it->obj == t) view = &*it;
        if (view == nullptr) {
            trees.emplace_back();
            if (!trees.back().get(t)) {
                ok = false;
                continue;
            }
            view = &trees.back();
        }
        long long r = PyLong_AsLongLong(PyList_GET_ITEM(tally, 2));
        ok = !(r == -1 && PyErr_Occurred()) && view->row(r, from[i], to[i]);
        prev[i] = view;
    }
    if (ok && total > acc.n) {
        PyErr_SetString(PyExc_ValueError, "counts add up to more than accepted holds");
        ok = false;
    }
    if (ok) {
        const Tally t{static_cast<double*>(into.view.buf), n_keys, n_bits,
                      into.n - n_keys * (1 + 2 * n_bits)};
        const uint32_t* a = acc.of<uint32_t>();
        for (Py_ssize_t i = 0; i < n; ++i) {
            tally_tree(t, key[i], now.bits.of<uint8_t>() + at[i], at[i + 1] - at[i]);
            int64_t c = cnt.of<uint32_t>()[i];
            if (const TreesView* p = prev[i]) {
                tally_walk(t, key[i], p->tokens.of<uint32_t>() + from[i],
                           p->parents.of<int32_t>() + from[i], p->bits.of<uint8_t>() + from[i],
                           to[i] - from[i], a, c);
            }
            a += c;
        }
        for (Py_ssize_t i = 0; ok && i < n; ++i) {  // the trees its next step walks down
            PyObject* r = PyLong_FromSsize_t(i);
            ok = r != nullptr;
            if (ok) {
                Py_INCREF(now_trees);
                PyList_SetItem(items[i], 1, now_trees);  // steals the references
                PyList_SetItem(items[i], 2, r);
            }
        }
    }
    Py_DECREF(ts);
    if (!ok) return nullptr;
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
    {"set_sources", set_sources, METH_VARARGS, "set_sources(rest, pld, learned, labels)"},
    {"count_batch", count_batch, METH_VARARGS,
     "count_batch(tallies, trees, accepted, counts, into, n_keys, n_bits): a batched step's "
     "metrics, added to into; each tally's last and row set to this step's"},
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

// The reference's constants the headers copy, by the Python name each copies, so that a test
// holds every copy to its original (tests/datastore/drafting/native/test_core_citations.py).
static bool add_copied_constants(PyObject* m) {
    const std::pair<const char*, long long> copied[] = {
        {"redraft.datastore.drafting.learned_index.PROMPT_TAIL", PROMPT_TAIL},
        {"redraft.datastore.drafting.learned_index.KEEP", KEEP},
        {"redraft.datastore.drafting.learned_index.MAX_MATCH", MAX_MATCH},
        {"redraft.datastore.drafting.learned_index.MAX_OCCURRENCES", MAX_OCCURRENCES},
        {"redraft.datastore.drafting.learned_index._POS_BITS", POS_BITS},
        {"redraft.datastore.drafting.learned_index.MAX_DOC_TOKENS", MAX_DOC_TOKENS},
        {"redraft.datastore.drafting.retrieval._MASS", MASS},
    };
    PyObject* d = PyDict_New();
    if (d == nullptr) return false;
    for (const auto& [name, value] : copied) {
        PyObject* v = PyLong_FromLongLong(value);
        if (v == nullptr || PyDict_SetItemString(d, name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return false;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, "COPIED_CONSTANTS", d) < 0) {
        Py_DECREF(d);
        return false;
    }
    return true;
}

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
    PyObject* m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    if (PyModule_AddIntConstant(m, "ERR_REST", ERR_REST) < 0 ||
        PyModule_AddIntConstant(m, "ERR_TOKENS", ERR_TOKENS) < 0 ||
        !add_copied_constants(m)) {
        Py_DECREF(m);
        return nullptr;
    }
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
