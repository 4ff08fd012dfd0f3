"""Which writer meshes have stored objects under a namespace, without listing the store.

Every cache that writes to L3 records its :class:`MeshLayoutId` once, in a small
*entry* object (16 bytes: pp, cp, tp, cp_kv as int32) under the namespace. Entries sit
at numbered keys ``0, 1, 2, ...`` (a reserved page hash per index, slice ``L0-1.H0-1.T0-1``
of the ``kv`` region: no page hash of tokens can equal it except by a hash collision):
a writer takes the first index that is free or already holds its own id; a reader reads
entries from 0 up to the first miss and remembers them. Backends never rewrite an
existing object, so an entry is append-only; two writers racing for one index both read
it back and the loser moves on to the next one.

Cost: registration reads ``k + 1`` entries once per cache (``k`` known meshes). Later,
a reader does not read entries on its own: :meth:`LayoutRegistry.probe_key` hands out
(at most once per ``refresh_s``) the key of the next entry, which the L3 tier asks for in
the same batched existence query as its reshard probe (``l3_sources.py``), and
:meth:`LayoutRegistry.read_new` reads entries only when that key exists. Works with any
backend (only ``get``/``put``/existence of fixed-size objects under validated keys).
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.tiers.reshard import MeshLayoutId

log = logging.getLogger(__name__)

#: Most writer meshes recorded per namespace (entries past it are not read).
MAX_LAYOUTS = 64
_MODES = (CpKvMode.REPLICATE, CpKvMode.SHARD)
_ENTRY_SLICE = GlobalSlice((0, 1), (0, 1), (0, 1))


def entry_key(namespace: KeyNamespace, index: int) -> StorageKey:
    """The key of the ``index``-th layout entry of ``namespace``."""
    assert 0 <= index < MAX_LAYOUTS, index
    h = hashlib.blake2b(f"mesh-hicache/layouts/v1/{index}".encode(), digest_size=32).digest()
    return StorageKey(namespace, "kv", h, _ENTRY_SLICE)


def _encode(mid: MeshLayoutId) -> torch.Tensor:
    return torch.tensor([mid.pp, mid.cp, mid.tp, _MODES.index(mid.cp_kv)], dtype=torch.int32)


def _decode(t: torch.Tensor) -> MeshLayoutId | None:
    pp, cp, tp, mode = (int(x) for x in t.tolist())
    if min(pp, cp, tp) < 1 or not 0 <= mode < len(_MODES):
        return None
    return MeshLayoutId(pp, cp, tp, _MODES[mode])


class LayoutRegistry:
    """The writer meshes recorded under one namespace, as this rank last read them.

    Scheduler thread only (not thread-safe). Backend errors are logged and treated as
    "nothing recorded" (reshard is an optimisation; the same-mesh path does not need it).
    """

    def __init__(
        self, backend: StorageBackend, namespace: KeyNamespace, *, refresh_s: float = 2.0
    ) -> None:
        self._backend = backend
        self._namespace = namespace
        self._refresh_s = refresh_s
        self._known: list[MeshLayoutId] = []
        self._last = -float("inf")
        self.lookups = 0
        """Entry reads issued so far (for tests and cost accounting)."""

    @property
    def known(self) -> tuple[MeshLayoutId, ...]:
        """Recorded meshes in entry order (this cache's own included once registered)."""
        return tuple(self._known)

    def _read(self, index: int) -> MeshLayoutId | None:
        buf = torch.zeros(4, dtype=torch.int32)
        self.lookups += 1
        try:
            ok = self._backend.get_one(entry_key(self._namespace, index), buf)
        except Exception as exc:  # a backend that is down: no discovery, no failure
            log.warning("layout registry read failed: %s", exc)
            return None
        return _decode(buf) if ok else None

    def _read_new(self) -> None:
        while len(self._known) < MAX_LAYOUTS:
            mid = self._read(len(self._known))
            if mid is None:
                return
            self._known.append(mid)

    def probe_key(self) -> StorageKey | None:
        """The key of the next entry when a refresh is due (at most once per ``refresh_s``;
        None otherwise or when the table is full). Its existence means a new mesh was
        recorded: then call :meth:`read_new`."""
        now = time.monotonic()
        if now - self._last < self._refresh_s or len(self._known) >= MAX_LAYOUTS:
            return None
        self._last = now
        self.lookups += 1
        return entry_key(self._namespace, len(self._known))

    def read_new(self) -> tuple[MeshLayoutId, ...]:
        """Read the entries recorded since the last read; returns :attr:`known`."""
        self._read_new()
        return self.known

    def refresh(self, *, force: bool = False) -> tuple[MeshLayoutId, ...]:
        """Read entries recorded since the last refresh (at most once per ``refresh_s``
        unless ``force``); returns :attr:`known`."""
        now = time.monotonic()
        if force or now - self._last >= self._refresh_s:
            self._last = now
            self._read_new()
        return self.known

    def register(self, mid: MeshLayoutId) -> bool:
        """Record ``mid`` (idempotent); False when the table is full or the store fails."""
        self.refresh(force=True)
        while mid not in self._known:
            index = len(self._known)
            if index >= MAX_LAYOUTS:
                log.warning("layout registry full (%d meshes); %s not recorded", index, mid)
                return False
            try:
                self._backend.put_one(entry_key(self._namespace, index), _encode(mid))
            except Exception as exc:
                log.warning("layout registry write failed: %s", exc)
                return False
            got = self._read(index)  # a racing writer may have taken this index
            if got is None:
                return False
            self._known.append(got)
        return True
