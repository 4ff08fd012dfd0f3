"""Versioned storage key schema and the object format every backend shares.

docs/DESIGN.md section 8.

A key names one object: one page (or, for Mamba, one prefix-boundary slot) of one
region, for one shard's global slice, under one namespace::

    v1/<namespace digest>/<region>/<page hash hex>/<slice tag>

The namespace (model id, dtype, layout version, tenant salt) enters only as a digest,
so user-supplied strings never reach a path or a store key; every other component is
validated and drawn from a small alphabet. Any field mismatch gives a different key: a
miss, never a collision. ``KEY_PATTERN`` is the whole grammar; backends re-check key
strings against it before using them as paths.

The object format every backend stores (header, payload, optional chunk table) lives
in ``objects.py``; its names are re-exported here.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field

import torch

from mesh_hicache.choices import RegionName
from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage.objects import (
    CORRUPT_KINDS,
    FLAG_MAC,
    HEADER_SIZE,
    MIN_SECRET_BYTES,
    OBJECT_FORMAT_VERSION,
    OBJECT_MAGIC,
    PLAIN_CODEC,
    ObjectCodec,
    ObjectError,
    ObjectHeader,
    decode_object,
    encode_object,
    key_digest,
    payload_checksum,
    tensor_bytes,
)

__all__ = [
    "CORRUPT_KINDS",
    "FLAG_MAC",
    "HEADER_SIZE",
    "KEY_DIR_PATTERN",
    "KEY_PATTERN",
    "KEY_SCHEMA_VERSION",
    "MAX_PAGE_HASH_BYTES",
    "MIN_SECRET_BYTES",
    "OBJECT_FORMAT_VERSION",
    "OBJECT_MAGIC",
    "PLAIN_CODEC",
    "REGIONS",
    "KeyNamespace",
    "ObjectCodec",
    "ObjectError",
    "ObjectHeader",
    "StorageKey",
    "check_key_str",
    "decode_object",
    "encode_object",
    "key_digest",
    "payload_checksum",
    "tensor_bytes",
]

KEY_SCHEMA_VERSION = 1
"""Version of the key grammar; the ``v1`` prefix of every key string."""

REGIONS: tuple[str, ...] = RegionName.values()
"""Valid ``StorageKey.region`` values: one per separately stored host-pool region (the
``RegionName`` values)."""

MAX_PAGE_HASH_BYTES = 64
"""Longest accepted page hash (BLAKE2b-512 size); longer hashes are a ValueError."""

_NAMESPACE_DIGEST_BYTES = 16
_SLICE_TAG = r"L\d+-\d+\.H\d+-\d+\.T\d+-\d+"
KEY_PATTERN = re.compile(
    rf"v{KEY_SCHEMA_VERSION}/[0-9a-f]{{{2 * _NAMESPACE_DIGEST_BYTES}}}/"
    rf"(?:{'|'.join(REGIONS)})/[0-9a-f]{{2,{2 * MAX_PAGE_HASH_BYTES}}}/{_SLICE_TAG}"
)
"""Full grammar of a key string (use with ``fullmatch``). No '/' beyond the separators,
no '.' except inside the slice tag, never '..'."""
KEY_DIR_PATTERN = re.compile(KEY_PATTERN.pattern.rsplit("/", 1)[0])
"""Grammar of the directory of a key (a key string without its slice tag)."""


def _check_str(owner: str, name: str, value: object, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, got {type(value).__name__}: {value!r}")
    if not allow_empty and not value:
        raise ValueError(f"{owner}.{name} must not be empty")
    if "\x00" in value:
        raise ValueError(f"{owner}.{name} must not contain NUL, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything that must match for a stored object to be valid for this cache.

    ``model_id`` and ``tenant`` are free text (a model id like ``org/name`` is fine):
    they are only hashed into ``digest()``, never placed in a key verbatim. ``dtype``
    accepts a ``torch.dtype`` and stores its name (``torch.bfloat16`` -> ``"bfloat16"``).
    ``layout_version`` is bumped whenever the byte layout of stored objects changes.
    ``tenant`` salts the namespace so tenants never share objects ("" = shared).
    """

    model_id: str
    dtype: str
    layout_version: int
    tenant: str = ""
    _digest: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        _check_str("KeyNamespace", "model_id", self.model_id, allow_empty=False)
        _check_str("KeyNamespace", "dtype", self.dtype, allow_empty=False)
        _check_str("KeyNamespace", "tenant", self.tenant, allow_empty=True)
        version = self.layout_version
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(
                f"KeyNamespace.layout_version must be a non-negative int, got {version!r}"
            )
        # Every key string starts with it: computed once (the fields are frozen).
        object.__setattr__(self, "_digest", self._compute_digest())

    def digest(self) -> str:
        """32 lowercase hex chars identifying the namespace (BLAKE2b-128).

        Fields are length-prefixed before hashing, so no two distinct namespaces
        serialize to the same bytes (e.g. model ``"a"`` + tenant ``"bc"`` vs ``"ab"`` + ``"c"``).
        """
        return self._digest

    def _compute_digest(self) -> str:
        h = hashlib.blake2b(digest_size=_NAMESPACE_DIGEST_BYTES, person=b"mhc-namespace")
        for part in (self.model_id, self.dtype, str(self.layout_version), self.tenant):
            data = part.encode("utf-8")
            h.update(struct.pack("<Q", len(data)))
            h.update(data)
        return h.hexdigest()


def _check_range(name: str, value: object) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] < value[1]
    )
    if not ok:
        raise ValueError(
            f"StorageKey.slice.{name} must be a (start, end) pair of ints with "
            f"0 <= start < end, got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class StorageKey:
    """The key of one stored object: namespace / region / page hash / global slice.

    ``page_hash`` is the chained hash of the page (for Mamba regions: the last page hash
    of the node whose boundary state is stored), 1 to 64 bytes. ``slice`` is the shard's
    global slice (no rank numbers), so every rank holding the same slice shares objects.
    Invalid fields raise ValueError/TypeError on construction.
    """

    namespace: KeyNamespace
    region: str
    page_hash: bytes
    slice: GlobalSlice

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, KeyNamespace):
            raise TypeError(f"StorageKey.namespace must be a KeyNamespace, got {self.namespace!r}")
        if self.region not in REGIONS:
            raise ValueError(f"StorageKey.region must be one of {REGIONS}, got {self.region!r}")
        if isinstance(self.page_hash, bytearray | memoryview):
            object.__setattr__(self, "page_hash", bytes(self.page_hash))
        if not isinstance(self.page_hash, bytes):
            raise TypeError(f"StorageKey.page_hash must be bytes, got {self.page_hash!r}")
        if not 1 <= len(self.page_hash) <= MAX_PAGE_HASH_BYTES:
            raise ValueError(
                f"StorageKey.page_hash must be 1..{MAX_PAGE_HASH_BYTES} bytes, "
                f"got {len(self.page_hash)}"
            )
        if not isinstance(self.slice, GlobalSlice):
            raise TypeError(f"StorageKey.slice must be a GlobalSlice, got {self.slice!r}")
        _check_range("layers", self.slice.layers)
        _check_range("heads", self.slice.heads)
        _check_range("tokens", self.slice.tokens)

    def to_str(self, name_key: bytes | None = None) -> str:
        """The versioned key string; also a safe relative path (see ``KEY_PATTERN``).

        ``name_key`` (a backend's ``codec.name_key``, derived from its storage secret)
        replaces the namespace digest and the page hash by keyed digests of them, so
        without the secret nobody can tell which prefixes are stored, read them, or
        write, overwrite or remove an object under a name this secret's readers use.
        The grammar and the lengths stay the same.
        """
        ns, page = self.namespace.digest(), self.page_hash
        if name_key is not None:
            ns = hashlib.blake2b(
                ns.encode(), key=name_key, digest_size=_NAMESPACE_DIGEST_BYTES, person=b"mhc-ns"
            ).hexdigest()
            page = hashlib.blake2b(
                page,
                key=name_key,
                digest_size=len(page),
                salt=bytes.fromhex(ns)[:16],
                person=b"mhc-page",
            ).digest()
        key = f"v{KEY_SCHEMA_VERSION}/{ns}/{self.region}/{page.hex()}/{self.slice.tag()}"
        assert KEY_PATTERN.fullmatch(key), key
        return key

    def __str__(self) -> str:
        return self.to_str()


def check_key_str(key: str) -> str:
    """Return ``key`` if it is a well-formed key string, else raise ValueError.

    Backends call this on every key before using it as a path or store key, so a key
    object that bypassed validation still cannot escape (no '..', no absolute path).
    """
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError(
            f"not a valid storage key string: {key!r} (expected {KEY_PATTERN.pattern})"
        )
    return key
