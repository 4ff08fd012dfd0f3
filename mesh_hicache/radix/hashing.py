"""Radix keys and chained page hashes (DESIGN.md section 5).

A ``RadixKey`` is a sequence of token ids plus a namespace (tenant salt, LoRA id, ...).
Requests in different namespaces never share a tree node, and their page hashes differ.

Page hashes are chained: the hash of page ``i`` covers the hash of page ``i - 1``, the
namespace and the page's tokens, so equal hashes mean equal whole prefixes. They are
SHA-256 digests (32 bytes) of a fixed byte encoding, identical across processes, runs
and machines (never Python's ``hash()``, which is salted per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

#: Bytes of one page hash.
HASH_BYTES = 32

# Version tag of the encoding: changing the byte layout below must change it, so that
# hashes of two encodings never collide in a shared L3 store.
_TAG = b"mesh_hicache.page.v1"
_NO_PARENT = bytes(HASH_BYTES)
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _namespace_bytes(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    # Length prefix: ("ab", tokens) and ("a", b + tokens) must never encode alike.
    return struct.pack("<I", len(raw)) + raw


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    namespace: str = "",
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained SHA-256 hashes of the whole pages of ``tokens``.

    ``tokens``: token ids (Python ints in the int64 range); a trailing partial page is
    ignored. ``parent``: the hash of the page just before ``tokens[0]`` (None at the start
    of a sequence). Returns one 32-byte hash per whole page, in order; an empty list when
    ``tokens`` holds less than one page. Pure.
    """
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != HASH_BYTES):
        raise ValueError(f"parent must be None or {HASH_BYTES} bytes, got {parent!r}")
    ns = _namespace_bytes(namespace)
    prev = _NO_PARENT if parent is None else parent
    fmt = f"<{page_size}q"
    out: list[bytes] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        try:
            payload = struct.pack(fmt, *page)
        except struct.error as exc:
            raise ValueError(
                f"token ids must be ints in [{_INT64_MIN}, {_INT64_MAX}], got page {page!r}"
            ) from exc
        prev = hashlib.sha256(_TAG + prev + ns + payload).digest()
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class RadixKey:
    """Token ids plus a namespace: the key of the radix tree.

    ``tokens`` is stored as a tuple of ints (any sequence is accepted and copied);
    ``namespace`` is a string ("" is the default namespace).
    """

    tokens: tuple[int, ...]
    namespace: str = ""

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        for t in tokens:
            # bool is an int subclass but never a token id.
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"RadixKey tokens must be ints, got {t!r}")
        if not isinstance(self.namespace, str):
            raise TypeError(f"RadixKey namespace must be a str, got {self.namespace!r}")
        object.__setattr__(self, "tokens", tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def num_pages(self, page_size: int) -> int:
        """Number of whole pages of ``page_size`` tokens in the key."""
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        return len(self.tokens) // page_size

    def page_aligned(self, page_size: int) -> RadixKey:
        """The key truncated to whole pages (self when already aligned)."""
        n = self.num_pages(page_size) * page_size
        if n == len(self.tokens):
            return self
        return RadixKey(self.tokens[:n], self.namespace)

    def page_hashes(self, page_size: int, parent: bytes | None = None) -> list[bytes]:
        """Chained hashes of the key's whole pages (see ``page_hashes``)."""
        return page_hashes(self.tokens, page_size, self.namespace, parent)
