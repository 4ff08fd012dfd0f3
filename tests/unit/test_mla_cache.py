"""MLA latent KV (keys only, replicated over tp) and lightning-indexer keys in the cache.

Layouts and writer election over meshes (also mixed with a tp-sharded recurrent family),
no V allocated, copied or stored, bit-exact L1/L2/L3 round trips, the hit rule (a page
counts only where its latent AND its indexer objects exist), and the engine paging an
MLA state (``SeqState.latent`` / ``index_k``) with exact resume from every tier.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import RegionName, StateLayout, all_layouts
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.spec import Family, KVSpec, StateSpec
from runtime.engine import Engine
from runtime.model.parallel import MeshComms
from runtime.model.state import SeqState
from tests.unit.cache_support import (
    PS,
    hashes_of,
    make_config,
    make_mla_spec,
    poison_free_device,
    serve,
    stored_objects,
)

A = list(range(100, 112))  # 3 pages
B = list(range(200, 212))
C = list(range(300, 312))


@pytest.fixture
def make_cache(one_rank_topology):
    caches: list[HiCache] = []

    def build(root: Path | None = None, *, recurrent: bool = False, **overrides) -> HiCache:
        spec = make_mla_spec(recurrent=recurrent)
        cache = HiCache(one_rank_topology, spec, make_config(root, **overrides))
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()


# -- the spec and its layout -------------------------------------------------------------


def test_keys_only_kv_allocates_and_moves_no_v():
    spec = make_mla_spec()
    assert spec.kv is not None and spec.kv.num_parts == 1
    lay = StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))
    kv = lay.region(RegionName.KV)
    assert kv.local_shape == (4, 1, PS, 1, 3) and kv.global_shape == (4, 1, PS, 1, 3)
    with_v = dataclasses.replace(spec, kv=dataclasses.replace(spec.kv, values=True))
    assert StateLayout.for_coords(with_v, (1, 1, 1), (0, 0, 0)).region("kv").row_bytes == (
        2 * kv.row_bytes
    )
    # One page: 4 layers x PS tokens of the 3-wide float32 latent + 2-wide float16 keys.
    assert lay.page_bytes == 4 * PS * 3 * 4 + 4 * PS * 2 * 2
    dev = DevicePools(lay, num_pages=3)
    assert dev.k(0).shape == (3, PS, 1, 3) and dev.indexer(0).shape == (3, PS, 2)
    assert dev.nbytes == 3 * lay.page_bytes
    with pytest.raises(ValueError, match="keys only"):
        dev.v(0)


def test_values_is_part_of_what_a_spec_is():
    a = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=4, mla=True, values=False)
    b = KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=4, mla=True)
    assert a != b and b.num_parts == 2
    assert StateSpec(model_id="test-model", page_size=4, kv=a) != StateSpec(
        model_id="test-model", page_size=4, kv=b
    )
    with pytest.raises(ValueError, match="KVSpec.values must be a bool"):
        KVSpec(layer_ids=(0,), num_kv_heads=1, head_dim=4, values=0)  # type: ignore[arg-type]


MESHES = [
    ((1, 1, 2), "replicate"),
    ((1, 2, 1), "shard"),
    ((1, 2, 2), "replicate"),
    ((1, 2, 2), "shard"),
    ((2, 1, 2), "replicate"),
    ((2, 2, 2), "shard"),
    ((2, 2, 2), "replicate"),
]


@pytest.mark.parametrize("recurrent", [False, True], ids=["mla", "mla+mamba"])
@pytest.mark.parametrize(("shape", "cp_kv"), MESHES, ids=[f"{s}-{m}" for s, m in MESHES])
def test_placements_and_one_writer_per_distinct_shard(shape, cp_kv, recurrent):
    spec = make_mla_spec(recurrent=recurrent)
    pp, cp, tp = shape
    sharded = cp_kv == "shard" and cp > 1
    writers: Counter[tuple[str, str]] = Counter()
    for lay in all_layouts(spec, shape, cp_kv):
        _, c, t = lay.coords
        for r in lay.held_regions():
            writers[(r.name.value, r.global_slice.tag())] += r.is_writer
            if r.family is Family.MAMBA:
                # rank-local over tp: every tp rank (of cp coordinate 0) writes its shard
                assert r.placements[2] == Shard(2) and r.placements[1] == Replicate()
                assert r.is_writer == (c == 0)
            else:
                assert r.placements[2] == Replicate(), r  # the latent and keys: replicated
                token_dim = 3 if r.name is RegionName.KV else 2
                want = Shard(token_dim) if sharded else Replicate()
                assert r.placements[1] == want and r.placements[0] == Shard(1)
                assert r.is_writer == (t == 0 and (c == 0 or sharded))
    assert writers and all(n == 1 for n in writers.values()), writers
    per_region = Counter(region for region, _ in writers)
    assert per_region["kv"] == per_region["indexer"] == pp * (cp if sharded else 1)
    if recurrent:
        assert per_region["mamba_conv"] == per_region["mamba_ssm"] == pp * tp


# -- round trips and the hit rule --------------------------------------------------------


@pytest.mark.parametrize("recurrent", [False, True], ids=["mla", "mla+mamba"])
def test_every_tier_round_trip_is_bit_exact(make_cache, tmp_path, recurrent):
    root = tmp_path / "l3"
    cache = make_cache(root, recurrent=recurrent, write_policy="write_through", device_pages=6)
    assert serve(cache, A, checkpoints=(2, 3)).prefix == 0
    got = serve(cache, A)
    assert got.served == (12, 0, 0) and got.mismatches == 0
    # B and C push A's pages (and states) off the 6 device pages; A's copy is on host
    # (flushed first: a node whose backup is still in flight cannot leave the device, and
    # the cost policy's order depends on which copies exist, so without it the victim
    # would depend on the backup thread's timing).
    cache.flush()
    serve(cache, B, checkpoints=(3,))
    serve(cache, C, checkpoints=(3,))
    cache.flush()
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.served == (0, 12, 0) and got.mismatches == 0
    cache.flush()
    cache.check_integrity()
    cache.close()
    files = Counter(region for region, _, _ in stored_objects(root))
    # Per stored page one latent and one indexer object; no V object anywhere.
    assert files["kv"] == files["indexer"] == 9
    second = make_cache(root, recurrent=recurrent)
    poison_free_device(second)
    got = serve(second, A)
    assert got.hit.storage_tokens == 12 and got.served == (0, 0, 12) and got.mismatches == 0
    second.flush()
    second.check_integrity()


def _object_path(root: Path, region: str, page_hash: bytes) -> Path:
    hits = [o for o in stored_objects(root) if o[0] == region and o[1] == page_hash.hex()]
    assert len(hits) == 1, hits
    return root.joinpath("v1", os.listdir(root / "v1")[0], region, hits[0][1], hits[0][2])


@pytest.mark.parametrize("missing", ["indexer", "kv"])
def test_l3_page_counts_only_with_latent_and_indexer(make_cache, tmp_path, missing):
    root = tmp_path / "l3"
    writer = make_cache(root)
    serve(writer, A)
    writer.close()
    _object_path(root, missing, hashes_of(A)[2]).unlink()
    cache = make_cache(root)
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 8 and got.served == (0, 0, 8) and got.mismatches == 0
    # A page without either family at the very start: nothing at all.
    _object_path(root, "indexer" if missing == "kv" else "kv", hashes_of(A)[0]).unlink()
    other = make_cache(root)
    assert serve(other, A).hit.storage_tokens == 0


def test_mixed_spec_l3_hit_needs_pages_and_state(make_cache, tmp_path):
    root = tmp_path / "l3"
    writer = make_cache(root, recurrent=True)
    serve(writer, A, checkpoints=(1, 2, 3))
    writer.close()
    hashes = hashes_of(A)
    _object_path(root, "indexer", hashes[2]).unlink()  # page 3's keys: hit ends at page 2
    _object_path(root, "mamba_ssm", hashes[1]).unlink()  # and page 2 has no state: page 1
    cache = make_cache(root, recurrent=True)
    poison_free_device(cache)
    got = serve(cache, A)
    assert got.hit.storage_tokens == 4 and got.served == (0, 0, 4) and got.mismatches == 0


# -- the engine pages an MLA state -------------------------------------------------------


class FakeMLAModel:
    """Stands in for the MLA model so the engine's paging is tested on its own: per layer
    a latent row and indexer key per token, each depending on the token and on the
    previous row (a wrong cached row changes every later one), and logits from a top-2
    selection of latent rows by indexer score over ALL positions (cached ones included).
    The same arithmetic on the same rows gives bit-identical logits."""

    def __init__(self, spec: StateSpec, vocab: int = 64) -> None:
        assert spec.kv is not None and spec.indexer is not None
        self.page_size = spec.page_size
        self.cp_kv = "replicate"
        self.comms = MeshComms.solo()
        self.local_layers = tuple(range(spec.num_layers))
        self.dim, self.key_dim = spec.kv.head_dim, spec.indexer.key_dim
        g = torch.Generator().manual_seed(0)
        self.embed = torch.randn(vocab, self.dim, generator=g)
        self.key_embed = torch.randn(vocab, self.key_dim, generator=g)
        self.query = torch.randn(self.key_dim, generator=g)
        self.head = torch.randn(self.dim, vocab, generator=g)
        self.calls = 0

    def new_state(self) -> SeqState:
        state = SeqState()
        for layer in self.local_layers:
            state.latent[layer] = torch.zeros(0, self.dim)
            state.index_k[layer] = torch.zeros(0, self.key_dim, dtype=torch.float16)
        return state

    def _step(self, token: int, state: SeqState) -> torch.Tensor:
        self.calls += 1
        h = torch.zeros(self.dim)
        for layer in self.local_layers:
            lat, keys = state.latent[layer], state.index_k[layer]
            prev = lat[-1] if lat.shape[0] else torch.zeros(self.dim)
            row = 0.5 * prev + self.embed[token] + layer
            carry = 0.25 * keys[-1].float() if keys.shape[0] else torch.zeros(self.key_dim)
            key = self.key_embed[token] + carry
            state.latent[layer] = lat = torch.cat([lat, row[None]])
            state.index_k[layer] = keys = torch.cat([keys, key.half()[None]])
            top = torch.topk(keys.float() @ self.query, min(2, keys.shape[0])).indices
            h = h + lat[top].sum(0)
        state.num_tokens += 1
        return h @ self.head

    def prefill(self, tokens: torch.Tensor, state: SeqState) -> torch.Tensor:
        logits = torch.empty(0)
        for t in tokens.tolist():
            logits = self._step(int(t), state)
        return logits

    def decode(self, token: int, state: SeqState) -> torch.Tensor:
        return self._step(token, state)


def test_engine_resumes_an_mla_state_exactly_from_every_tier(one_rank_topology, tmp_path):
    spec = make_mla_spec()
    model = FakeMLAModel(spec)
    ref = Engine(model, None, max_new_tokens=5, keep_logits=True)  # type: ignore[arg-type]
    config = HiCacheConfig(
        device_pages=8,
        host_pages=64,
        storage="file",
        storage_options={"root": str(tmp_path / "l3")},
        prefetch_threshold=PS,
        transfer="cpu",
    )
    rng = random.Random(3)
    a = [rng.randrange(64) for _ in range(4 * PS + 2)]

    def check(engine: Engine, prompt: list[int], tier: int) -> None:
        got, want = engine.serve(prompt), ref.serve(prompt)
        assert got.output_ids == want.output_ids
        assert got.last_logits == want.last_logits  # bit-identical
        served = (got.cached_device, got.cached_host, got.cached_storage)
        assert served[tier] > 0 and sum(served) == served[tier], served

    cache = HiCache(one_rank_topology, spec, config)
    engine = Engine(model, cache, max_new_tokens=5, keep_logits=True)  # type: ignore[arg-type]
    engine.serve(a)
    turn = a + [rng.randrange(64) for _ in range(3)]
    check(engine, turn, 0)
    assert engine.serve(a).cached_device == 4 * PS  # one token short of the prompt: 4 pages
    for _ in range(2):  # push a's pages to host
        engine.serve([rng.randrange(64) for _ in range(5 * PS)])
    check(engine, a + [7], 1)
    cache.flush()
    cache.check_integrity()
    cache.close()
    cache = HiCache(one_rank_topology, spec, config)
    engine = Engine(model, cache, max_new_tokens=5, keep_logits=True)  # type: ignore[arg-type]
    check(engine, a + [9, 9], 2)
    cache.check_integrity()
    cache.close()
