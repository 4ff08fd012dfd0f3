"""Optional native loops for the hot loops Python pays per item (docs/DESIGN.md 5, 6).

- ``packer``: a request's token list packed as int64 bytes (``radix/hashing.py``): one C
  loop over the list's exact ints (a CPython extension, so it also needs Python's
  headers); anything it cannot check it leaves to the Python path.

- ``chain``: chained page hashes (``radix/hashing.py``). In Python each page costs one
  SHA-256 object, mostly interpreter and OpenSSL context set-up; here one call hashes
  every page with OpenSSL's ``SHA256_*`` (the same bytes, the same v2 digests: tested
  equal to the Python loop).
- ``segment_copier`` / ``row_copier``: the CPU transfer engine's row copies
  (``transfer/cpu.py``). In Python each row is one ``ctypes.memmove`` call (about 1 us
  each, GIL released and taken back); here one call copies every row of a layer (or of a
  whole operation), computing the addresses from the engine's per-segment pointer table
  and the operation's index arrays (or from arrays of addresses and sizes).

A 40-line C source, compiled on first use and called through ``ctypes`` (which releases
the GIL for the call). It needs a C compiler (``cc``) and ``libcrypto`` (the OpenSSL
library Python's hashlib uses already; no headers: the few declarations are below). When
either is missing, or anything else fails, ``available()`` is False for good and callers
use their Python loops: the results are identical, only slower. The shared object is built
once per user and source version in ``$XDG_CACHE_HOME/mesh_hicache/native`` (or
``~/.cache/mesh_hicache/native``; a private temporary folder when that is not a directory of this
user's that only they can write), under a name derived from the source, and written
atomically (concurrent ranks may build it at the same time).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

_T = TypeVar("_T")

_SOURCE = r"""
#include <stddef.h>
#include <string.h>
/* Room for OpenSSL's SHA256_CTX (openssl/sha.h: 112 bytes since 0.9.8), with margin: only
   libcrypto reads its fields, so no header is needed. */
typedef struct { unsigned long long opaque[32]; } SHA256_CTX;
int SHA256_Init(SHA256_CTX *c);
int SHA256_Update(SHA256_CTX *c, const void *data, size_t len);
int SHA256_Final(unsigned char *md, SHA256_CTX *c);

/* out[32 i .. 32 i + 32) = SHA256(prefix[0..64) + prev + data[offset + i * step ..][..step]),
   prev = parent for i = 0, else out of page i - 1. */
int mh_chain(const unsigned char *prefix, const unsigned char *parent,
             const unsigned char *data, size_t offset, size_t step, size_t pages,
             unsigned char *out) {
    SHA256_CTX base, c;
    const unsigned char *prev = parent;
    size_t i;
    if (!SHA256_Init(&base) || !SHA256_Update(&base, prefix, 64)) return -1;
    for (i = 0; i < pages; i++) {
        memcpy(&c, &base, sizeof c);
        if (!SHA256_Update(&c, prev, 32) || !SHA256_Update(&c, data + offset + i * step, step)
            || !SHA256_Final(out + 32 * i, &c)) return -1;
        prev = out + 32 * i;
    }
    return 0;
}

/* Segments [s0, s1) of a table of rows of 6 int64 (device address, device stride, host
   address, host stride, row bytes, index kind: 0 pages, 1 slots, 2 windows): for each, row
   dev[i] <-> host[i] of the index pairs of its kind (pages: np device indices, then np
   host indices; slots: ns + ns; windows: nw + nw), device -> host when backup. Kind by
   kind, index pair by index pair, every segment of it (one page's rows of consecutive
   segments are one block of the page-first host pool); a run of pairs consecutive on both
   sides is one memcpy in a segment whose rows are contiguous on both sides. Indices were
   checked by the caller. */
void mh_copy_segments(const long long *table, size_t s0, size_t s1, const long long *pages,
                      size_t np, const long long *slots, size_t ns, const long long *windows,
                      size_t nw, int backup) {
    const long long *index[3];
    size_t count[3];
    size_t s, i, j, k;
    int kind;
    index[0] = pages; index[1] = slots; index[2] = windows;
    count[0] = np; count[1] = ns; count[2] = nw;
    for (kind = 0; kind < 3; kind++) {
        const long long *d = index[kind];
        size_t n = count[kind];
        const long long *h = d + n;
        for (i = 0; i < n; i = j) {
            for (j = i + 1; j < n && d[j] == d[j - 1] + 1 && h[j] == h[j - 1] + 1; j++) {}
            for (s = s0; s < s1; s++) {
                const long long *t = table + 6 * s;
                char *a, *b;
                size_t row = (size_t)t[4];
                if (t[5] != kind) continue;
                a = (char *)(size_t)t[0] + d[i] * t[1];
                b = (char *)(size_t)t[2] + h[i] * t[3];
                if ((size_t)t[1] == row && (size_t)t[3] == row) {
                    if (backup) memcpy(b, a, row * (j - i)); else memcpy(a, b, row * (j - i));
                    continue;
                }
                for (k = i; k < j; k++, a += t[1], b += t[3]) {
                    if (backup) memcpy(b, a, row); else memcpy(a, b, row);
                }
            }
        }
    }
}

/* The same for a table without windows (no kind 2): two arguments fewer per call. */
void mh_copy_page_segments(const long long *table, size_t s0, size_t s1,
                           const long long *pages, size_t np, const long long *slots,
                           size_t ns, int backup) {
    mh_copy_segments(table, s0, s1, pages, np, slots, ns, 0, 0, backup);
}

/* memcpy(dst[i], src[i], size[i]) for i < n: the rows of one transfer (never overlapping:
   one side is a device pool, the other a host pool). */
void mh_copy_rows(const long long *dst, const long long *src, const long long *size, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        memcpy((void *)(size_t)dst[i], (const void *)(size_t)src[i], (size_t)size[i]);
}
"""

# A CPython extension (needs Python.h): a request's token list packed in one C loop.
_PACK_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
/* pack(seq) -> bytes | None: the little-endian int64 bytes of a list/tuple of exact ints in
   [0, 2**63); None for anything else (bools, subclasses, negatives, big ints, other
   types): the caller's Python path then validates and names the bad value. */
static PyObject *pack(PyObject *self, PyObject *seq) {
    Py_ssize_t n, i;
    PyObject **items, *out;
    long long *dst;
    if (PyList_CheckExact(seq)) {
        n = PyList_GET_SIZE(seq);
        items = ((PyListObject *)seq)->ob_item;
    } else if (PyTuple_CheckExact(seq)) {
        n = PyTuple_GET_SIZE(seq);
        items = ((PyTupleObject *)seq)->ob_item;
    } else {
        Py_RETURN_NONE;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) return NULL;
    dst = (long long *)PyBytes_AS_STRING(out);
    for (i = 0; i < n; i++) {
        int overflow = 0;
        long long v;
        if (!PyLong_CheckExact(items[i])) goto bail;
        v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || v < 0) goto bail;
        dst[i] = v;
    }
    return out;
bail:
    Py_DECREF(out);
    Py_RETURN_NONE;
}
static PyMethodDef methods[] = {{"pack", pack, METH_O, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mh_pack", NULL, -1, methods};
PyMODINIT_FUNC PyInit_mh_pack(void) { return PyModule_Create(&module); }
"""


class BuildOnce(Generic[_T]):
    """``build()`` run once per process, on the first ``get`` (thread-safe): its result,
    or None when it returned None or raised (the caller then takes its Python path). The
    project's C helpers are each one of these."""

    __slots__ = ("_build", "_lock", "_tried", "_value")

    def __init__(self, build: Callable[[], _T | None]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._tried = False
        self._value: _T | None = None

    def get(self) -> _T | None:
        if self._tried:
            return self._value
        with self._lock:
            if not self._tried:
                try:
                    self._value = self._build()
                except Exception:  # any failure: the Python path serves (identical results)
                    self._value = None
                self._tried = True
        return self._value


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "mesh_hicache", "native")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="mesh_hicache_native_")


def compile_once(
    name: str, source: str, options: Sequence[Sequence[str]], suffix: str = ".so"
) -> str | None:
    """The path of ``source`` (C) built as a shared object in the per-user build folder,
    compiled on the first call of any process with the first of ``options`` (extra ``cc``
    arguments, e.g. ``["-lz"]``) that works; the name carries a hash of the source, so a
    new version builds anew. Written atomically (concurrent ranks may build it at once).
    None without a C compiler, off Linux, or when every option fails."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    tag = hashlib.sha256((source + suffix + os.uname().machine).encode()).hexdigest()[:16]
    folder = _cache_dir()
    lib = os.path.join(folder, f"{name}_{tag}{suffix}")
    if os.path.exists(lib):
        return lib
    src = os.path.join(folder, f"{name}_{tag}.{os.getpid()}.c")
    tmp = lib + f".{os.getpid()}.tmp"
    with open(src, "w") as f:
        f.write(source)
    try:
        for extra in options:
            cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, src, *extra]
            if subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0:
                os.replace(tmp, lib)
                return lib
        return None
    finally:
        for leftover in (src, tmp):
            if os.path.exists(leftover):
                os.remove(leftover)


def _build() -> ctypes.CDLL | None:
    crypto = (["-lcrypto"], ["-l:libcrypto.so.3"], ["-l:libcrypto.so.1.1"])
    lib = compile_once("pagehash", _SOURCE, crypto)
    if lib is None:
        return None
    dll = ctypes.CDLL(lib)
    dll.mh_chain.restype = ctypes.c_int
    dll.mh_chain.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    dll.mh_chain.argtypes += [ctypes.c_size_t] * 3 + [ctypes.c_char_p]
    dll.mh_copy_rows.restype = None
    dll.mh_copy_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    dll.mh_copy_segments.restype = None
    dll.mh_copy_segments.argtypes = [vp, sz, sz, vp, sz, vp, sz, vp, sz, ctypes.c_int]
    dll.mh_copy_page_segments.restype = None
    dll.mh_copy_page_segments.argtypes = [vp, sz, sz, vp, sz, vp, sz, ctypes.c_int]
    return dll


_lib: BuildOnce[ctypes.CDLL] = BuildOnce(_build)


def available() -> bool:
    """Whether the native loops are in use (builds them on the first call)."""
    return _lib.get() is not None


def chain(
    prefix: bytes, parent: bytes, data: bytes, offset: int, step: int, pages: int
) -> list[bytes] | None:
    """``pages`` chained hashes of ``step``-byte pages of ``data`` from byte ``offset``:
    page ``i`` is ``sha256(prefix + previous + page)`` (``prefix``: 64 bytes, the first
    previous is ``parent``: 32 bytes). None when the native loop is unavailable. The
    caller checks the bounds (``offset + pages * step <= len(data)``)."""
    dll = _lib.get()
    if dll is None:
        return None
    assert len(prefix) == 64 and len(parent) == 32 and offset + pages * step <= len(data)
    out = ctypes.create_string_buffer(32 * pages)
    if dll.mh_chain(prefix, parent, data, offset, step, pages, out) != 0:
        return None
    raw = out.raw
    return [raw[i : i + 32] for i in range(0, 32 * pages, 32)]


def row_copier() -> Callable[[int, int, int, int], None] | None:
    """``copy(dst, src, size, n)``: ``memcpy`` of ``n`` rows whose addresses and byte
    counts are the int64 arrays at addresses ``dst``, ``src`` and ``size`` (one native
    call, GIL released), or None when unavailable. Raw memory: the caller guarantees
    every address range is valid and the two sides never overlap."""
    dll = _lib.get()
    return None if dll is None else dll.mh_copy_rows


def segment_copier(windows: bool = True) -> Callable[..., None] | None:
    """``copy(table, s0, s1, pages, np, slots, ns, windows, nw, backup)``: every row of
    segments ``[s0, s1)`` of a ``[S, 6]`` int64 table (device address, device stride, host
    address, host stride, row bytes, index kind: 0 pages, 1 slots, 2 windows) for the
    index pairs of each segment's kind: the ``np`` page pairs at ``pages`` (an int64
    block: device indices, then host indices), the ``ns`` slot pairs at ``slots`` and the
    ``nw`` window pairs at ``windows``, in one native call with the GIL released; runs
    consecutive on both sides are one copy where the segment's rows are contiguous on
    both sides. None when unavailable. Raw memory: the caller checked every index.

    ``windows=False``: ``copy(table, s0, s1, pages, np, slots, ns, backup)`` for a table
    without window segments (each argument costs ``ctypes`` a conversion per call)."""
    dll = _lib.get()
    if dll is None:
        return None
    return dll.mh_copy_segments if windows else dll.mh_copy_page_segments


def _build_pack() -> Callable[[object], bytes | None] | None:
    include = sysconfig.get_paths().get("include")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if sys.byteorder != "little" or not include or not suffix:
        return None
    if not os.path.exists(os.path.join(include, "Python.h")):
        return None
    lib = compile_once("mh_pack", _PACK_SOURCE, (["-I", include],), suffix)
    if lib is None:
        return None
    spec = importlib.util.spec_from_file_location("mh_pack", lib)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[[object], bytes | None] = module.pack
    return fn


_pack: BuildOnce[Callable[[object], bytes | None]] = BuildOnce(_build_pack)


def packer() -> Callable[[object], bytes | None] | None:
    """``pack(tokens)``: the little-endian int64 bytes of a list or tuple of exact ints in
    ``[0, 2**63)`` in one C loop, or None for anything else (the caller's Python path then
    validates and names the bad value); None when the extension cannot be built (it also
    needs Python's headers)."""
    return _pack.get()
