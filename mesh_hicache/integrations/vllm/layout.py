"""How vLLM's KV cache groups map onto storage keys (no vLLM import; specs are duck-typed).

A *page* is ``block_size`` tokens; its identity is the chained page hash of the library
(``radix/hashing.py``) over the request's tokens, salted with the tenant and a digest of
every group's geometry, so another block size, head count, head size or dtype is another
page. Each (page, group) is one storage object: the rows of that page's block in every
layer of the group, keyed by the group's global slice (layer range, KV head range of this
tensor-parallel rank, token range of the page).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.radix.hashing import pack_tokens, packed_page_hashes
from mesh_hicache.storage.keys import KeyNamespace, StorageKey

SUPPORTED_SPECS = ("FullAttentionSpec",)
"""vLLM KV cache spec classes the connector saves and restores. A model with a group of any
other kind (sliding window, Mamba / GDN state, ...) gets no hit from the connector: a hit
must restore every group at one boundary."""


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

    @property
    def supported(self) -> bool:
        return self.spec_kind in SUPPORTED_SPECS

    def head_range(self, tp_coord: int, tp_size: int) -> tuple[int, int]:
        """The global KV head range a tensor-parallel coordinate holds."""
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
            f"|shapes={getattr(spec, 'shapes', None)}|layers={','.join(group.layer_names)}"
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
    def supported(self) -> bool:
        """Every group can be stored and restored at one block boundary."""
        sizes = {g.block_size for g in self.groups}
        return bool(self.groups) and all(g.supported for g in self.groups) and len(sizes) == 1

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

    def keys(self, page_hash: bytes, tenant: str, tp_coord: int, tp_size: int) -> list[StorageKey]:
        """One key per group for the page ``page_hash`` as tensor-parallel ``tp_coord`` holds it."""
        ns = self.namespace(tenant)
        return [
            StorageKey(
                ns,
                "kv",
                page_hash,
                GlobalSlice(g.layer_range, g.head_range(tp_coord, tp_size), (0, g.block_size)),
            )
            for g in self.groups
        ]
