"""How vLLM's KV cache groups map onto storage keys (no vLLM import; specs are duck-typed).

A *page* is ``block_size`` tokens; its identity is the chained page hash of the library
(``radix/hashing.py``) over the request's tokens, salted with the tenant and a digest of
every group's geometry, so another block size, head count, head size or dtype is another
page. Each (page, group) is one storage object keyed by the group's global slice (layer
range, head range of this tensor-parallel rank, token range of the page):

- a *KV* group (full attention) stores the rows of the page's block in every layer;
- a *state* group (Mamba-2 / GDN in vLLM's ``align`` prefix-caching mode) stores the
  recurrent state (conv and SSM bytes as vLLM lays them out in one block) after the page's
  last token, i.e. at the page's end boundary. vLLM offers such states only at some
  boundaries, so a page may have its KV objects without its state object.

A hit of ``k`` pages needs every KV group's object of pages ``0..k-1`` and every state
group's object of page ``k-1``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.radix.hashing import pack_tokens, packed_page_hashes
from mesh_hicache.storage.keys import KeyNamespace, StorageKey

KV_SPECS = ("FullAttentionSpec",)
"""vLLM KV cache spec classes stored page by page."""
WINDOW_SPECS = ("SlidingWindowSpec",)
"""vLLM spec classes stored page by page where vLLM still holds the pages (the window
before a request's end); a hit needs only the pages inside the window before its end."""
STATE_SPECS = ("MambaSpec",)
"""vLLM spec classes whose state is stored at page boundaries (only in ``align`` mode,
without speculative blocks). A model with a group of any other kind (sliding window,
chunked local attention, Mamba outside ``align`` mode, ...) gets no hit from the connector:
a hit must restore every group at one boundary."""


def group_role(spec: object) -> str:
    """``"kv"``, ``"state"`` or ``""`` (a group the connector cannot restore)."""
    kind = type(spec).__name__
    if kind in KV_SPECS:
        return "kv"
    if kind in WINDOW_SPECS and int(getattr(spec, "sliding_window", 0) or 0) > 0:
        return "window"
    if (
        kind in STATE_SPECS
        and getattr(spec, "mamba_cache_mode", None) == "align"
        and int(getattr(spec, "num_speculative_blocks", 0) or 0) == 0
    ):
        return "state"
    return ""


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One vLLM KV cache group as the connector stores it."""

    group_id: int
    spec_kind: str
    block_size: int
    layer_names: tuple[str, ...]
    layer_range: tuple[int, int]
    """Global layer ids (positions among every layer of every group) it covers."""
    total_kv_heads: int
    local_kv_heads: int
    geometry: str
    """A text form of everything that shapes its bytes (enters the page hashes)."""
    role: str = "kv"
    """``"kv"`` (per-page KV), ``"window"`` (per-page KV, needed only inside the sliding
    window), ``"state"`` (state at page boundaries) or ``""``."""
    window: int = 0
    """Sliding window in tokens plus the tokens vLLM retains below it (``"window"``)."""

    @property
    def supported(self) -> bool:
        return self.role in ("kv", "window", "state")

    def need_from(self, k: int) -> int:
        """The first page whose object of this group a hit of ``k`` pages restores (the
        pages ``need_from(k)..k-1``; vLLM's own rule for what it keeps per group)."""
        if self.role == "state":
            return k - 1
        if self.role == "window":
            return max(0, (k * self.block_size - self.window + 1) // self.block_size)
        return 0

    @property
    def region(self) -> str:
        return "mamba_ssm" if self.role == "state" else "kv"

    def head_range(self, tp_coord: int, tp_size: int) -> tuple[int, int]:
        """The global head range a tensor-parallel coordinate holds (a state group: the
        rank's shard index, as vLLM shards the state by heads in rank order)."""
        if self.role == "state":
            return (tp_coord, tp_coord + 1)
        if self.total_kv_heads >= tp_size:
            return (tp_coord * self.local_kv_heads, (tp_coord + 1) * self.local_kv_heads)
        h = tp_coord * self.total_kv_heads // tp_size  # replicated heads: one head per rank
        return (h, h + 1)


def group_layouts(kv_cache_config: object, total_kv_heads: int) -> tuple[GroupLayout, ...]:
    """The layouts of every KV cache group of a vLLM ``KVCacheConfig``."""
    groups = list(kv_cache_config.kv_cache_groups)  # type: ignore[attr-defined]
    order = {name: i for i, name in enumerate(sorted(n for g in groups for n in g.layer_names))}
    out = []
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        ids = [order[n] for n in group.layer_names]
        heads = int(getattr(spec, "num_kv_heads", 1) or 1)
        geometry = (
            f"{type(spec).__name__}|bs={spec.block_size}|heads={heads}"
            f"|head={getattr(spec, 'head_size', 0)}|v={getattr(spec, 'head_size_v', 0)}"
            f"|dtype={getattr(spec, 'dtype', '')}|window={getattr(spec, 'sliding_window', None)}"
            f"|shapes={getattr(spec, 'shapes', None)}|dtypes={getattr(spec, 'dtypes', None)}"
            f"|mode={getattr(spec, 'mamba_cache_mode', None)}|layers={','.join(group.layer_names)}"
        )
        out.append(
            GroupLayout(
                group_id=gid,
                spec_kind=type(spec).__name__,
                block_size=int(spec.block_size),
                layer_names=tuple(group.layer_names),
                layer_range=(min(ids), max(ids) + 1),
                total_kv_heads=max(total_kv_heads, heads),
                local_kv_heads=heads,
                geometry=geometry,
                role=group_role(spec),
                window=int(getattr(spec, "sliding_window", 0) or 0)
                + int(getattr(spec, "extra_retained_tokens", 0) or 0),
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class KeyPlan:
    """Keys of one engine's objects: namespace inputs and the group layouts."""

    model_id: str
    dtype: str
    layout_version: int
    groups: tuple[GroupLayout, ...]

    @property
    def page_size(self) -> int:
        return self.groups[0].block_size

    @property
    def kv_groups(self) -> frozenset[int]:
        """Indices (into ``groups``) of the per-page KV groups."""
        return frozenset(i for i, g in enumerate(self.groups) if g.role == "kv")

    @property
    def window_groups(self) -> frozenset[int]:
        """Indices of the sliding-window groups."""
        return frozenset(i for i, g in enumerate(self.groups) if g.role == "window")

    @property
    def attention_groups(self) -> frozenset[int]:
        """Full-attention and sliding-window groups: their layers are attention layers,
        which vLLM stops at (``wait_for_layer_load``) before they run."""
        return self.kv_groups | self.window_groups

    def groups_for(self, page: int, k: int) -> tuple[int, ...]:
        """The groups whose object of page ``page`` a hit of ``k`` pages restores."""
        return tuple(i for i, g in enumerate(self.groups) if g.need_from(k) <= page < k)

    def best_hit(self, avail: list[set[int]], start: int = 0) -> int:
        """The longest hit ``k`` (0: none beyond ``start``) such that every group's pages
        ``need_from(k)..k-1`` are in ``avail`` (group indices per page; pages below
        ``start`` are the engine's own and count as held)."""
        kv = self.kv_groups
        others = [g for g in range(len(self.groups)) if g not in kv]
        best = 0
        for k in range(start + 1, len(avail) + 1):
            if not kv <= avail[k - 1]:  # KV of every page: the run ends here
                break
            if all(
                i < start or g in avail[i]
                for g in others
                for i in range(self.groups[g].need_from(k), k)
            ):
                best = k
        return best

    @property
    def state_groups(self) -> frozenset[int]:
        """Indices of the boundary-state groups (empty for attention-only models)."""
        return frozenset(i for i, g in enumerate(self.groups) if g.role == "state")

    @property
    def supported(self) -> bool:
        """Every group can be stored and restored at one block boundary (and there is at
        least one KV group: a page's identity is its tokens' KV)."""
        sizes = {g.block_size for g in self.groups}
        return bool(self.kv_groups) and all(g.supported for g in self.groups) and len(sizes) == 1

    def hash_namespace(self, tenant: str) -> str:
        geometry = hashlib.blake2b(
            "\n".join(g.geometry for g in self.groups).encode(), digest_size=16
        ).hexdigest()
        return f"{tenant}\x00{geometry}"

    def page_hashes(self, tokens: list[int], tenant: str) -> list[bytes]:
        """Chained hashes of the whole pages of ``tokens`` under ``tenant``."""
        return packed_page_hashes(pack_tokens(tokens), self.page_size, self.hash_namespace(tenant))

    def namespace(self, tenant: str) -> KeyNamespace:
        return KeyNamespace(self.model_id, self.dtype, self.layout_version, tenant)

    def keys(
        self,
        page_hash: bytes,
        tenant: str,
        tp_coord: int,
        tp_size: int,
        groups: Iterable[int] | None = None,
    ) -> list[StorageKey]:
        """One key per group (all, or the indices ``groups`` in that order) for the page
        ``page_hash`` as tensor-parallel ``tp_coord`` holds it."""
        ns = self.namespace(tenant)
        ids = range(len(self.groups)) if groups is None else groups
        out = []
        for i in ids:
            g = self.groups[i]
            heads = g.head_range(tp_coord, tp_size)
            out.append(
                StorageKey(
                    ns, g.region, page_hash, GlobalSlice(g.layer_range, heads, (0, g.block_size))
                )
            )
        return out
