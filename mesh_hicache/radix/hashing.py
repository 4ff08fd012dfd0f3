"""Radix keys, packed tokens and chained page hashes (docs/DESIGN.md section 5).

Token ids are validated once, in bulk, when a ``RadixKey`` is built from a caller's
sequence: ints (not bool, not float) in ``[0, 2**63)``. The key stores them packed as
little-endian int64 bytes (8 bytes per token); every slice, page-aligned prefix and tree
node is cut from those bytes without looking at a token again.

A ``RadixKey`` is the packed tokens plus a namespace (tenant salt, LoRA id, ...).
Requests in different namespaces never share a tree node, and their page hashes differ.

Page hashes are chained: the hash of page ``i`` covers the hash of page ``i - 1``, the
namespace and the page's tokens, so equal hashes mean equal whole prefixes. They are
SHA-256 digests (32 bytes) of ``namespace_prefix(namespace) + parent hash + packed page``
(the prefix is one whole SHA-256 block: tag, then the namespace's digest), identical
across processes, runs and machines (never Python's ``hash()``, which is salted per
process). They are computed from the packed bytes, and only when needed (L3).
"""

from __future__ import annotations

import functools
import hashlib
import operator
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType

import numpy as np

#: Bytes of one page hash.
HASH_BYTES = 32
#: Bytes of one packed token id.
TOKEN_BYTES = 8
#: Token ids are ints in ``[0, TOKEN_LIMIT)``.
TOKEN_LIMIT = 2**63

# Version tag of the encoding: changing the byte layout below must change it, so that
# hashes of two encodings never collide in a shared L3 store.
_TAG = b"mesh_hicache.page.v2"
_NO_PARENT = bytes(HASH_BYTES)
_BLOCK = 64  # SHA-256 block: the per-namespace prefix fills exactly one
_BIG_ENDIAN = sys.byteorder == "big"


def _namespace_bytes(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    # Length prefix: ("ab", tokens) and ("a", b + tokens) must never encode alike.
    return struct.pack("<I", len(raw)) + raw


@functools.lru_cache(maxsize=1024)
def namespace_prefix(namespace: str) -> bytes:
    """The 64-byte first block of every page hash in ``namespace``: the tag padded to 32
    bytes, then SHA-256 of the length-prefixed namespace. One whole SHA-256 block, so its
    state is computed once per call and copied per page (a page costs what hashing its own
    bytes and the parent hash costs)."""
    block = _TAG.ljust(_BLOCK // 2, b"\0") + hashlib.sha256(_namespace_bytes(namespace)).digest()
    assert len(block) == _BLOCK
    return block


def _bad_token(tokens: Sequence[object], start: int = 0) -> Exception:
    """The error naming the first invalid token of ``tokens[start:]`` (the slow path)."""
    for i in range(start, len(tokens)):
        t = tokens[i]
        if isinstance(t, bool | np.bool_) or not hasattr(type(t), "__index__"):
            return TypeError(f"token ids must be ints, got {t!r} at position {i}")
        value = operator.index(t)  # type: ignore[arg-type]
        if not 0 <= value < TOKEN_LIMIT:
            return ValueError(f"token ids must be ints in [0, 2**63), got {t!r} at position {i}")
    return TypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Validate ``tokens`` in bulk and pack them as little-endian int64 bytes.

    Accepts any iterable of ints (lists, tuples, ranges, numpy/torch 1-D integer arrays).
    ``TypeError`` for a non-int (bool and float included), ``ValueError`` for an int
    outside ``[0, 2**63)``; both name the value and its position.
    """
    kind = type(tokens)
    if kind is list or kind is tuple:
        pack = _packer if _packer_loaded else _load_packer()
        if pack is not None:
            packed_fast = pack(tokens)  # one C loop; None: something to name, below
            if packed_fast is not None:
                return packed_fast
    else:
        if isinstance(tokens, str | bytes | bytearray | memoryview):
            raise TypeError(f"tokens must be a sequence of ints, got {kind.__name__}")
        if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.ndim == 1:
            return _pack_int_array(tokens)
        if not isinstance(tokens, list | tuple | range):
            tolist = getattr(tokens, "tolist", None)  # numpy / torch: Python ints, one C call
            tokens = tolist() if tolist is not None else list(tokens)
    seq: Sequence[object] = tokens  # type: ignore[assignment]
    try:  # one C loop rejects non-ints, ids < 0 and >= 2**64
        if type(seq) is list:
            packed = array("Q")
            packed.fromlist(seq)  # reads the list's items directly: ~30% faster than array(...)
        else:
            packed = array("Q", seq)  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        raise _bad_token(seq) from None
    if not packed:
        return b""
    # One numpy reduction: ids >= 2**63 read negative, and only 0 and 1 can be bools.
    if np.frombuffer(packed, dtype=np.int64).min() <= 1:
        values = np.frombuffer(packed, dtype=np.int64)
        for i in np.flatnonzero(values <= 1).tolist():
            if values[i] < 0 or isinstance(seq[i], bool | np.bool_):
                raise _bad_token(seq, i) from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _pack_int_array(values: np.ndarray) -> bytes:
    """``pack_tokens`` of a 1-D numpy integer array: no Python int per token."""
    if values.size == 0:
        return b""
    if values.min() < 0 or (values.dtype.itemsize == 8 and values.max() >= TOKEN_LIMIT):
        raise _bad_token(values.tolist())
    return values.astype("<i8", copy=False).tobytes()


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    """The token ids packed in ``data`` (inverse of ``pack_tokens``)."""
    values = array("q")
    values.frombytes(data)
    if _BIG_ENDIAN:
        values.byteswap()
    return tuple(values)


def packed_page_hashes(
    data: bytes,
    page_size: int,
    namespace: str = "",
    parent: bytes | None = None,
    start_page: int = 0,
) -> list[bytes]:
    """Chained hashes of the whole pages of packed tokens ``data[start_page * page:]``.

    ``parent``: the hash of the page just before ``start_page`` (None at the start of a
    sequence). A trailing partial page is ignored. Trusted input (already validated).
    """
    prev = _NO_PARENT if parent is None else parent
    step = page_size * TOKEN_BYTES
    first = start_page * step
    pages = (len(data) - first) // step
    if pages >= _NATIVE_MIN_PAGES and type(data) is bytes:
        native = _native()
        if native is not None:
            got = native.chain(namespace_prefix(namespace), prev, data, first, step, pages)
            if got is not None:
                return got
    view = memoryview(data)
    fresh = hashlib.sha256(namespace_prefix(namespace)).copy
    out: list[bytes] = []
    for start in range(first, len(data) - step + 1, step):
        h = fresh()
        h.update(prev)
        h.update(view[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out


#: Pages from which one call goes through the native loop (mesh_hicache/native.py): below, the
#: ``ctypes`` call costs about what the Python loop does.
_NATIVE_MIN_PAGES = 4
_native_module: ModuleType | None | bool = False  # False: not imported yet


def _native() -> ModuleType | None:
    """mesh_hicache/native.py, imported on first use (this file also loads on its own, without
    the package, where it falls back to the Python loop)."""
    global _native_module
    if _native_module is False:
        try:
            from mesh_hicache import native
        except ImportError:
            native = None  # type: ignore[assignment]
        _native_module = native if native is not None and native.available() else None
    return _native_module  # type: ignore[return-value]


_packer: Callable[[object], bytes | None] | None = None
_packer_loaded = False


def _load_packer() -> Callable[[object], bytes | None] | None:
    """mesh_hicache/native.py's list packer (a C loop over exact ints), or None."""
    global _packer, _packer_loaded
    try:
        from mesh_hicache import native
    except ImportError:
        _packer = None
    else:
        _packer = native.packer()
    _packer_loaded = True
    return _packer


def _check_page_size(page_size: object) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def page_hashes(
    tokens: Iterable[int],
    page_size: int,
    namespace: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained SHA-256 hashes of the whole pages of ``tokens``.

    ``tokens``: token ids (validated like ``pack_tokens``); a trailing partial page is
    ignored. ``parent``: the hash of the page just before ``tokens[0]`` (None at the start
    of a sequence). Returns one 32-byte hash per whole page, in order; an empty list when
    ``tokens`` holds less than one page. Pure.
    """
    _check_page_size(page_size)
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != HASH_BYTES):
        raise ValueError(f"parent must be None or {HASH_BYTES} bytes, got {parent!r}")
    return packed_page_hashes(pack_tokens(tokens), page_size, namespace, parent)


class RadixKey:
    """Token ids plus a namespace: the key of the radix tree. Immutable.

    ``RadixKey(tokens, namespace)`` validates ``tokens`` once (see ``pack_tokens``);
    ``RadixKey.from_packed`` wraps bytes that are already valid packed tokens. ``data`` is
    the packed form, ``tokens`` a tuple view (built on each access), ``namespace`` a str.
    """

    __slots__ = ("data", "namespace")

    data: bytes
    namespace: str

    def __init__(self, tokens: Iterable[int], namespace: str = "") -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"RadixKey namespace must be a str, got {namespace!r}")
        self.data = pack_tokens(tokens)
        self.namespace = namespace

    @classmethod
    def from_packed(cls, data: bytes, namespace: str = "") -> RadixKey:
        """A key over packed tokens that were validated before (no check, no copy)."""
        key = cls.__new__(cls)
        key.data = data
        key.namespace = namespace
        return key

    @property
    def tokens(self) -> tuple[int, ...]:
        return unpack_tokens(self.data)

    def __len__(self) -> int:
        return len(self.data) >> 3

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.data == other.data and self.namespace == other.namespace

    def __hash__(self) -> int:
        return hash((self.data, self.namespace))

    def __repr__(self) -> str:
        return f"RadixKey({len(self)} tokens, namespace={self.namespace!r})"

    def num_pages(self, page_size: int) -> int:
        """Number of whole pages of ``page_size`` tokens in the key."""
        _check_page_size(page_size)
        return len(self.data) // (page_size * TOKEN_BYTES)

    def prefix(self, num_tokens: int) -> RadixKey:
        """The key's first ``num_tokens`` tokens (self when that is all of it)."""
        end = num_tokens * TOKEN_BYTES
        if end >= len(self.data):
            return self
        return RadixKey.from_packed(self.data[: max(end, 0)], self.namespace)

    def page_aligned(self, page_size: int) -> RadixKey:
        """The key truncated to whole pages (self when already aligned)."""
        return self.prefix(self.num_pages(page_size) * page_size)

    def page_hashes(
        self, page_size: int, parent: bytes | None = None, start_page: int = 0
    ) -> list[bytes]:
        """Chained hashes of the key's whole pages from ``start_page`` on; ``parent`` is the
        hash of page ``start_page - 1`` (see ``page_hashes``)."""
        _check_page_size(page_size)
        return packed_page_hashes(self.data, page_size, self.namespace, parent, start_page)
