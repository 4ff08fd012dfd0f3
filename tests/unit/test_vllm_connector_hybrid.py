"""The vLLM connector's hybrid path without vLLM: an attention group saved page by page and
a Mamba-style state group saved only at the boundaries vLLM hands off (align mode), fake
tensors, the real file store. A hit needs the KV of every page and the state at its end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from mesh_hicache.integrations.vllm.config import ConnectorConfig
from mesh_hicache.integrations.vllm.layout import GroupLayout, KeyPlan, group_role
from mesh_hicache.integrations.vllm.scheduler import ConnectorScheduler
from mesh_hicache.integrations.vllm.worker import ConnectorWorker
from mesh_hicache.storage.factory import open_storage

BLOCK = 4
NUM_BLOCKS = 16
KV, STATE = 0, 1


def _plan() -> KeyPlan:
    kv = GroupLayout(
        group_id=KV,
        spec_kind="FullAttentionSpec",
        block_size=BLOCK,
        layer_names=("attn",),
        layer_range=(1, 2),
        total_kv_heads=2,
        local_kv_heads=2,
        geometry=f"FullAttentionSpec|bs={BLOCK}",
        role="kv",
    )
    state = GroupLayout(
        group_id=STATE,
        spec_kind="MambaSpec",
        block_size=BLOCK,
        layer_names=("mixer",),
        layer_range=(0, 1),
        total_kv_heads=1,
        local_kv_heads=1,
        geometry=f"MambaSpec|bs={BLOCK}|mode=align",
        role="state",
    )
    return KeyPlan("weights:hybrid", "float32", 1, (kv, state))


class _Engine:
    def __init__(self, root: Path, host_pages: int = 8, policy: str = "write_through") -> None:
        plan = _plan()
        config = ConnectorConfig.from_extra(
            {"storage_root": str(root), "host_bytes": 1 << 20, "write_policy": policy}
        )
        page_bytes = (1 << 20) // host_pages if host_pages else 1 << 30
        self.sched = ConnectorScheduler(
            config,
            plan,
            open_storage("file", root=str(root)),
            page_bytes=page_bytes,
            num_workers=1,
            tp_size=1,
        )
        self.worker = ConnectorWorker(
            plan, open_storage("file", root=str(root)), tp_coord=0, tp_size=1, stats_file=None
        )
        # One block per row: attention [blocks, 2, BLOCK, heads, dim]; the state as vLLM's
        # CPU build hands it over (a byte view per block, strided inside a padded page).
        self.attn = torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 4)
        self.state_pages = torch.zeros(NUM_BLOCKS, 64, dtype=torch.int8)
        self.mixer = self.state_pages[:, :40].view(NUM_BLOCKS, 1, 1, 40)
        self.worker.register({"attn": self.attn, "mixer": self.mixer}, NUM_BLOCKS)

    def step(self, offers: dict | None = None) -> None:
        if offers:
            self.sched.boundary_states(offers)
        self.worker.apply(self.sched.take_orders())
        self.worker.after_forward()
        self.worker._io.submit(lambda: None).result()
        report = self.worker.take_report()
        if report is not None:
            self.sched.worker_report(report)

    def hit(self, req: SimpleNamespace, blocks: tuple[list[int], list[int]], local: int = 0) -> int:
        for _ in range(5):
            n, _ = self.sched.num_new_matched_tokens(req, local)
            if n is not None:
                break
            self.step()
        assert n is not None
        self.sched.after_alloc(req, blocks, n)
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


def _run_first(engine: _Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One request in engine A: vLLM hands off the state at 2 pages (block 5), the request
    finishes with 3 whole KV pages in blocks 1..3; returns what a hit must restore."""
    req = _request("r1", tokens)
    assert engine.sched.num_new_matched_tokens(req, 0) == (0, False)
    g = torch.Generator().manual_seed(0)
    engine.attn[1:4] = torch.randn(engine.attn[1:4].shape, generator=g)
    engine.mixer[5] = torch.randint(-100, 100, engine.mixer[5].shape, generator=g, dtype=torch.int8)
    engine.step({"r1": [(STATE, 5, 2 * BLOCK)]})
    assert engine.sched.counters.saved_states == 1
    assert engine.sched.request_finished(req, ([1, 2, 3, 4], [0, 0, 6]))
    engine.step()
    engine.worker._io.submit(lambda: None).result()
    return engine.attn[1:3].clone(), engine.mixer[5].clone()


def test_hit_restores_kv_pages_and_the_state_at_their_end(tmp_path: Path) -> None:
    tokens = list(range(1, 1 + 3 * BLOCK + 2))
    a = _Engine(tmp_path)
    kv, state = _run_first(a, tokens)
    # Same engine, vLLM's own cache gone: the third page has KV but no state at its end,
    # so the hit is 2 pages; the state lands in the block vLLM allocated at the hit's end
    # (where vLLM's own prefix cache will find it) ...
    a.attn.zero_()
    a.state_pages.zero_()
    assert a.hit(_request("r2", tokens), ([7, 8, 9, 10], [0, 11, 12])) == 2 * BLOCK
    assert a.sched.counters.l2_hit_tokens == 2 * BLOCK
    assert torch.equal(a.attn[7:9], kv) and torch.equal(a.mixer[11], state)
    # ... and in the request's running block (its last), which vLLM filled from block 11
    # before the load: the forward starts from there.
    assert torch.equal(a.mixer[12], state)
    assert not a.state_pages[11, 40:].any()  # the page's padding stays untouched
    # Another engine on the same store: both groups' objects come from L3.
    b = _Engine(tmp_path)
    assert b.hit(_request("r3", tokens + [99]), ([1, 2, 3, 4], [0, 5, 6])) == 2 * BLOCK
    assert b.sched.counters.l3_hit_tokens == 2 * BLOCK
    assert torch.equal(b.attn[1:3], kv) and torch.equal(b.mixer[5], state)
    assert torch.equal(b.mixer[6], state)
    assert b.worker.counters.loaded_pages == 2
    # Another tenant shares nothing.
    assert b.hit(_request("r4", tokens, salt="alice"), ([1, 2, 3, 4], [0, 5, 6])) == 0


def test_missing_state_is_no_hit_and_a_local_prefix_is_not_refetched(tmp_path: Path) -> None:
    tokens = list(range(1, 1 + 3 * BLOCK + 2))
    a = _Engine(tmp_path)
    _run_first(a, tokens)
    plan = a.sched.plan
    h1 = plan.page_hashes(tokens, "")[1]
    state_key = plan.keys(h1, "", 0, 1, (STATE,))[0]
    # The engine's own cache holds page 0: only page 1 (KV and state) is read from L3.
    b = _Engine(tmp_path)
    assert b.hit(_request("r2", tokens), ([1, 2, 3, 4], [0, 5, 6]), local=BLOCK) == BLOCK
    assert b.worker.counters.l3_get_objects == 2
    # Without the state object, the KV pages alone are no hit (never KV without state).
    b.worker.storage.backend.object_path(state_key).unlink()  # type: ignore[union-attr]
    c = _Engine(tmp_path)
    assert c.hit(_request("r3", tokens), ([1, 2, 3, 4], [0, 5, 6])) == 0
    assert c.sched.counters.l3_hit_tokens == 0


def test_state_group_roles() -> None:
    align = SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=0)
    type_name = type("MambaSpec", (), {})
    spec = type_name()
    spec.__dict__.update(vars(align))
    assert group_role(spec) == "state"
    spec.mamba_cache_mode = "all"
    assert group_role(spec) == ""
    window = type("SlidingWindowSpec", (), {})()
    assert group_role(window) == ""


def test_no_l2_and_write_back_store_states_in_l3(tmp_path: Path) -> None:
    """Without L2 a state saved after the forward goes straight to L3 (its entry was
    dropped before the copy: nothing stays in host memory); with write_back an evicted
    entry writes every group it holds. Either way a new engine hits 2 pages from L3."""
    tokens = list(range(1, 1 + 3 * BLOCK + 2))
    for root, engine in (
        (tmp_path / "none", lambda r: _Engine(r, host_pages=0)),
        (tmp_path / "back", lambda r: _Engine(r, host_pages=1, policy="write_back")),
    ):
        root.mkdir()
        a = engine(root)
        kv, state = _run_first(a, tokens)
        if a.sched.directory.capacity == 0:
            assert a.worker.host == {}
        b = _Engine(root)
        assert b.hit(_request("r2", tokens), ([1, 2, 3, 4], [0, 5, 6])) == 2 * BLOCK, root
        assert b.sched.counters.l3_hit_tokens == 2 * BLOCK
        assert torch.equal(b.attn[1:3], kv) and torch.equal(b.mixer[5], state)


def _window_engine(root: Path) -> tuple[ConnectorScheduler, ConnectorWorker, dict]:
    full, window = (
        GroupLayout(
            group_id=i,
            spec_kind=kind,
            block_size=BLOCK,
            layer_names=(name,),
            layer_range=(i, i + 1),
            total_kv_heads=2,
            local_kv_heads=2,
            geometry=f"{kind}|bs={BLOCK}",
            role=role,
            window=2 * BLOCK,
        )
        for i, (kind, name, role) in enumerate(
            (("FullAttentionSpec", "full", "kv"), ("SlidingWindowSpec", "local", "window"))
        )
    )
    plan = KeyPlan("weights:window", "float32", 1, (full, window))
    config = ConnectorConfig.from_extra({"storage_root": str(root), "host_bytes": 1 << 20})
    sched = ConnectorScheduler(
        config,
        plan,
        open_storage("file", root=str(root)),
        page_bytes=1024,
        num_workers=1,
        tp_size=1,
    )
    worker = ConnectorWorker(
        plan, open_storage("file", root=str(root)), tp_coord=0, tp_size=1, stats_file=None
    )
    kv = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 4) for n in ("full", "local")}
    worker.register(kv, NUM_BLOCKS)
    return sched, worker, kv


def _window_step(sched: ConnectorScheduler, worker: ConnectorWorker) -> None:
    worker.apply(sched.take_orders())
    worker.after_forward()
    worker._io.submit(lambda: None).result()
    report = worker.take_report()
    if report is not None:
        sched.worker_report(report)


def _window_hit(
    sched: ConnectorScheduler,
    worker: ConnectorWorker,
    req: SimpleNamespace,
    blocks: tuple[list[int], list[int]],
) -> int:
    for _ in range(5):
        n, _ = sched.num_new_matched_tokens(req, 0)
        if n is not None:
            break
        _window_step(sched, worker)
    assert n is not None
    sched.after_alloc(req, blocks, n)
    _window_step(sched, worker)
    return n


def test_sliding_window_pages_inside_the_window_are_saved_and_restored(tmp_path: Path) -> None:
    """Window of 2 pages: a hit of k pages needs the window group's pages k-2, k-1 (vLLM
    frees the others); at the end vLLM still holds only the pages inside the window."""
    sched, worker, kv = _window_engine(tmp_path)
    tokens = list(range(1, 1 + 4 * BLOCK + 2))
    g = torch.Generator().manual_seed(1)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=g))
    req = _request("r1", tokens)
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.request_finished(req, ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8]))
    _window_step(sched, worker)
    worker._io.submit(lambda: None).result()
    full, local = kv["full"][1:5].clone(), kv["local"][6:8].clone()
    for t in kv.values():
        t.zero_()
    # The whole prompt again: 4 pages, the window group's pages 2 and 3 into its blocks.
    assert (
        _window_hit(sched, worker, _request("r2", tokens), ([9, 10, 11, 12, 13], [0, 0, 14, 15, 0]))
        == 4 * BLOCK
    )
    assert torch.equal(kv["full"][9:13], full) and torch.equal(kv["local"][14:16], local)
    # A prompt that leaves the shared prefix at page 3: a hit of 3 pages would need the
    # window pages 1 and 2, and page 1 was outside the window when it was saved: no hit.
    other = tokens[: 3 * BLOCK] + [250] * (BLOCK + 2)
    assert (
        _window_hit(sched, worker, _request("r3", other), ([9, 10, 11, 12, 13], [0, 14, 15, 0, 0]))
        == 0
    )
    # A new engine on the same store gets the 4 pages from L3.
    sched2, worker2, kv2 = _window_engine(tmp_path)
    assert (
        _window_hit(sched2, worker2, _request("r4", tokens), ([1, 2, 3, 4, 5], [0, 0, 6, 7, 0]))
        == 4 * BLOCK
    )
    assert sched2.counters.l3_hit_tokens == 4 * BLOCK
    assert torch.equal(kv2["full"][1:5], full) and torch.equal(kv2["local"][6:8], local)


def test_best_hit_rule() -> None:
    sched_plan = _plan()
    every = {KV, STATE}
    # State only at page 1's end: the longest hit is 2 pages, whatever KV follows.
    avail = [{KV}, every, {KV}, {KV}]
    assert sched_plan.best_hit(avail) == 2
    assert sched_plan.best_hit([{KV}, {KV}]) == 0
    # Pages below `start` are the engine's own: only the state at the end is needed.
    assert sched_plan.best_hit([set(), set(), every], start=2) == 3
