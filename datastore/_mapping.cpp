// Read-only maps of datastore files that a truncation cannot turn into a crash.
//
// Why: a segment is mapped, not read, and touching a mapped page that lies past the file's
// end raises SIGBUS, which kills the process. Files are never truncated by redraft (writers
// publish new files by rename), but an operator refreshing a served datastore in place
// (`cp -r new/. served/` opens every file with O_TRUNC, then rewrites it) truncates the very
// files a server maps; before this, the server died of SIGBUS at its next step.
//
// How: every Map registers its address range. A SIGBUS handler that finds the faulting
// address inside a Map replaces the Map's pages from the faulting one to its end with
// anonymous zero pages (mmap MAP_FIXED, one system call) and returns: the read that faulted
// is retried and reads zeros, and so does every later read of those pages. The Map is then
// marked `truncated` and the process-wide fault count grows, so that the Python side can
// refuse the data (DatastoreCorrupt) at its next check; every reader of the arrays is
// bounded against damaged contents anyway, zeros included. A SIGBUS anywhere else goes to
// the handler installed before this one (faulthandler's, or the default action: death).
//
// The storage layer imports this module only if it was built; plain mmap is its fallback.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace {

// ---- the registry of mapped ranges (read by the signal handler, lock-free) -------------
// Fixed chunks of slots, linked and never freed: the handler walks them without a lock,
// and a slot is free while its `lo` is 0.
struct Slot {
    std::atomic<uintptr_t> lo{0}, hi{0};
    std::atomic<int> truncated{0};
};
constexpr int kSlots = 1024;
struct Chunk {
    Slot slots[kSlots];
    std::atomic<Chunk*> next{nullptr};
};
Chunk g_first;
std::mutex g_mu;  // registration and release (never taken by the handler)
std::atomic<unsigned long long> g_faults{0};
uintptr_t g_page = 4096;
struct sigaction g_previous;  // the SIGBUS action this handler chains to

Slot* register_range(uintptr_t lo, uintptr_t hi) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Chunk* c = &g_first;; c = c->next.load()) {
        for (Slot& s : c->slots) {
            if (s.lo.load() == 0) {
                s.truncated.store(0);
                s.hi.store(hi);
                s.lo.store(lo);  // last: the slot is live from here on
                return &s;
            }
        }
        if (c->next.load() == nullptr) c->next.store(new Chunk());
    }
}

void release_range(Slot* s) {
    std::lock_guard<std::mutex> lock(g_mu);
    s->lo.store(0);
    s->hi.store(0);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
    if (info->si_code == BUS_ADRERR) {  // the kernel's: a page past the end of its file
        uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
        for (Chunk* c = &g_first; c != nullptr; c = c->next.load(std::memory_order_acquire)) {
            for (Slot& s : c->slots) {
                uintptr_t lo = s.lo.load(std::memory_order_acquire);
                if (lo == 0 || at < lo) continue;
                uintptr_t hi = s.hi.load(std::memory_order_acquire);
                if (at >= hi) continue;
                uintptr_t page = at & ~(g_page - 1);
                void* got = mmap(reinterpret_cast<void*>(page), hi - page, PROT_READ,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
                if (got != MAP_FAILED) {
                    s.truncated.store(1);
                    g_faults.fetch_add(1);
                    return;  // the faulting read is retried, and reads zeros
                }
                goto chain;
            }
        }
    }
chain:
    if (g_previous.sa_flags & SA_SIGINFO) {
        if (g_previous.sa_sigaction != nullptr) {
            g_previous.sa_sigaction(sig, info, context);
            return;
        }
    } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
        g_previous.sa_handler(sig);
        return;
    }
    // The default action: a fault repeats once this returns, a sent signal is raised again.
    signal(SIGBUS, SIG_DFL);
    if (info->si_code <= 0) raise(sig);
}

// (Re)installs the handler when another one replaced it (faulthandler.enable() after the
// first Map, say), chaining to that one.
bool ensure_handler() {
    struct sigaction now;
    if (sigaction(SIGBUS, nullptr, &now) != 0) return false;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return true;
    struct sigaction mine;
    std::memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    g_previous = now;
    return sigaction(SIGBUS, &mine, nullptr) == 0;
}

// ---- Map ---------------------------------------------------------------------------------
struct MapObject {
    PyObject_HEAD
    const char* data;
    Py_ssize_t size;
    Slot* slot;
    Py_ssize_t exports;
    PyObject* weakrefs;
};

void unmap(MapObject* self) {
    if (self->data == nullptr) return;
    release_range(self->slot);  // before the range can be reused by another mapping
    munmap(const_cast<char*>(self->data), static_cast<size_t>(self->size));
    self->data = nullptr;
    self->slot = nullptr;
}

bool check_open(MapObject* self) {
    if (self->data != nullptr) return true;
    PyErr_SetString(PyExc_ValueError, "the map is closed");
    return false;
}

PyObject* Map_new(PyTypeObject* type, PyObject* args, PyObject*) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return nullptr;
    struct stat st;
    if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (st.st_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "cannot map an empty file");
        return nullptr;
    }
    if (!ensure_handler()) return PyErr_SetFromErrno(PyExc_OSError);
    void* data = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    MapObject* self = reinterpret_cast<MapObject*>(type->tp_alloc(type, 0));
    if (self == nullptr) {
        munmap(data, static_cast<size_t>(st.st_size));
        return nullptr;
    }
    self->data = static_cast<const char*>(data);
    self->size = static_cast<Py_ssize_t>(st.st_size);
    uintptr_t lo = reinterpret_cast<uintptr_t>(data);
    uintptr_t hi = (lo + static_cast<uintptr_t>(st.st_size) + g_page - 1) & ~(g_page - 1);
    try {
        self->slot = register_range(lo, hi);
    } catch (const std::bad_alloc&) {
        munmap(data, static_cast<size_t>(st.st_size));
        self->data = nullptr;
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return reinterpret_cast<PyObject*>(self);
}

void Map_dealloc(MapObject* self) {
    if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(self));
    unmap(self);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* Map_close(MapObject* self, PyObject*) {
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "cannot close a map with exported buffers");
        return nullptr;
    }
    unmap(self);
    Py_RETURN_NONE;
}

PyObject* Map_truncated(MapObject* self, void*) {
    return PyBool_FromLong(self->slot != nullptr && self->slot->truncated.load());
}

PyObject* Map_closed(MapObject* self, void*) { return PyBool_FromLong(self->data == nullptr); }

Py_ssize_t Map_length(MapObject* self) { return self->data == nullptr ? 0 : self->size; }

PyObject* Map_subscript(MapObject* self, PyObject* item) {
    if (!check_open(self)) return nullptr;
    if (PyIndex_Check(item)) {
        Py_ssize_t i = PyNumber_AsSsize_t(item, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return nullptr;
        if (i < 0) i += self->size;
        if (i < 0 || i >= self->size) {
            PyErr_SetString(PyExc_IndexError, "map index out of range");
            return nullptr;
        }
        return PyLong_FromLong(static_cast<unsigned char>(self->data[i]));
    }
    if (!PySlice_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "map indices must be integers or slices");
        return nullptr;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(item, &start, &stop, &step) < 0) return nullptr;
    Py_ssize_t n = PySlice_AdjustIndices(self->size, &start, &stop, step);
    if (step == 1) return PyBytes_FromStringAndSize(self->data + start, n);
    PyObject* out = PyBytes_FromStringAndSize(nullptr, n);
    if (out == nullptr) return nullptr;
    char* b = PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0, i = start; k < n; ++k, i += step) b[k] = self->data[i];
    return out;
}

int Map_getbuffer(MapObject* self, Py_buffer* view, int flags) {
    if (!check_open(self)) {
        view->obj = nullptr;
        return -1;
    }
    if (PyBuffer_FillInfo(view, reinterpret_cast<PyObject*>(self),
                          const_cast<char*>(self->data), self->size, 1, flags) < 0)
        return -1;
    ++self->exports;
    return 0;
}

void Map_releasebuffer(MapObject* self, Py_buffer*) { --self->exports; }

PyMethodDef Map_methods[] = {
    {"close", reinterpret_cast<PyCFunction>(Map_close), METH_NOARGS,
     "Unmap (BufferError while a view of it exists)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef Map_getset[] = {
    {"truncated", reinterpret_cast<getter>(Map_truncated), nullptr,
     "whether a read past the file's end (it was truncated while mapped) was answered with "
     "zeros",
     nullptr},
    {"closed", reinterpret_cast<getter>(Map_closed), nullptr, "whether close() unmapped it",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMappingMethods Map_as_mapping = {reinterpret_cast<lenfunc>(Map_length),
                                   reinterpret_cast<binaryfunc>(Map_subscript), nullptr};
PyBufferProcs Map_as_buffer = {reinterpret_cast<getbufferproc>(Map_getbuffer),
                               reinterpret_cast<releasebufferproc>(Map_releasebuffer)};
PySequenceMethods Map_as_sequence = {reinterpret_cast<lenfunc>(Map_length)};

PyTypeObject MapType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* faults(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(g_faults.load()); }

PyMethodDef module_methods[] = {
    {"faults", faults, METH_NOARGS,
     "Pages past a file's end that a read of a Map touched in this process (0: none)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_mapping",
                          "Read-only file maps whose truncation reads as zeros, not SIGBUS.", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__mapping(void) {
    long page = sysconf(_SC_PAGESIZE);
    if (page > 0) g_page = static_cast<uintptr_t>(page);
    MapType.tp_name = "redraft.datastore._mapping.Map";
    MapType.tp_basicsize = sizeof(MapObject);
    MapType.tp_flags = Py_TPFLAGS_DEFAULT;
    MapType.tp_doc = "Map(fd): the whole file, read-only; slices are bytes, views zero-copy.";
    MapType.tp_new = Map_new;
    MapType.tp_dealloc = reinterpret_cast<destructor>(Map_dealloc);
    MapType.tp_methods = Map_methods;
    MapType.tp_getset = Map_getset;
    MapType.tp_as_mapping = &Map_as_mapping;
    MapType.tp_as_sequence = &Map_as_sequence;
    MapType.tp_as_buffer = &Map_as_buffer;
    MapType.tp_weaklistoffset = offsetof(MapObject, weakrefs);
    if (PyType_Ready(&MapType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (m == nullptr) return nullptr;
    Py_INCREF(&MapType);
    if (PyModule_AddObject(m, "Map", reinterpret_cast<PyObject*>(&MapType)) < 0) {
        Py_DECREF(&MapType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
