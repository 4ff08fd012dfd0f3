"""MeshHiCacheConnector inside vLLM's CPU build, on tiny random checkpoints.

Engine starts are few (each is minutes on a loaded 2-core box), so each engine runs a
sequence of requests and the checks read the results and the connector's counters after
each. The oracle is transformers in float32 on the same weights (greedy tokens, and each
chosen token's logprob within 1e-3: vLLM's CPU attention kernel and transformers' eager
attention reduce in another order).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.vllm.conftest import run_engine

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
torch = pytest.importorskip("torch")

VOCAB = 256
BLOCK = 32
LOGPROB_ATOL = 1e-3
MAX_TOKENS = 4


def _seq(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _save_random(
    path: Path,
    model_class: type,
    cfg: object,
    std: float = 0.1,
    *,
    every_tensor: bool = False,
    sinks: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A model of ``cfg`` with seeded random weights (matrices only, or ``every_tensor``,
    ~N(0, std); attention ``sinks`` ~N(sinks, 1)), saved in ``dtype`` at ``path``."""
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if sinks is not None and name.endswith("sinks"):
                p.normal_(sinks, 1.0)
            elif every_tensor or p.dim() >= 2:
                p.normal_(0, std)
    model.to(dtype).save_pretrained(path)
    return path


def _build_llama(path: Path) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return _save_random(path, transformers.LlamaForCausalLM, cfg, 0.2, every_tensor=True)


def _build_granite_hybrid(path: Path) -> Path:
    # Granite-4.0-H-like: Mamba-2 and attention layers; chunk size = vLLM's block size
    # (128), the setting vLLM's CPU build needs for prefix caching with Mamba-2.
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_hidden_layers=4,
        mamba_n_heads=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=32,
        mamba_chunk_size=128,
        num_local_experts=0,
        shared_intermediate_size=256,
        position_embedding_type="rope",
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    )
    return _save_random(path, transformers.GraniteMoeHybridForCausalLM, cfg)


def _build_gemma3(path: Path) -> Path:
    # Gemma-3-like: sliding-window layers (window 64 = two 32-token blocks) and one
    # full-attention layer, so vLLM has a sliding-window and a full-attention group.
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=2048,
    )
    return _save_random(path, transformers.Gemma3ForCausalLM, cfg)


def _build_gpt_oss(path: Path) -> Path:
    # gpt-oss-like: a sliding-window layer (window 64 = two 32-token blocks; vLLM slides
    # the even layers) and a full-attention layer, both with attention sinks, and a
    # top-2-of-4 MoE. Sinks near 4 take a visible share of the attention (without them
    # the logprobs here move by about 0.1; by 0.006 with sinks near 0).
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    return _save_random(path, transformers.GptOssForCausalLM, cfg, sinks=4.0)


def _build_qwen3_next(path: Path) -> Path:
    # Qwen3-Next-like: Gated DeltaNet and attention layers; vLLM's CPU GDN kernel needs
    # bfloat16 and a linear head dim of 128. vLLM raises the block size (to 288 here) so
    # an attention page holds as many bytes as a GDN state.
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return _save_random(path, transformers.Qwen3NextForCausalLM, cfg, dtype=torch.bfloat16)


def _reference(model_dir: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers float32: greedy tokens and each one's logprob."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            t = int(torch.argmax(lp))
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


def _assert_matches(step: dict, ref: tuple[list[int], list[float]], what: str) -> None:
    assert step["tokens"] == ref[0], f"{what}: tokens {step['tokens']} != transformers {ref[0]}"
    for got, want in zip(step["logprobs"], ref[1], strict=True):
        assert abs(got - want) <= LOGPROB_ATOL, f"{what}: logprob {got} vs {want}"


def _delta(steps: list[dict], i: int, key: str) -> int:
    before = steps[i - 1]["stats"]["scheduler"][key] if i else 0
    return steps[i]["stats"]["scheduler"][key] - before


def _connector(root: Path, stats: Path, host_bytes: int) -> dict:
    return {
        "kv_connector": "MeshHiCacheConnector",
        "kv_connector_module_path": "mesh_hicache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "storage_root": str(root),
            "host_bytes": host_bytes,
            "stats_file": str(stats),
        },
    }


@pytest.mark.timeout(3600)  # two engine starts: minutes each on a loaded 2-core machine
def test_llama_l2_l3_tenants_and_corruption(vllm_python: str, tmp_path: Path) -> None:
    model = _build_llama(tmp_path / "llama")
    rng = random.Random(0)
    shared, tail = _seq(rng, 5 * BLOCK), _seq(rng, 4 * BLOCK)
    a, b, c, d = (_seq(rng, 20) for _ in range(4))
    fillers = [_seq(rng, 400) for _ in range(2)]
    store = tmp_path / "l3"
    store.mkdir()
    first = [
        {"prompt": shared + a},
        {"prompt": fillers[0]},
        {"prompt": fillers[1]},  # vLLM's 16 usable device blocks no longer hold `shared`
        {"prompt": shared + b},
        {"prompt": shared + b, "salt": "alice"},
        {"prompt": tail + c},
    ]
    job = {
        "model": str(model),
        "block_size": BLOCK,
        "num_blocks": 17,  # 16 usable (vLLM keeps one null block)
        "max_model_len": 512,
        "kv_transfer_config": _connector(store, tmp_path / "stats1.json", 64 << 20),
        "steps": first,
    }
    s1 = run_engine(vllm_python, job, tmp_path, "first")
    refs = {i: _reference(model, st["prompt"]) for i, st in enumerate(first)}
    for i, step in enumerate(s1):
        _assert_matches(step, refs[i], f"first engine, request {i}")
    # The evicted prefix came back from L2 (the tokens vLLM no longer held).
    assert _delta(s1, 3, "l2_hit_tokens") + _delta(s1, 3, "device_hit_tokens") == 5 * BLOCK
    assert _delta(s1, 3, "l2_hit_tokens") >= 4 * BLOCK
    # Cached (request 3) and uncached (request 4: another tenant) prefill agree closely.
    for x, y in zip(s1[3]["logprobs"], s1[4]["logprobs"], strict=True):
        assert abs(x - y) <= 1e-4
    # Another tenant shares nothing: no hit from vLLM or the connector.
    for key in ("l2_hit_tokens", "l3_hit_tokens", "device_hit_tokens"):
        assert _delta(s1, 4, key) == 0, key

    # Corrupt every object the last request saved (one flipped payload byte each).
    new = sorted(set(s1[5]["files"]) - set(s1[4]["files"]))
    assert len(new) == 4, new
    for rel in new:
        path = store / rel
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    second = [
        {"prompt": shared + d},
        {"prompt": tail + c},
        {"prompt": shared + b, "salt": "alice"},
    ]
    job2 = {
        **job,
        "kv_transfer_config": _connector(store, tmp_path / "stats2.json", 64 << 20),
        "steps": second,
    }
    s2 = run_engine(vllm_python, job2, tmp_path, "second")
    _assert_matches(s2[0], _reference(model, second[0]["prompt"]), "second engine, L3 hit")
    _assert_matches(s2[1], refs[5], "second engine, corrupt objects")
    _assert_matches(s2[2], refs[4], "second engine, tenant's own pages")
    # A new process reads the first engine's pages from L3.
    assert _delta(s2, 0, "l3_hit_tokens") == 5 * BLOCK
    # Corrupt objects are misses: recomputed, nothing loaded.
    assert _delta(s2, 1, "prefetch_failed_pages") >= 1
    assert _delta(s2, 1, "l3_hit_tokens") == 0
    # The tenant's pages are found under its own salt only.
    assert _delta(s2, 2, "l3_hit_tokens") == 5 * BLOCK


@pytest.mark.timeout(3600)  # two engine starts
def test_mamba2_hybrid_restores_kv_and_state(vllm_python: str, tmp_path: Path) -> None:
    """A Mamba-2 hybrid: the connector saves the attention pages and the Mamba state vLLM
    hands off at a page boundary (align mode), and restores both: from L2 once vLLM's own
    prefix cache is emptied, and from L3 in a second engine (a new process). Every output
    equals transformers' (float32), so a hit that restored KV without its state (or a
    wrong state) would fail."""
    model = _build_granite_hybrid(tmp_path / "granite")
    rng = random.Random(1)
    shared = _seq(rng, 300)  # 2 whole 128-token pages before the last prompt token
    a, b, c = ([5, 6, 7], [9, 10, 11], [12, 13, 14])
    store = tmp_path / "l3"
    store.mkdir()
    first = [
        {"prompt": shared + a},
        {"prompt": shared + b, "reset_device_cache": True},
    ]
    job = {
        "model": str(model),
        "block_size": 128,
        "max_model_len": 1024,
        "engine_kwargs": {"max_num_batched_tokens": 128},
        "kv_transfer_config": _connector(store, tmp_path / "stats1.json", 16 << 20),
        "steps": first,
    }
    s1 = run_engine(vllm_python, job, tmp_path, "hybrid1")
    for i, step in enumerate(s1):
        _assert_matches(step, _reference(model, first[i]["prompt"]), f"hybrid engine 1, req {i}")
    stats = s1[0]["stats"]["scheduler"]
    assert stats["unsupported_requests"] == 0
    assert stats["saved_pages"] == 2 and stats["saved_states"] >= 1, stats
    # vLLM's device cache emptied: both pages and the state at their end came from L2.
    assert _delta(s1, 1, "l2_hit_tokens") == 2 * 128
    assert _delta(s1, 1, "device_hit_tokens") == 0

    second = [
        {"prompt": shared + c},
        {"prompt": shared + c, "salt": "bob"},
    ]
    job2 = {
        **job,
        "kv_transfer_config": _connector(store, tmp_path / "stats2.json", 16 << 20),
        "steps": second,
    }
    s2 = run_engine(vllm_python, job2, tmp_path, "hybrid2")
    ref_c = _reference(model, second[0]["prompt"])
    _assert_matches(s2[0], ref_c, "hybrid engine 2, L3 hit")
    _assert_matches(s2[1], ref_c, "hybrid engine 2, other tenant")
    assert _delta(s2, 0, "l3_hit_tokens") == 2 * 128
    worker = s2[0]["stats"]["worker"]
    assert worker["loaded_pages"] == 2 and worker["l3_get_failed"] == 0, worker
    for key in ("l2_hit_tokens", "l3_hit_tokens", "device_hit_tokens"):
        assert _delta(s2, 1, key) == 0, key


@pytest.mark.timeout(3600)  # two engine starts
@pytest.mark.parametrize("build", [_build_gemma3, _build_gpt_oss], ids=["gemma3", "gpt_oss"])
def test_sliding_window_model_restores_window_pages(
    vllm_python: str, tmp_path: Path, build: Callable[[Path], Path]
) -> None:
    """Gemma-3-like and gpt-oss-like (attention sinks, MoE) models, each with a
    sliding-window and a full-attention group: the connector saves every full-attention
    page and the sliding-window pages vLLM still holds when the request ends (the window
    before its end), and a hit restores both: from L2 once vLLM's own cache is emptied,
    from L3 in a new process; outputs equal transformers'."""
    model = build(tmp_path / "model")
    rng = random.Random(2)
    shared = _seq(rng, 200)  # 6 whole 32-token pages before the last prompt token
    a, b, c = ([5, 6, 7], [9, 10, 11], [12, 13, 14])
    store = tmp_path / "l3"
    store.mkdir()
    first = [
        {"prompt": shared + a},
        {"prompt": shared + b, "reset_device_cache": True},
    ]
    job = {
        "model": str(model),
        "block_size": BLOCK,
        "max_model_len": 512,
        "kv_transfer_config": _connector(store, tmp_path / "stats1.json", 16 << 20),
        "steps": first,
    }
    s1 = run_engine(vllm_python, job, tmp_path, "window1")
    for i, step in enumerate(s1):
        _assert_matches(step, _reference(model, first[i]["prompt"]), f"window engine 1, req {i}")
    assert s1[0]["stats"]["scheduler"]["unsupported_requests"] == 0
    assert _delta(s1, 1, "l2_hit_tokens") == 6 * BLOCK
    assert _delta(s1, 1, "device_hit_tokens") == 0

    job2 = {
        **job,
        "kv_transfer_config": _connector(store, tmp_path / "stats2.json", 16 << 20),
        "steps": [{"prompt": shared + c}],
    }
    s2 = run_engine(vllm_python, job2, tmp_path, "window2")
    _assert_matches(s2[0], _reference(model, shared + c), "window engine 2, L3 hit")
    assert _delta(s2, 0, "l3_hit_tokens") == 6 * BLOCK


@pytest.mark.timeout(1800)  # one engine start
def test_gated_deltanet_hybrid_l2_hit_equals_uncached(vllm_python: str, tmp_path: Path) -> None:
    """Qwen3-Next-like (Gated DeltaNet state groups, bfloat16): after vLLM's own cache is
    emptied, the prefix comes from L2 (attention KV + GDN state) and the output equals the
    same prompt computed without any hit (another tenant). Tolerance 1e-2 on logprobs:
    bfloat16 (measured here: equal)."""
    model = _build_qwen3_next(tmp_path / "qwen3next")
    rng = random.Random(3)
    shared = _seq(rng, 700)
    store = tmp_path / "l3"
    store.mkdir()
    steps = [
        {"prompt": shared + [5, 6, 7]},
        {"prompt": shared + [9, 10, 11], "reset_device_cache": True},
        {"prompt": shared + [9, 10, 11], "salt": "uncached"},
    ]
    job = {
        "model": str(model),
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "max_model_len": 2048,
        "kv_transfer_config": _connector(store, tmp_path / "stats.json", 256 << 20),
        "steps": steps,
    }
    out = run_engine(vllm_python, job, tmp_path, "gdn")
    stats = out[0]["stats"]["scheduler"]
    assert stats["unsupported_requests"] == 0 and stats["saved_states"] >= 1, stats
    hit = _delta(out, 1, "l2_hit_tokens")
    assert hit > 0 and _delta(out, 1, "device_hit_tokens") == 0
    for key in ("l2_hit_tokens", "l3_hit_tokens", "device_hit_tokens"):
        assert _delta(out, 2, key) == 0, key
    assert out[1]["tokens"] == out[2]["tokens"]
    for x, y in zip(out[1]["logprobs"], out[2]["logprobs"], strict=True):
        assert abs(x - y) <= 1e-2
