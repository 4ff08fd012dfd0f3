"""Keyed per-chunk tags of sealed format version 2 objects: SipHash-2-4, one pass.

With a storage secret every chunk of a format version 2 payload (``objects.py``) gets a
64-bit SipHash-2-4 tag under a 128-bit subkey of the secret (Aumasson and Bernstein,
"SipHash: a fast short-input PRF", 2012; the reference's test vectors are checked at
build time and in the tests). SipHash is a keyed PRF: without the key nobody can compute
a tag, so a chunk that was changed passes its check with probability 2^-64 per attempt,
and an attempt needs a reader holding the key to read the forged object (no offline
search). The chunk table holding the tags is under the object's HMAC (``objects.py``).

One C call walks the payload once (about HMAC-SHA256's speed; a Python loop over
``hashlib`` costs ~0.3 us of call overhead per chunk). Built on first use with ``cc``
into the per-user cache folder of ``mesh_hicache.native``; without a compiler the tags
come from a numpy loop vectorised over the chunks (the same values, slower).

The algorithm, per message ``m`` of ``n`` bytes and key words ``k0, k1`` (little endian):
``v = (k0 ^ c0, k1 ^ c1, k0 ^ c2, k1 ^ c3)``; for each 8-byte little-endian word ``w``
(the last one holds the 0-7 leftover bytes and ``n mod 256`` in its top byte):
``v3 ^= w``, two rounds, ``v0 ^= w``; then ``v2 ^= 0xff``, four rounds; the tag is
``v0 ^ v1 ^ v2 ^ v3``. A round is four add-rotate-xor steps (``_ROUND`` below).
"""

from __future__ import annotations

import ctypes
import struct
import sys

import numpy as np

from mesh_hicache.native import BuildOnce, compile_once

_C = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)

_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define ROUND(v0, v1, v2, v3) do { \
    v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32); \
    v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2; \
    v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0; \
    v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32); } while (0)

/* SipHash-2-4 of p[0..n) under key words k0, k1 (little-endian host). */
static uint64_t sip24(uint64_t k0, uint64_t k1, const unsigned char *p, size_t n) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    uint64_t w;
    size_t i, end = n & ~(size_t)7;
    for (i = 0; i < end; i += 8) {
        memcpy(&w, p + i, 8);
        v3 ^= w;
        ROUND(v0, v1, v2, v3);
        ROUND(v0, v1, v2, v3);
        v0 ^= w;
    }
    w = (uint64_t)(n & 255) << 56;
    for (i = 0; i < (n & 7); i++) w |= (uint64_t)p[end + i] << (8 * i);
    v3 ^= w;
    ROUND(v0, v1, v2, v3);
    ROUND(v0, v1, v2, v3);
    v0 ^= w;
    v2 ^= 0xff;
    ROUND(v0, v1, v2, v3);
    ROUND(v0, v1, v2, v3);
    ROUND(v0, v1, v2, v3);
    ROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}

/* tags[8k..8k+8) = SipHash-2-4 (little endian) of chunk k of p[0..n) (chunk bytes
   each, the last one may be shorter); key: 16 bytes. */
void mh_sip_chunks(const unsigned char *key, const unsigned char *p, size_t n, size_t chunk,
                   unsigned char *tags) {
    uint64_t k0, k1, t;
    size_t i, k = 0;
    memcpy(&k0, key, 8);
    memcpy(&k1, key + 8, 8);
    for (i = 0; i < n; i += chunk, k++) {
        t = sip24(k0, k1, p + i, n - i < chunk ? n - i : chunk);
        memcpy(tags + 8 * k, &t, 8);
    }
}

/* Check chunks [c0, c1) of the payload p (n bytes) against tags; returns the index of
   the first chunk that differs, or -1. */
long mh_sip_check(const unsigned char *key, const unsigned char *p, size_t n, size_t chunk,
                  size_t c0, size_t c1, const unsigned char *tags) {
    uint64_t k0, k1, t, want;
    size_t k, i;
    memcpy(&k0, key, 8);
    memcpy(&k1, key + 8, 8);
    for (k = c0; k < c1; k++) {
        i = k * chunk;
        t = sip24(k0, k1, p + i, n - i < chunk ? n - i : chunk);
        memcpy(&want, tags + 8 * k, 8);
        if (t != want) return (long)k;
    }
    return -1;
}
"""

# SipHash-2-4, key 00 01 .. 0f, message 00 01 .. n-1: the reference's vectors n = 0..16.
SPEC_VECTORS = (
    0x726FDB47DD0E0E31,
    0x74F839C593DC67FD,
    0x0D6C8009D9A94F5A,
    0x85676696D7FB7E2D,
    0xCF2794E0277187B7,
    0x18765564CD99A68D,
    0xCBC9466E58FEE3CE,
    0xAB0200F58B01D137,
    0x93F5F5799A932462,
    0x9E0082DF0BA9E4B0,
    0x7A5DBBC594DDB9F3,
    0xF4B32F46226BADA7,
    0x751E8FBC860EE5FB,
    0x14EA5627C0843D90,
    0xF723CA908E7AF2EE,
    0xA129CA6149BE45E5,
    0x3F2ACC7F57C29BDB,
)


def _build() -> ctypes.CDLL | None:
    if sys.byteorder != "little":
        return None
    lib = compile_once("chunksip", _SOURCE, ([],))
    if lib is None:
        return None
    dll = ctypes.CDLL(lib)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    dll.mh_sip_chunks.restype = None
    dll.mh_sip_chunks.argtypes = [ctypes.c_char_p, vp, sz, sz, vp]
    dll.mh_sip_check.restype = ctypes.c_long
    dll.mh_sip_check.argtypes = [ctypes.c_char_p, vp, sz, sz, sz, sz, ctypes.c_char_p]
    key = bytes(range(16))
    msg = bytes(range(len(SPEC_VECTORS)))
    for n, want in enumerate(SPEC_VECTORS):
        tags = ctypes.create_string_buffer(8)
        dll.mh_sip_chunks(key, _address(memoryview(msg)), n, max(n, 1), tags)
        if n and struct.unpack("<Q", tags.raw)[0] != want:
            return None
    return dll


_lib: BuildOnce[ctypes.CDLL] = BuildOnce(_build)  # any failure: the numpy loop serves


def available() -> bool:
    """Whether the native loop is in use (builds it on the first call)."""
    return _lib.get() is not None


def _address(view: memoryview) -> int:
    """The address of a contiguous byte view (writable or not), without a copy."""
    if not view.readonly:  # ~5x cheaper than numpy's: it counts for 4 KiB rows
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _check_key(key: bytes) -> None:
    assert isinstance(key, bytes) and len(key) == 16, "SipHash keys are 16 bytes"


def chunk_tags(key: bytes, payload: memoryview, chunk: int) -> bytes:
    """The packed little-endian SipHash-2-4 tag (8 bytes) of every ``chunk``-byte chunk
    of ``payload`` (a contiguous byte view; the last chunk may be shorter) under ``key``
    (16 bytes), in one pass."""
    _check_key(key)
    assert chunk > 0
    n = payload.nbytes
    if not n:
        return b""
    dll = _lib.get()
    if dll is None:
        return _numpy_tags(key, payload, chunk)
    tags = ctypes.create_string_buffer(8 * -(-n // chunk))
    dll.mh_sip_chunks(key, _address(payload), n, chunk, tags)
    return tags.raw


def first_bad_chunk(
    key: bytes, payload: memoryview, chunk: int, c0: int, c1: int, tags: bytes
) -> int:
    """Check chunks ``[c0, c1)`` of ``payload`` (a byte view of the whole payload)
    against ``tags`` (packed, as ``chunk_tags`` gives): the first chunk that differs, or
    -1 when all match."""
    _check_key(key)
    assert 0 <= c0 <= c1 and 8 * c1 <= len(tags)
    if c0 == c1:
        return -1
    dll = _lib.get()
    if dll is not None:
        return int(dll.mh_sip_check(key, _address(payload), payload.nbytes, chunk, c0, c1, tags))
    lo, hi = c0 * chunk, min(c1 * chunk, payload.nbytes)
    got = _numpy_tags(key, payload[lo:hi], chunk)
    want = tags[8 * c0 : 8 * c1]
    if got == want:
        return -1
    return c0 + next(i for i in range(c1 - c0) if got[8 * i : 8 * i + 8] != want[8 * i : 8 * i + 8])


def siphash24(key: bytes, data: bytes | bytearray | memoryview) -> int:
    """SipHash-2-4 of ``data`` under ``key`` (16 bytes) as an integer (the tag's value)."""
    view = memoryview(data).cast("B")
    if not view.nbytes:
        return _sip_lanes(key, np.zeros((1, 0), np.uint64), np.zeros(1, np.uint64))[0]
    return int(struct.unpack("<Q", chunk_tags(key, view, view.nbytes))[0])


# -- the numpy loop (no compiler): lanes are the chunks ----------------------------------


def _rotl(x: np.ndarray, b: int) -> np.ndarray:
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


def _round(v: list[np.ndarray]) -> None:
    v0, v1, v2, v3 = v
    v0 += v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16) ^ v2
    v0 += v3
    v3 = _rotl(v3, 21) ^ v0
    v2 += v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    v[:] = [v0, v1, v2, v3]


def _sip_lanes(key: bytes, words: np.ndarray, last: np.ndarray) -> list[int]:
    """SipHash-2-4 of ``len(last)`` messages at once: ``words`` (lanes x w) their whole
    8-byte words, ``last`` each one's final word (leftover bytes and length byte)."""
    k0, k1 = struct.unpack("<QQ", key)
    lanes = len(last)
    v = [np.full(lanes, k ^ c, dtype=np.uint64) for k, c in zip((k0, k1, k0, k1), _C, strict=True)]
    with np.errstate(over="ignore"):
        for j in range(words.shape[1] + 1):
            w = words[:, j] if j < words.shape[1] else last
            v[3] = v[3] ^ w
            _round(v)
            _round(v)
            v[0] = v[0] ^ w
        v[2] = v[2] ^ np.uint64(0xFF)
        for _ in range(4):
            _round(v)
    return [int(x) for x in v[0] ^ v[1] ^ v[2] ^ v[3]]


def _lanes_of(payload: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole words and final words of messages that are the rows of ``payload``
    (lanes x ``size`` bytes)."""
    full = size // 8 * 8
    words = np.ascontiguousarray(payload[:, :full]).view("<u8").astype(np.uint64)
    last = np.full(len(payload), (size & 255) << 56, dtype=np.uint64)
    for i in range(size - full):
        last |= payload[:, full + i].astype(np.uint64) << np.uint64(8 * i)
    return words.reshape(len(payload), -1), last


def _numpy_tags(key: bytes, payload: memoryview, chunk: int) -> bytes:
    data = np.frombuffer(payload, np.uint8)
    n = len(data)
    whole = n // chunk
    out: list[int] = []
    if whole:
        out += _sip_lanes(key, *_lanes_of(data[: whole * chunk].reshape(whole, chunk), chunk))
    if n > whole * chunk:
        rest = data[whole * chunk :].reshape(1, -1)
        out += _sip_lanes(key, *_lanes_of(rest, n - whole * chunk))
    return struct.pack(f"<{len(out)}Q", *out)
