"""Optional native loop for chained page hashes (docs/DESIGN.md section 5).

``hashing.packed_page_hashes`` costs one Python-level SHA-256 object per page, most of it
interpreter and OpenSSL context set-up rather than hashing. This module compiles, on first
use, a 30-line C loop that hashes every page of one call with OpenSSL's ``SHA256_*``
functions (the same bytes, the same digests: v2 encoding, tested equal to the Python
path) and calls it once per call through ``ctypes`` (which releases the GIL).

It needs a C compiler (``cc``) and ``libcrypto`` (the OpenSSL library Python's hashlib
uses already; no headers: the few declarations are below). When either is missing, or
anything else fails, ``chain`` returns None for good and callers use the Python loop:
the results are identical, only slower. The shared object is built once per user and
source version in ``$XDG_CACHE_HOME/mesh_hicache`` (or ``~/.cache/mesh_hicache``; a
private temporary folder when that is not a directory of this user's that only they can
write), under a name derived from the source, and written atomically (concurrent ranks
may build it at the same time).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

_SOURCE = r"""
#include <stddef.h>
#include <string.h>
/* OpenSSL's public SHA256_CTX (openssl/sha.h), unchanged since 0.9.8. */
typedef struct { unsigned int h[8], Nl, Nh, data[16], num, md_len; } SHA256_CTX;
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
"""

_lock = threading.Lock()
_fn: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_tried = False


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(root, "mesh_hicache")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="mesh_hicache_native_")


def _build() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    tag = hashlib.sha256((_SOURCE + sys.platform + os.uname().machine).encode()).hexdigest()
    folder = _cache_dir()
    lib = os.path.join(folder, f"pagehash_{tag[:16]}.so")
    if not os.path.exists(lib):
        src = os.path.join(folder, f"pagehash_{tag[:16]}.{os.getpid()}.c")
        tmp = lib + f".{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write(_SOURCE)
        try:
            for crypto in ("-lcrypto", "-l:libcrypto.so.3", "-l:libcrypto.so.1.1"):
                cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, src, crypto]
                if subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0:
                    os.replace(tmp, lib)
                    break
            else:
                return None
        finally:
            for leftover in (src, tmp):
                if os.path.exists(leftover):
                    os.remove(leftover)
    fn = ctypes.CDLL(lib).mh_chain
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    fn.argtypes += [ctypes.c_size_t] * 3 + [ctypes.c_char_p]
    return fn


def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _fn, _tried
    with _lock:
        if not _tried:
            try:
                _fn = _build()
            except Exception:  # any failure: the Python loop serves (identical results)
                _fn = None
            _tried = True
    return _fn


def chain(
    prefix: bytes, parent: bytes, data: bytes, offset: int, step: int, pages: int
) -> list[bytes] | None:
    """``pages`` chained hashes of ``step``-byte pages of ``data`` from byte ``offset``:
    page ``i`` is ``sha256(prefix + previous + page)`` (``prefix``: 64 bytes, the first
    previous is ``parent``: 32 bytes). None when the native loop is unavailable. The
    caller checks the bounds (``offset + pages * step <= len(data)``)."""
    fn = _fn if _tried else _load()
    if fn is None:
        return None
    assert len(prefix) == 64 and len(parent) == 32 and offset + pages * step <= len(data)
    out = ctypes.create_string_buffer(32 * pages)
    if fn(prefix, parent, data, offset, step, pages, out) != 0:
        return None
    raw = out.raw
    return [raw[i : i + 32] for i in range(0, 32 * pages, 32)]


def available() -> bool:
    """Whether the native loop is in use (builds it on the first call)."""
    return (_fn if _tried else _load()) is not None
