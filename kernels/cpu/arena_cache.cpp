// A small cache in front of CPython's arena allocator (`PyObject_SetArenaAllocator`).
//
// CPython 3.11+ keeps Python frames on a per-thread data stack made of 16-KiB chunks, and
// takes chunks from the arena allocator: mmap on push past a chunk's end, munmap when the
// frame that opened the chunk returns. A hot call made at a depth that straddles a chunk
// boundary therefore costs an mmap, an munmap and four page faults every time; in a VM each
// fault is an exit to the hypervisor. The DFLASH_X scheduler calls its attention op 30 times
// a forward at such a depth: ~70 faults a step (README, "Python's frame stack"). Keeping
// the last few freed blocks, and handing them back on the next request of the same size,
// turns that into two pointer moves. obmalloc's 1-MiB arenas go through the same hook and
// gain the same way. Held memory is bounded by `capacity` blocks of at most `kMaxBlock`.
//
// The cache is touched only by a thread holding the GIL (free-threaded builds are refused),
// so it needs no lock. CPython makes nearly every arena call under the GIL, but not all:
// `PyThreadState_Delete` may free a thread's stack chunks without it. A call from a thread
// that does not hold the GIL goes straight to the allocator we replaced.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>

namespace {

constexpr int kMaxCapacity = 64;
constexpr size_t kMaxBlock = size_t{1} << 20;  // obmalloc's arena size on 64-bit

struct Block {
  void* ptr;
  size_t size;
};

PyObjectArenaAllocator inner;  // the allocator we replaced (mmap/munmap by default)
bool installed = false;
Block cache[kMaxCapacity];
int cached = 0;
int capacity = 0;
unsigned long long hits = 0, misses = 0;

void* cached_alloc(void*, size_t size) {
  if (!PyGILState_Check()) {
    return inner.alloc(inner.ctx, size);
  }
  for (int i = cached - 1; i >= 0; --i) {
    if (cache[i].size == size) {
      void* ptr = cache[i].ptr;
      cache[i] = cache[--cached];
      ++hits;
      return ptr;
    }
  }
  ++misses;
  return inner.alloc(inner.ctx, size);
}

void cached_free(void*, void* ptr, size_t size) {
  if (ptr == nullptr) {
    return;
  }
  if (cached < capacity && size <= kMaxBlock && PyGILState_Check()) {
    cache[cached++] = Block{ptr, size};
    return;
  }
  inner.free(inner.ctx, ptr, size);
}

PyObject* install(PyObject*, PyObject* arg) {
#ifdef Py_GIL_DISABLED
  PyErr_SetString(PyExc_RuntimeError, "arena cache: free-threaded CPython is not supported");
  return nullptr;
#else
  long blocks = PyLong_AsLong(arg);
  if (blocks == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (blocks < 1 || blocks > kMaxCapacity) {
    PyErr_Format(PyExc_ValueError, "arena cache: blocks must be 1..%d, got %ld", kMaxCapacity,
                 blocks);
    return nullptr;
  }
  capacity = static_cast<int>(blocks);
  while (cached > capacity) {  // shrinking: release the surplus
    --cached;
    inner.free(inner.ctx, cache[cached].ptr, cache[cached].size);
  }
  if (!installed) {
    PyObject_GetArenaAllocator(&inner);
    PyObjectArenaAllocator ours = {nullptr, cached_alloc, cached_free};
    PyObject_SetArenaAllocator(&ours);
    installed = true;
  }
  Py_RETURN_NONE;
#endif
}

PyObject* stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:K,s:K,s:i,s:i,s:O}", "hits", hits, "misses", misses, "cached",
                       cached, "capacity", capacity, "installed",
                       installed ? Py_True : Py_False);
}

PyMethodDef methods[] = {
    {"install", install, METH_O,
     "install(blocks): cache up to `blocks` freed arena blocks (1 MiB at most each); "
     "called again, resizes the cache"},
    {"stats", stats, METH_NOARGS, "hits, misses, blocks cached, capacity, installed"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "dflash_arena_cache",
                      "A cache in front of CPython's arena allocator.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_dflash_arena_cache(void) { return PyModule_Create(&module); }
