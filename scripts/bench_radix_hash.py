"""Chained page hashing for ``bench_radix.py``: NEW (from packed bytes) and OLD (from token
ints) against SGLang's native page hash approach and native hashes of the same bytes."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import shutil
import subprocess
import sysconfig
import time
from array import array
from collections.abc import Callable
from types import ModuleType

from bench_radix_drive import tokenizer_output

from mesh_hicache import radix as new_radix

# SGLang's page hash approach (sglang/srt/mem_cache/cpp_utils: hash_binding.cpp), written
# here from its description: the key's token ids go into an ``array("I")`` (uint32), then ONE
# native call hashes every page, SHA-256(previous page's digest, none for the first page +
# the page's uint32 little-endian ids) with OpenSSL, the GIL released, and returns the
# digests as a list of hex str. Built at run time (skipped with a note without cc).
_SGLANG_HASH_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
typedef struct { unsigned long long opaque[32]; } SHA256_CTX; /* room for OpenSSL's */
int SHA256_Init(SHA256_CTX *c);
int SHA256_Update(SHA256_CTX *c, const void *data, size_t len);
int SHA256_Final(unsigned char *md, SHA256_CTX *c);

static PyObject *page_hashes(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t ps, n, pages, i;
    int j, has_prior = 0;
    unsigned char prior[32];
    static const char hexd[] = "0123456789abcdef";
    char *hex;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &ps)) return NULL;
    n = buf.len / 4;
    pages = ps > 0 ? n / ps : 0;
    hex = PyMem_Malloc(pages * 64 + 1);
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < pages; i++) {
        SHA256_CTX c;
        SHA256_Init(&c);
        if (has_prior) SHA256_Update(&c, prior, 32);
        SHA256_Update(&c, (const char *)buf.buf + i * ps * 4, ps * 4);
        SHA256_Final(prior, &c);
        has_prior = 1;
        for (j = 0; j < 32; j++) {
            hex[i * 64 + 2 * j] = hexd[prior[j] >> 4];
            hex[i * 64 + 2 * j + 1] = hexd[prior[j] & 15];
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    out = PyList_New(pages);
    for (i = 0; out && i < pages; i++) {
        PyObject *h = PyUnicode_FromStringAndSize(hex + i * 64, 64);
        if (!h) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, h);
    }
    PyMem_Free(hex);
    return out;
}
static PyMethodDef methods[] = {{"page_hashes", page_hashes, METH_VARARGS, NULL}, {NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "sglang_like_hash", NULL, -1, methods};
PyMODINIT_FUNC PyInit_sglang_like_hash(void) { return PyModule_Create(&mod); }
"""


def build_sglang_like_hash(folder: str) -> tuple[ModuleType | None, str]:
    """The SGLang-approach page hash module compiled into ``folder``, or (None, why)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc)"
    src = os.path.join(folder, "sglang_like_hash.c")
    with open(src, "w") as f:
        f.write(_SGLANG_HASH_C)
    out = os.path.join(folder, "sglang_like_hash" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [cc, "-O3", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"], src]
    r = subprocess.run([*cmd, "-lcrypto", "-o", out], capture_output=True, text=True)
    if r.returncode:
        return None, f"build failed: {r.stderr.strip()[-300:]}"
    spec = importlib.util.spec_from_file_location("sglang_like_hash", out)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, ""


def bench_hashing(
    old: ModuleType, sgl: ModuleType | None, page_size: int, reps: int
) -> dict[str, float]:
    """Microseconds per page (best of ``reps``, thread CPU time), alternated: chained hashes
    (NEW from packed bytes, OLD from ints), SGLang's approach (``sgl``: uint32 array of the
    key's ints + one native call), and native hashes of each page (``hashlib.sha256`` of the
    same bytes; Python's built-in ``hash`` of the page's token tuple)."""
    rng = random.Random(1)
    tokens = tokenizer_output([rng.randrange(32000) for _ in range(page_size * 64)])
    key = new_radix.RadixKey(tokens)
    data = key.data
    step = page_size * 8
    view = memoryview(data)
    sha256 = hashlib.sha256
    fns: dict[str, Callable[[], object]] = {
        "new_chained": lambda: key.page_hashes(page_size),
        "old_chained": lambda: old.page_hashes(tokens, page_size),
        # The same bytes, cut from the same packed buffer, one native hash per page.
        "sha256_page_bytes": lambda: [
            sha256(view[i : i + step]).digest() for i in range(0, len(data), step)
        ],
        "builtin_hash_page_tuple": lambda: [
            hash(tuple(tokens[i : i + page_size])) for i in range(0, len(tokens), page_size)
        ],
    }
    if sgl is not None:
        # What SGLang does per node: its key is a list of ints, packed per call.
        fns["sglang_native"] = lambda: sgl.page_hashes(array("I", tokens), page_size)
        ref = hashlib.sha256(array("I", tokens[:page_size]).tobytes()).hexdigest()
        assert sgl.page_hashes(array("I", tokens), page_size)[0] == ref
    # Same number of chained hashes (the byte encoding is versioned: v1 old, v2 new).
    assert len(key.page_hashes(page_size)) == len(old.page_hashes(tokens, page_size)) == 64
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.thread_time_ns()
            fn()
            best[name] = min(best[name], (time.thread_time_ns() - t0) / 64 / 1e3)
    best["new_over_sha256"] = best["new_chained"] / best["sha256_page_bytes"]
    best["new_over_builtin_hash"] = best["new_chained"] / best["builtin_hash_page_tuple"]
    if sgl is not None:
        best["new_over_sglang_native"] = best["new_chained"] / best["sglang_native"]
    return best
