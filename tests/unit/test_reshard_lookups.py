"""The cost of a miss with other meshes recorded: one extra (batched) lookup, whatever
their number; and the probe still finds another mesh's pages (l3_sources.SourceFinder)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from mesh_hicache.choices import CpKvMode
from mesh_hicache.layout import all_layouts
from mesh_hicache.spec import KVSpec, MambaSpec, StateSpec
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageBackend, StorageKey
from mesh_hicache.tiers.discovery import LayoutRegistry
from mesh_hicache.tiers.l3_sources import SourceFinder
from mesh_hicache.tiers.reshard import MeshLayoutId

NS = KeyNamespace("m", "float32", 1)
SPEC = StateSpec(
    model_id="test-model",
    page_size=4,
    kv=KVSpec(layer_ids=(0, 2), num_kv_heads=4, head_dim=2),
    mamba=MambaSpec(
        layer_ids=(1, 3), conv_dim=8, conv_kernel=2, num_heads=4, head_dim=2, state_dim=2
    ),
)
R = CpKvMode.REPLICATE
OTHERS = [MeshLayoutId(1, 1, 2, R), MeshLayoutId(2, 1, 1, R), MeshLayoutId(1, 1, 4, R)]


class Counting(StorageBackend):
    """Counts every backend call by name (a call is one round trip to the store)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def exists(self, keys: Sequence[StorageKey]) -> int:
        self.calls["exists"] += 1
        return self.inner.exists(keys)

    def exists_each(self, keys: Sequence[StorageKey]) -> list[bool]:
        self.calls["exists_each"] += 1
        return self.inner.exists_each(keys)

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        self.calls["get"] += 1
        return self.inner.get(keys, dst)

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        self.calls["put"] += 1
        return self.inner.put(keys, src)


def _hashes(seed: int, n: int = 3) -> list[bytes]:
    return [bytes([seed, i]) * 4 for i in range(n)]


def _miss_calls(tmp_path, others: list[MeshLayoutId]) -> int:
    store = Counting(FileStorage(tmp_path / f"l3-{len(others)}"))
    for mid in others:
        LayoutRegistry(store, NS).register(mid)
    reader = all_layouts(SPEC, (1, 1, 1))[0]
    finder = SourceFinder(store, NS, reader, refresh_s=0.0)  # a registry probe on every miss
    assert set(finder.registry.known) == {*others, MeshLayoutId.of(reader)}
    store.calls.clear()
    n, _ = finder.local_hit(_hashes(9))
    assert n == 0
    return sum(store.calls.values())


def test_a_miss_costs_one_extra_lookup_whatever_the_number_of_meshes(tmp_path):
    alone = _miss_calls(tmp_path, [])
    assert alone == 2  # this mesh's own existence query, then the registry probe
    for k in (1, 2, 3):
        assert _miss_calls(tmp_path, OTHERS[:k]) == alone  # the same one batched probe


def test_the_probe_finds_another_meshs_pages_and_a_newly_recorded_mesh(tmp_path):
    store = Counting(FileStorage(tmp_path / "l3"))
    reader = all_layouts(SPEC, (1, 1, 1))[0]
    finder = SourceFinder(store, NS, reader, refresh_s=0.0)
    # A tp=2 mesh records itself and writes the KV objects of 3 pages after the reader
    # started: the reader learns of it through the probe of its next miss.
    writer = MeshLayoutId(1, 1, 2, R)
    LayoutRegistry(store, NS).register(writer)
    hashes = _hashes(5)
    for lay in all_layouts(SPEC, (1, 1, 2)):
        for region in lay.held_regions(paged=True):
            if region.is_writer:
                row = torch.ones(region.local_shape)
                keys = [StorageKey(NS, region.name.value, h, region.global_slice) for h in hashes]
                store.put(keys, [row] * len(keys))
    n, sources = finder.local_hit(hashes)
    assert n == 3 and all(s is not None and s.writer == writer for s in sources)
    assert finder.registry.known[-1] == writer
