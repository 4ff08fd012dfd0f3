"""Exact-resume scenarios shared by the one-rank and the multi-rank engine tests.

Each scenario serves requests through the engine with a cache and, for comparison,
recomputes every prompt from scratch with the same model. It returns, per checked
request, the tier the prefix came from, the cached token count, the max logit difference
to the recompute and whether the greedy tokens match.

Tolerance: a resumed prefill runs the same math as a full prefill, but the SSM scan and
attention reduce over differently split blocks, so float32 results differ by rounding
only (observed < 1e-5 on logits of magnitude ~4). ``ATOL`` leaves a wide margin while
still catching any real state error (those move logits by >= 1e-2).
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass

import torch

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.layout import StateLayout
from mesh_hicache.pools.arena import ArenaPlan
from mesh_hicache.topology import MeshTopology
from runtime.engine import Engine, RequestResult
from runtime.model import HybridModel
from runtime.model.config import preset

ATOL = 1e-4
PAGE = 16


@dataclass(frozen=True, slots=True)
class Check:
    label: str
    tier: str
    cached: int
    max_diff: float
    tokens_equal: bool


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _compare(label: str, tier: str, result: RequestResult, prompt: list[int], ref: Engine) -> Check:
    expected = ref.serve(prompt)
    assert result.last_logits is not None and expected.last_logits is not None
    diff = (torch.tensor(result.last_logits) - torch.tensor(expected.last_logits)).abs().max()
    cached = {"device": result.cached_device, "host": result.cached_host}
    cached["storage"] = result.cached_storage
    return Check(label, tier, cached[tier], float(diff), result.output_ids == expected.output_ids)


def _model(topology: MeshTopology, cp_kv: str, checkpoint: str | None) -> HybridModel:
    """``tiny`` (seeded), or the Hugging Face checkpoint in directory ``checkpoint``."""
    if checkpoint is None:
        return HybridModel(preset("tiny"), topology, cp_kv=cp_kv, page_size=PAGE)
    from runtime.checkpoints import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    return HybridModel(ckpt.config, topology, cp_kv=cp_kv, page_size=PAGE, weights=ckpt.weights)


def resume_scenarios(
    topology: MeshTopology,
    cp_kv: str = "replicate",
    root: str | None = None,
    checkpoint: str | None = None,
    budget: bool = False,
) -> list[Check]:
    """L1, L2 and L3 hits, aligned and unaligned prompts, eviction and reload cycles.

    ``checkpoint``: a Hugging Face checkpoint directory to serve instead of ``tiny``.
    ``budget``: L1 and L2 are byte budgets (one arena each) instead of page/slot counts,
    sized so that L1 again holds about one request.
    """
    model = _model(topology, cp_kv, checkpoint)
    config = model.config
    ref = Engine(model, None, max_new_tokens=4, keep_logits=True)
    spec = config.state_spec(PAGE)
    root = root or tempfile.mkdtemp(prefix="mh_engine_")
    pools: dict[str, int] = dict(device_pages=12, device_mamba_slots=8, host_pages=128)
    if budget:
        page, state, _ = ArenaPlan.item_bytes(StateLayout(spec, topology, cp_kv))
        pools = dict(device_bytes=12 * page + 2 * state, host_bytes=128 * page + 32 * state)
    cfg = HiCacheConfig(
        **pools,
        storage="file",
        storage_options={"root": root},
        prefetch_threshold=16,
        cp_kv=cp_kv,
    )
    rng = random.Random(1)
    vocab = config.vocab_size
    checks: list[Check] = []
    cache = HiCache(topology, spec, cfg)
    engine = Engine(model, cache, max_new_tokens=4, keep_logits=True)
    a = _tokens(rng, 8 * PAGE, vocab)  # page-aligned prompt
    b = _tokens(rng, 8 * PAGE + 5, vocab)  # unaligned
    engine.serve(a)
    turn = a + _tokens(rng, 21, vocab)
    checks.append(_compare("L1 aligned", "device", engine.serve(turn), turn, ref))
    # b evicts a's device pages (12 device pages hold about one request): a's prefix is on host.
    engine.serve(b)
    turn = a + _tokens(rng, 3, vocab)
    checks.append(_compare("L2 after eviction", "host", engine.serve(turn), turn, ref))
    for cycle in range(3):
        engine.serve(_tokens(rng, 10 * PAGE, vocab))
        turn = b + _tokens(rng, 7 + cycle, vocab)
        checks.append(_compare(f"reload cycle {cycle}", "host", engine.serve(turn), turn, ref))
    cache.flush()
    cache.check_integrity()
    cache.close()
    # A new cache on the same storage root: cold L1/L2, warm L3.
    cache = HiCache(topology, spec, cfg)
    engine = Engine(model, cache, max_new_tokens=4, keep_logits=True)
    turn = b + _tokens(rng, 2, vocab)
    checks.append(_compare("L3 after restart", "storage", engine.serve(turn), turn, ref))
    cache.close()
    return checks


# -- batched (runtime.scheduler) vs sequential (Engine.run) ---------------------------------


@dataclass(frozen=True, slots=True)
class BatchCheck:
    """One trace served batched and one by one, each on a fresh cache of the same mode."""

    label: str
    batched: list[list[int]]
    sequential: list[list[int]]
    batched_cached: int
    """Prompt tokens the batched run took from the cache (all tiers)."""
    max_batch: int
    """Largest ``decode_batch`` the scheduler issued."""
    max_prefill_chunk: int


def mixed_trace(vocab: int, *, seed: int = 3) -> list:
    """Multi-turn chats (the next turn continues the answer), two requests sharing a
    system prompt, and a turn ending at a stop token: 9 requests, 40..90-token prompts."""
    from runtime.workloads.generate import Turn

    rng = random.Random(seed)
    system = tuple(_tokens(rng, 2 * PAGE + 3, vocab))
    trace: list[Turn] = []
    for turn in range(3):
        for s in range(2):
            user = tuple(_tokens(rng, 40 if turn == 0 else 9, vocab))
            trace.append(Turn(len(trace), s, turn, user))
    for s in (2, 3):
        trace.append(Turn(len(trace), s, 0, system + tuple(_tokens(rng, 11 + s, vocab))))
    trace.append(Turn(len(trace), 4, 0, tuple(_tokens(rng, 50, vocab)), stop_token=0))
    return trace


def cache_config(mode: str, cp_kv: str = "replicate", **extra: object) -> HiCacheConfig | None:
    """``off``: no cache; ``l1``: device pools only; ``l1+l2``: with a host tier."""
    if mode == "off":
        return None
    if mode == "l1":
        return HiCacheConfig(device_pages=24, enable_host=False, cp_kv=cp_kv, **extra)  # type: ignore[arg-type]
    assert mode == "l1+l2", mode
    return HiCacheConfig(device_pages=24, host_pages=96, cp_kv=cp_kv, **extra)  # type: ignore[arg-type]


def batched_vs_sequential(
    topology: MeshTopology,
    mode: str,
    cp_kv: str = "replicate",
    checkpoint: str | None = None,
    max_running: int = 4,
    token_budget: int = 24,
) -> BatchCheck:
    """Serve :func:`mixed_trace` through the scheduler and through ``Engine.run``; both
    caches must pass ``check_integrity`` with no request left open."""
    from mesh_hicache.testing import internals
    from runtime.scheduler import Scheduler, SchedulerConfig
    from runtime.workloads.generate import Turn

    model = _model(topology, cp_kv, checkpoint)
    config = model.config
    trace: list[Turn] = mixed_trace(config.vocab_size)
    sizes: list[int] = []
    chunks: list[int] = []
    decode_batch, prefill = model.decode_batch, model.prefill

    def counting_batch(tokens, states):
        sizes.append(len(tokens))
        return decode_batch(tokens, states)

    def counting_prefill(tokens, state, **kw):
        chunks.append(int(tokens.shape[0]))
        return prefill(tokens, state, **kw)

    outputs: dict[str, list[list[int]]] = {}
    cached = 0
    for kind in ("sequential", "batched"):
        cfg = cache_config(mode, cp_kv)
        cache = None if cfg is None else HiCache(topology, config.state_spec(PAGE), cfg)
        if kind == "sequential":
            results = Engine(model, cache, max_new_tokens=5).run(trace)
        else:
            model.decode_batch, model.prefill = counting_batch, counting_prefill  # type: ignore[method-assign]
            sched = SchedulerConfig(max_running=max_running, token_budget=token_budget)
            results = Scheduler(model, cache, sched, max_new_tokens=5).run(trace)
            model.decode_batch, model.prefill = decode_batch, prefill  # type: ignore[method-assign]
            assert [r.request_id for r in results] == [t.request_id for t in trace]
            cached = sum(r.cached for r in results)
        outputs[kind] = [r.output_ids for r in results]
        if cache is not None:
            assert internals(cache).num_open == 0
            cache.flush()
            cache.check_integrity()
            cache.close()
    label = f"{mode} {cp_kv} {'tiny' if checkpoint is None else 'checkpoint'}"
    return BatchCheck(
        label,
        outputs["batched"],
        outputs["sequential"],
        cached,
        max(sizes, default=0),
        max(chunks, default=0),
    )
