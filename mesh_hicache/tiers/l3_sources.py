"""Where this rank's L3 pages and states can be read from: its own mesh's objects or,
resharded, those of another writer mesh recorded under the namespace.

:class:`SourceFinder` answers, for a run of chained page hashes, how many leading pages
this rank can assemble and from which mesh each comes (``None``: its own objects, the
fast path, checked first), and whether a boundary state exists in some mesh. Writer
meshes come from the layout registry (``discovery.py``); a plan per mesh
(``reshard.py``) is computed once and cached.

Cost of a miss: past what this mesh stored itself, *one* batched existence query
(``StorageBackend.exists_each``, one RPC on Mooncake) asks, for the first missing page,
the first object of every other recorded mesh and, when a registry refresh is due
(rate-limited), the next registry entry. Nothing there: the miss costs that one extra
lookup, whatever the number of recorded meshes. Only meshes that answered are probed
further, and a new registry entry is read only when the probe saw it.

Scheduler thread only (not thread-safe); no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh_hicache.choices import RegionName
from mesh_hicache.layout import RegionLayout, StateLayout
from mesh_hicache.storage.base import StorageBackend
from mesh_hicache.storage.keys import KeyNamespace, StorageKey
from mesh_hicache.tiers.discovery import LayoutRegistry
from mesh_hicache.tiers.reshard import MeshLayoutId, ObjectRead, SourcePlan, plan_source


class SourceFinder:
    """The sources of one rank's L3 reads; see the module docstring.

    ``layout.coords == (0, 0, 0)`` registers this mesh's layout (one writer per mesh).
    ``refresh_s``: least time between two registry probes.
    """

    def __init__(
        self,
        backend: StorageBackend,
        namespace: KeyNamespace,
        layout: StateLayout,
        *,
        refresh_s: float = 2.0,
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        self._layout = layout
        paged = layout.held_regions(paged=True)
        # A page's source is chosen by its whole-page regions; the windowed region is
        # stored only where a boundary needs it and asked per page (window_present).
        self._paged = tuple(r for r in paged if r.name is not RegionName.KV_WINDOW)
        self._window = next((r for r in paged if r.name is RegionName.KV_WINDOW), None)
        self._slotted = layout.held_regions(paged=False)
        self.own = MeshLayoutId.of(layout)
        self.registry = LayoutRegistry(backend, namespace, refresh_s=refresh_s)
        if layout.coords == (0, 0, 0):
            self.registry.register(self.own)
        else:
            self.registry.refresh(force=True)
        self._plans: dict[MeshLayoutId, SourcePlan | None] = {}

    def key(self, region: RegionLayout, page_hash: bytes) -> StorageKey:
        """The key of ``region``'s object for ``page_hash`` (this rank's global slice)."""
        return StorageKey(self.namespace, region.name.value, page_hash, region.global_slice)

    def source_key(self, region: str, read: ObjectRead, page_hash: bytes) -> StorageKey:
        """The key of another mesh's object ``read`` of ``region`` for ``page_hash``."""
        return StorageKey(self.namespace, region, page_hash, read.slice)

    # -- pages ---------------------------------------------------------------------------

    def local_hit(self, hashes: Sequence[bytes]) -> tuple[int, list[SourcePlan | None]]:
        """How many leading pages of ``hashes`` this rank can assemble, and each one's
        source mesh (None: its own objects). Not agreed; the state rule is the caller's."""
        n = self._run_length(None, hashes)
        sources: list[SourcePlan | None] = [None] * n
        if n == len(hashes):
            return n, sources
        candidates: list[SourcePlan | None] = [None, *self._probe(hashes[n])]
        while n < len(hashes) and len(candidates) > 1:
            runs = [(self._run_length(c, hashes[n:]), i) for i, c in enumerate(candidates)]
            best, i = max(runs, key=lambda r: (r[0], -r[1]))
            if not best:
                break
            sources += [candidates[i]] * best
            n += best
        return n, sources

    def other_sources(self) -> list[SourcePlan]:
        """Plans for the other writer meshes known so far (cached, no lookup)."""
        out: list[SourcePlan] = []
        for mid in self.registry.known:
            if mid == self.own:
                continue
            if mid not in self._plans:
                self._plans[mid] = plan_source(self._layout, mid)
            plan = self._plans[mid]
            if plan is not None and not plan.same_keys:
                out.append(plan)
        return out

    def _probe(self, page_hash: bytes) -> list[SourcePlan]:
        """The other meshes whose first object of ``page_hash`` exists: ONE batched query
        (plus the next registry entry when a refresh is due); reads new entries if seen."""
        entry = self.registry.probe_key()
        plans = self.other_sources() if self._paged else []
        first = self._paged[0] if self._paged else None
        keys = [
            self.source_key(first.name.value, p.region(first.name).reads[0], page_hash)
            for p in plans
            if first is not None
        ]
        if entry is not None:
            keys.append(entry)
        if not keys:
            return []
        found = self.backend.exists_each(keys)
        live = [p for p, ok in zip(plans, found, strict=False) if ok]
        if entry is not None and found[-1]:
            known = set(self.registry.known)
            self.registry.read_new()
            fresh = [p for p in self.other_sources() if p.writer not in known]
            live += [p for p in fresh if self._run_length(p, [page_hash])]
        return live

    def _run_length(self, source: SourcePlan | None, hashes: Sequence[bytes]) -> int:
        """Leading pages of ``hashes`` whose paged objects exist for ``source``."""
        n = len(hashes)
        for region in self._paged:
            if not n:
                return 0
            if source is None:
                n = min(n, self.backend.exists([self.key(region, h) for h in hashes[:n]]))
                continue
            for read in source.region(region.name).reads:
                keys = [self.source_key(region.name.value, read, h) for h in hashes[:n]]
                n = min(n, self.backend.exists(keys))
                if not n:
                    return 0
        return n

    def window_present(
        self, hashes: Sequence[bytes], sources: Sequence[SourcePlan | None]
    ) -> list[bool] | None:
        """Per page of ``hashes``, whether its windowed objects exist under ``sources``
        (that page's source; one batched query); None when this rank holds no windowed
        layer."""
        if self._window is None:
            return None
        return self._objects_in(hashes, sources, (self._window,))

    def window_elsewhere(
        self, hashes: Sequence[bytes], sources: list[SourcePlan | None], present: list[bool]
    ) -> None:
        """For each page whose windowed objects are not ``present`` under its source, look
        in the other meshes (one batched query per mesh, only while pages are missing)
        for one holding that page's windowed AND whole-page objects; where found, set the
        page's entry of ``sources`` to it and of ``present`` to True. A page's whole-page
        objects can exist under this mesh's keys while its windowed ones exist only under
        another's (a stage whose full layers the writer laid out alike)."""
        assert self._window is not None
        regions = (self._window, *self._paged)
        self.registry.refresh()
        for plan in self.other_sources():
            todo = [i for i, ok in enumerate(present) if not ok]
            if not todo:
                return
            found = self._objects_in([hashes[i] for i in todo], [plan] * len(todo), regions)
            for i, ok in zip(todo, found, strict=True):
                if ok:
                    present[i], sources[i] = True, plan

    def _objects_in(
        self,
        hashes: Sequence[bytes],
        sources: Sequence[SourcePlan | None],
        regions: Sequence[RegionLayout],
    ) -> list[bool]:
        """Per page, whether every object of ``regions`` exists under its source."""
        spans: list[int] = []
        keys: list[StorageKey] = []
        for h, src in zip(hashes, sources, strict=True):
            for region in regions:
                if src is None:
                    keys.append(self.key(region, h))
                else:
                    reads = src.region(region.name).reads
                    keys += [self.source_key(region.name.value, r, h) for r in reads]
            spans.append(len(keys))
        found = self.backend.exists_each(keys) if keys else []
        out, lo = [], 0
        for hi in spans:
            out.append(all(found[lo:hi]))
            lo = hi
        return out

    # -- states --------------------------------------------------------------------------

    def state_exists(self, page_hash: bytes) -> bool:
        """Whether some mesh (this one first) stored every state region at ``page_hash``."""
        if all(self.backend.exists_one(self.key(r, page_hash)) for r in self._slotted):
            return True
        return any(self._state_exists_in(src, page_hash) for src in self.other_sources())

    def _state_exists_in(self, source: SourcePlan, page_hash: bytes) -> bool:
        return all(
            self.backend.exists_one(self.source_key(r.name.value, read, page_hash))
            for r in self._slotted
            for read in source.region(r.name).reads
        )
