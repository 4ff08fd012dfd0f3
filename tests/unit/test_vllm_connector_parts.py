"""The vLLM connector's scheduler and worker logic without vLLM: fake KV tensors and
requests, the real file store. Saves, L2 hits, an L3 prefetch by a fresh scheduler/worker
pair (another engine), tenants, a corrupt object, the hybrid rule and the model identity."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mesh_hicache.integrations.vllm.config import ConnectorConfig
from mesh_hicache.integrations.vllm.identity import connector_model_id
from mesh_hicache.integrations.vllm.layout import GroupLayout, KeyPlan
from mesh_hicache.integrations.vllm.scheduler import ConnectorScheduler
from mesh_hicache.integrations.vllm.worker import ConnectorWorker, LayerLoads
from mesh_hicache.storage.factory import open_storage

BLOCK = 4
NUM_BLOCKS = 12
LAYERS = ("l0", "l1")


def _group(
    kind: str = "FullAttentionSpec", layers: tuple[str, ...] = LAYERS, gid: int = 0, role: str = ""
) -> GroupLayout:
    return GroupLayout(
        group_id=gid,
        spec_kind=kind,
        block_size=BLOCK,
        layer_names=layers,
        layer_range=(0, 2),
        total_kv_heads=2,
        local_kv_heads=2,
        geometry=f"{kind}|bs={BLOCK}",
        role=role or ("kv" if kind == "FullAttentionSpec" else ""),
    )


def _plan(kind: str = "FullAttentionSpec", layers: tuple[str, ...] = LAYERS) -> KeyPlan:
    return KeyPlan("weights:test", "float32", 1, (_group(kind, layers),))


class _Engine:
    """One engine's connector halves over fake paged KV ``[blocks, 2, BLOCK, heads, dim]``."""

    def __init__(
        self,
        root: Path,
        host_pages: int,
        plan: KeyPlan | None = None,
        secret: bytes | None = None,
        layerwise: bool = True,
    ) -> None:
        plan = plan or _plan()
        page_bytes = 2 * 2 * BLOCK * 2 * 8 * 4
        config = ConnectorConfig.from_extra(
            {
                "storage_root": str(root),
                "host_bytes": host_pages * page_bytes,
                "layerwise_load": layerwise,
            }
        )
        self.sched = ConnectorScheduler(
            config,
            plan,
            open_storage("file", root=str(root), secret=secret),
            page_bytes=page_bytes,
            num_workers=1,
            tp_size=1,
        )
        self.worker = ConnectorWorker(
            plan,
            open_storage("file", root=str(root), secret=secret),
            tp_coord=0,
            tp_size=1,
            stats_file=None,
            layerwise_load=config.layerwise_load,
        )
        self.kv = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 8) for n in LAYERS}
        self.worker.register(self.kv, NUM_BLOCKS)

    def step(self) -> None:
        """One vLLM step: orders before the forward, each attention layer waiting for
        its loads, then the end of the forward."""
        self.worker.apply(self.sched.take_orders())
        for n in LAYERS:
            self.worker.wait_for_layer_load(n)
        self.worker.after_forward()
        self.worker._io.submit(lambda: None).result()  # let the I/O thread drain
        report = self.worker.take_report()
        if report is not None:
            self.sched.worker_report(report)

    def hit(self, req: SimpleNamespace, local: int = 0) -> int:
        """Ask for a hit until any prefetch lands; allocate blocks 0.. and load."""
        for _ in range(5):
            n, is_async = self.sched.num_new_matched_tokens(req, local)
            assert not is_async
            if n is not None:
                break
            self.step()
        assert n is not None
        blocks = list(range(len(req.all_token_ids) // BLOCK + 1))
        self.sched.after_alloc(req, (blocks,), n)
        self.step()
        return n


def _request(rid: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_prompt_tokens=len(tokens),
        num_computed_tokens=len(tokens),
        cache_salt=salt,
    )


def _fill(engine: _Engine, blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in engine.kv.values():
        for b in blocks:
            t[b] = torch.randn(t[b].shape, generator=g)


def _finish(engine: _Engine, req: SimpleNamespace, blocks: list[int]) -> None:
    assert engine.sched.request_finished(req, (blocks,))
    engine.step()
    assert req.request_id in engine.worker.take_finished_saves()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "before-forward"])
def test_save_then_l2_then_l3_in_another_engine(tmp_path: Path, layerwise: bool) -> None:
    tokens = list(range(1, 1 + 3 * BLOCK + 2))  # 3 whole pages + 2 tokens
    a = _Engine(tmp_path, host_pages=8, layerwise=layerwise)
    _fill(a, [0, 1, 2], seed=1)
    _finish(a, _request("r1", tokens), [0, 1, 2, 3])
    a.worker._io.submit(lambda: None).result()
    expect = {n: t[:3].clone() for n, t in a.kv.items()}
    # Same engine, device blocks gone: the pages come back from L2.
    for t in a.kv.values():
        t.zero_()
    assert a.hit(_request("r2", tokens)) == 3 * BLOCK
    assert a.sched.counters.l2_hit_tokens == 3 * BLOCK
    for n in LAYERS:
        assert torch.equal(a.kv[n][:3], expect[n])
    # Another engine (fresh L2) on the same store: L3 prefetch, then load, same bytes.
    b = _Engine(tmp_path, host_pages=8, layerwise=layerwise)
    assert b.hit(_request("r3", tokens + [99])) == 3 * BLOCK
    assert b.sched.counters.l3_hit_tokens == 3 * BLOCK
    for n in LAYERS:
        assert torch.equal(b.kv[n][:3], expect[n])
    # A vLLM device hit of 2 pages leaves one page for the connector.
    c = _Engine(tmp_path, host_pages=8)
    assert c.hit(_request("r4", tokens), local=2 * BLOCK) == BLOCK
    # Another tenant shares nothing (not in L2, not in L3).
    assert a.hit(_request("r5", tokens, salt="alice")) == 0
    assert c.hit(_request("r6", tokens, salt="alice")) == 0


def test_a_layer_waits_only_for_its_own_loads() -> None:
    """The forward may run layer 0 while layer 1's pages are still being copied; a
    failed copy is raised to the layer that waits, and to every later wait."""
    copied: list[str] = []
    release = threading.Event()

    def slow() -> None:
        assert release.wait(30)
        copied.append("l1")

    loads = LayerLoads([("l0", lambda: copied.append("l0")), ("l1", slow)])
    worker = threading.Thread(target=loads.run)
    worker.start()
    loads.wait("l0")
    loads.wait("not-a-kv-layer")  # a layer with nothing to load never waits
    assert copied == ["l0"]
    release.set()
    loads.wait("l1")
    loads.wait_all()
    worker.join()
    assert copied == ["l0", "l1"]

    def broken() -> None:
        raise OSError("copy failed")

    failing = LayerLoads([("l0", broken), ("l1", lambda: None)])
    failing.run()
    with pytest.raises(RuntimeError, match="loading KV pages"):
        failing.wait("l1")
    with pytest.raises(RuntimeError, match="loading KV pages"):
        failing.wait_all()


def test_layers_load_in_model_order(tmp_path: Path) -> None:
    """Layer-wise loads follow the model's layer numbers across the full-attention and
    sliding-window groups (layer 10 after layer 2), whatever order vLLM lists them in."""
    full = ("model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn")
    window = ("model.layers.3.self_attn.attn",)
    groups = (_group(layers=full), _group("SlidingWindowSpec", window, gid=1, role="window"))
    plan = KeyPlan("weights:test", "float32", 1, groups)
    worker = ConnectorWorker(plan, None, tp_coord=0, tp_size=1, stats_file=None)
    kv = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 8) for n in full + window}
    worker.register(kv, NUM_BLOCKS)
    assert [layer for layer, _ in worker._kv_layers] == [full[1], window[0], full[0]]
    # Each layer's part of its group's page starts where the previous listed one ends.
    parts = {layer: parts[0][::2] for layer, parts in worker._kv_layers}
    row = worker.groups[0][0].row_bytes
    assert parts == {full[0]: (0, 0), full[1]: (0, row), window[0]: (1, 0)}
    worker.close()


def test_corrupt_object_is_a_miss(tmp_path: Path) -> None:
    tokens = list(range(1, 1 + 2 * BLOCK + 1))
    a = _Engine(tmp_path, host_pages=8)
    _fill(a, [0, 1], seed=2)
    _finish(a, _request("r1", tokens), [0, 1, 2])
    a.worker._io.submit(lambda: None).result()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 2
    # The second page's object: flip one payload byte.
    second = a.sched.plan.keys(a.sched.plan.page_hashes(tokens, "")[1], "", 0, 1)[0]
    path = a.worker.storage.backend.object_path(second)  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    b = _Engine(tmp_path, host_pages=8)
    assert b.hit(_request("r2", tokens)) == BLOCK  # only the intact first page
    assert b.sched.counters.prefetch_failed_pages == 1


def test_no_l2_goes_through_to_l3(tmp_path: Path) -> None:
    tokens = list(range(1, 1 + 2 * BLOCK + 1))
    a = _Engine(tmp_path, host_pages=0)
    _fill(a, [0, 1], seed=3)
    _finish(a, _request("r1", tokens), [0, 1, 2])
    a.worker._io.submit(lambda: None).result()
    assert a.worker.host == {}
    assert a.hit(_request("r2", tokens)) == 2 * BLOCK
    assert a.sched.counters.l3_hit_tokens == 2 * BLOCK


def test_unrestorable_group_gives_no_hit(tmp_path: Path) -> None:
    tokens = list(range(1, 1 + 2 * BLOCK + 1))
    a = _Engine(tmp_path, host_pages=8, plan=_plan("SlidingWindowSpec"))
    assert not a.sched.request_finished(_request("r1", tokens), ([0, 1, 2],))
    r2 = _request("r2", tokens)
    for _ in range(3):  # asked again while it waits
        assert a.sched.num_new_matched_tokens(r2, 0) == (0, False)
    a.sched.after_alloc(r2, ([0, 1, 2],), 0)
    assert a.sched.counters.unsupported_requests == 1
    assert a.sched.counters.requests == 1


def test_waiting_request_is_hashed_looked_up_and_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks again at every step while a request waits (a hybrid's prefill chunk must
    end at a block boundary, so none is admitted while another decodes): the prompt is
    hashed and L3 asked once; the request counts once, when admitted, with the L2 pages
    saved meanwhile as its hit."""
    tokens = list(range(1, 1 + 3 * BLOCK + 2))
    a = _Engine(tmp_path, host_pages=8)
    hashed, asked = [], []
    page_hashes, exists_each = KeyPlan.page_hashes, a.sched.storage.exists_each
    monkeypatch.setattr(KeyPlan, "page_hashes", lambda *x: hashed.append(1) or page_hashes(*x))
    monkeypatch.setattr(
        a.sched.storage, "exists_each", lambda keys: asked.append(1) or exists_each(keys)
    )
    waiting = _request("w", tokens)
    assert a.sched.num_new_matched_tokens(waiting, 0) == (0, False)
    lookups = len(asked)
    for _ in range(3):
        assert a.sched.num_new_matched_tokens(waiting, 0) == (0, False)
    assert len(hashed) == 1 and len(asked) == lookups > 0
    assert a.sched.counters.requests == 0
    _fill(a, [0, 1, 2], seed=3)
    _finish(a, _request("r1", tokens), [0, 1, 2, 3])  # another request saves the pages
    assert a.hit(waiting) == 3 * BLOCK
    assert a.sched.counters.requests == 1
    assert a.sched.counters.prompt_tokens == len(tokens)
    assert a.sched.counters.l2_hit_tokens == 3 * BLOCK


def test_config_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="storage_root"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="write_policy"):
        ConnectorConfig.from_extra({"storage_root": "/x", "write_policy": "sometimes"})
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra({"storage_root": "/x", "hostbytes": 1})
    with pytest.raises(ValueError, match="master"):
        ConnectorConfig.from_extra({"storage": "mooncake"})


def test_model_id_names_the_weights(tmp_path: Path) -> None:
    for name, byte in (("a", b"\x00"), ("b", b"\x01")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(byte * 64)
    a = connector_model_id(str(tmp_path / "a"), None, "float32")
    assert a == connector_model_id(str(tmp_path / "a"), None, "float32")
    assert a != connector_model_id(str(tmp_path / "b"), None, "float32")
    assert a != connector_model_id(str(tmp_path / "a"), None, "bfloat16")
    with pytest.raises(ValueError, match="local directory"):
        connector_model_id("org/name", None, "float32")


def test_keys_carry_each_tp_ranks_head_slice() -> None:
    """The key path of tensor parallelism (vLLM's CPU build here runs one worker): each tp
    coordinate keys its own KV head range; with fewer KV heads than ranks, the ranks that
    hold one head share its key (one object, equal bytes)."""
    plan = _plan()
    h = plan.page_hashes(list(range(BLOCK)), "")[0]
    group = plan.groups[0]
    sharded = GroupLayout(**{**_fields(group), "total_kv_heads": 4, "local_kv_heads": 2})
    tp2 = KeyPlan(plan.model_id, plan.dtype, 1, (sharded,))
    k0, k1 = (tp2.keys(h, "", r, 2)[0] for r in (0, 1))
    assert (k0.slice.heads, k1.slice.heads) == ((0, 2), (2, 4))
    assert k0.to_str() != k1.to_str()
    one_head = GroupLayout(**{**_fields(group), "total_kv_heads": 2, "local_kv_heads": 1})
    tp4 = KeyPlan(plan.model_id, plan.dtype, 1, (one_head,))
    heads = [tp4.keys(h, "", r, 4)[0].slice.heads for r in range(4)]
    assert heads == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # Model, dtype, tenant and geometry each change every key.
    base = plan.keys(h, "", 0, 1)[0].to_str()
    assert KeyPlan("weights:other", "float32", 1, plan.groups).keys(h, "", 0, 1)[0].to_str() != base
    assert KeyPlan(plan.model_id, "bfloat16", 1, plan.groups).keys(h, "", 0, 1)[0].to_str() != base
    assert plan.keys(h, "alice", 0, 1)[0].to_str() != base
    reshaped = GroupLayout(**{**_fields(group), "geometry": "FullAttentionSpec|bs=4|head=128"})
    other_geometry = KeyPlan(plan.model_id, plan.dtype, 1, (reshaped,))
    assert other_geometry.page_hashes(list(range(BLOCK)), "")[0] != h


def _fields(group: GroupLayout) -> dict:
    return {f: getattr(group, f) for f in GroupLayout.__slots__}


def test_other_secret_is_a_miss(tmp_path: Path) -> None:
    """Objects sealed under one secret are misses under another (forged / foreign)."""
    tokens = list(range(1, 1 + 2 * BLOCK + 1))
    a = _Engine(tmp_path, host_pages=8, secret=b"s" * 32)
    _fill(a, [0, 1], seed=4)
    _finish(a, _request("r1", tokens), [0, 1, 2])
    a.worker._io.submit(lambda: None).result()
    assert _Engine(tmp_path, host_pages=8, secret=b"s" * 32).hit(_request("r2", tokens)) == 8
    other = _Engine(tmp_path, host_pages=8, secret=b"t" * 32)
    assert other.hit(_request("r3", tokens)) == 0
    assert other.sched.counters.l3_hit_tokens == 0
