"""runtime.workloads.profiles: bytes per page/state and FLOPs per token (bench_hitrate)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from runtime.workloads.profiles import ModelProfile, profile
from runtime.workloads.profiles_hf import from_hf_config, load_hf_config
from runtime.workloads.traces import make_trace, trace_shape, write_jsonl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_common  # noqa: E402
import bench_hitrate  # noqa: E402


def test_hybrid_7b_sizes_match_the_issue():
    p = profile("hybrid-7b")
    assert p.kv_bytes_per_token == 64 * 1024  # 4 layers x K,V x 4096 x fp16
    assert p.page_bytes(16) == 2**20
    assert p.state_bytes == 24 * (4096 * 128 + 4 * 8448) * 2
    assert round(p.state_bytes / 1e6, 1) == 26.8


def _naive_flops(p: ModelProfile, start: int, end: int) -> int:
    """Position by position, layer by layer, written out independently of flops()."""
    d, h, kv, hd = p.d_model, p.num_heads, p.num_kv_heads, p.head_dim
    inner, n = p.ssm_heads * p.ssm_head_dim, p.ssm_state_dim
    total = 0
    for t in range(start, end):
        q, k, v, o = 2 * d * h * hd, 2 * d * kv * hd, 2 * d * kv * hd, 2 * h * hd * d
        scores, values = 2 * h * hd * (t + 1), 2 * h * hd * (t + 1)
        attention = q + k + v + o + scores + values
        in_proj = 2 * d * (inner + inner + 2 * p.ssm_groups * n + p.ssm_heads)
        conv = 2 * p.conv_dim * p.conv_kernel
        recurrence = inner * n * 5
        mamba = in_proj + conv + recurrence + 2 * inner * d
        mlp = (6 if p.mlp_gated else 4) * d * p.mlp_hidden
        total += p.attention_layers * attention + p.ssm_layers * mamba + p.mlp_layers * mlp
    return total


@pytest.mark.parametrize(
    "p",
    [
        profile("hybrid-7b"),
        ModelProfile(
            name="t",
            d_model=8,
            attention_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=2,
            ssm_layers=3,
            ssm_heads=2,
            ssm_head_dim=3,
            ssm_state_dim=5,
            ssm_groups=1,
            conv_kernel=3,
            mlp_layers=5,
            mlp_hidden=16,
        ),
    ],
)
def test_flops_equal_the_per_position_sum(p):
    for start, end in [(0, 0), (0, 1), (0, 37), (5, 64), (100, 101)]:
        assert p.flops(start, end) == _naive_flops(p, start, end)
    assert p.flops(0, 40) == p.flops(0, 17) + p.flops(17, 40)
    # Later positions cost more (attention grows with the context).
    assert p.flops(1000, 1001) > p.flops(0, 1)
    with pytest.raises(ValueError):
        p.flops(5, 4)


def test_profile_validation():
    with pytest.raises(ValueError, match="unknown model profile"):
        profile("nope")
    with pytest.raises(ValueError, match="neither"):
        ModelProfile(
            name="x", d_model=8, attention_layers=0, num_heads=1, num_kv_heads=1, head_dim=8,
            ssm_layers=0,
        )  # fmt: skip


NEMOTRON_LIKE = {
    "model_type": "nemotron_h",
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "hybrid_override_pattern": "M-M*M-M-",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 4,
    "conv_kernel": 4,
    "intermediate_size": 4096,
    "mlp_hidden_act": "relu2",
    "torch_dtype": "bfloat16",
}


def test_from_hf_config_reads_a_hybrid_config(tmp_path):
    p = from_hf_config(NEMOTRON_LIKE)
    assert (p.attention_layers, p.ssm_layers, p.mlp_layers) == (1, 4, 3)
    assert p.kv_bytes_per_token == 1 * 2 * 2 * 128 * 2
    conv_dim = 32 * 64 + 2 * 4 * 128
    assert p.conv_dim == conv_dim and p.conv_state_width == 3 and not p.mlp_gated
    # As the runtime's cache keeps it: conv state in the model dtype, SSM state float32.
    assert p.state_bytes == 4 * (conv_dim * 3 * 2 + 32 * 64 * 128 * 4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NEMOTRON_LIKE))
    assert load_hf_config(str(path)).state_bytes == p.state_bytes
    periodic = {k: v for k, v in NEMOTRON_LIKE.items() if k != "hybrid_override_pattern"}
    periodic.update(attn_layer_period=4, attn_layer_offset=2)
    q = from_hf_config(periodic)
    assert (q.attention_layers, q.ssm_layers) == (2, 6)
    with pytest.raises(ValueError, match="layer pattern"):
        from_hf_config({k: v for k, v in periodic.items() if not k.startswith("attn_layer")})
    with pytest.raises(ValueError, match="ssm_state_size"):
        from_hf_config({k: v for k, v in NEMOTRON_LIKE.items() if k != "ssm_state_size"})


# -- every family against the runtime's own cache ---------------------------------------------

# Tiny random checkpoints of every family the runtime serves, built by transformers' config
# classes and save_pretrained (tests/checkpoint_cases.py, qwen_cases.py, deepseek_cases.py).
CHECKPOINTS = [
    *(("checkpoint_cases", c) for c in ("granite_moe", "granite_dense", "bamba", "nemotron_h")),
    *(("qwen_cases", c) for c in ("qwen3_next", "qwen35", "qwen35_moe")),
    ("deepseek_cases", "deepseek_v32"),
]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    pytest.importorskip("safetensors", reason="needs safetensors (test extra)")
    return tmp_path_factory.mktemp("profile_ckpts")


def _build(root, module: str, case: str):
    import importlib

    cases = importlib.import_module(f"tests.{module}")
    return cases.build(root) if module == "deepseek_cases" else cases.build(case, root)


def _runtime_layout(model_config, page_size: int):
    from mesh_hicache.layout import StateLayout

    spec = model_config.state_spec(page_size)
    return StateLayout.for_coords(spec, (1, 1, 1), (0, 0, 0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("module", "case"), CHECKPOINTS, ids=[c for _, c in CHECKPOINTS])
def test_profile_bytes_equal_the_runtime_cache(ckpt_root, module, case, dtype):
    """The profile of a checkpoint's config.json holds exactly the bytes the runtime's
    cache allocates for that checkpoint (one rank): per page (KV or MLA latent + indexer
    key) and per recurrent-state slot; its layer and expert counts (what FLOPs count)
    are the runtime model's."""
    import torch

    from runtime.checkpoints import load_checkpoint

    directory = _build(ckpt_root, module, case)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dtype
    prof = from_hf_config(cfg)
    model = load_checkpoint(directory, getattr(torch, dtype)).config
    for page_size in (1, 16):
        layout = _runtime_layout(model, page_size)
        assert prof.page_bytes(page_size) == layout.page_bytes > 0
        assert prof.state_bytes == layout.slot_bytes
    assert prof.has_ssm == bool(model.ssm_layers)
    assert (prof.attention_layers, prof.ssm_layers) == (
        len(model.attention_layers),
        len(model.ssm_layers),
    )
    blocks = model.blocks
    assert (prof.mlp_layers, prof.moe_layers) == (blocks.count("M"), blocks.count("E"))
    if prof.moe_layers:
        assert (prof.num_experts, prof.experts_per_token) == (
            model.num_experts,
            model.experts_per_token,
        )
        assert (prof.expert_hidden, prof.shared_expert_hidden) == (
            model.expert_hidden,
            model.shared_expert_hidden,
        )
    if prof.mlp_layers:
        assert prof.mlp_hidden == model.mlp_hidden
        assert prof.mlp_gated == (model.mlp_kind == "swiglu")
    assert prof.attention_kind == {"plain": "gqa", "gated": "gated", "mla": "mla"}[model.attn_kind]
    if prof.has_ssm:
        assert prof.ssm_kind == model.ssm_kind


def _defaults(cls_name: str, arch: str, **overrides):
    """A full config.json of the real model's sizes: the transformers class defaults."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    cfg = getattr(transformers, cls_name)(dtype="bfloat16", **overrides).to_dict()
    cfg["architectures"] = [arch]
    return cfg


def test_real_sizes_equal_the_runtime_cache():
    """Qwen3-Next-80B-A3B, DeepSeek-V3.2 and the Mamba-2 hybrids at transformers'
    default sizes: the runtime's adapter and cache spec (no weights) against the profile."""
    import torch

    from runtime.checkpoints.loader import ADAPTERS

    for cls_name, arch in (
        ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
        ("NemotronHConfig", "NemotronHForCausalLM"),
        ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
        ("BambaConfig", "BambaForCausalLM"),
    ):
        cfg = _defaults(cls_name, arch)
        prof = from_hf_config(cfg)
        model = ADAPTERS[arch].model_config(cfg, torch.bfloat16, "real")
        layout = _runtime_layout(model, 16)
        assert prof.page_bytes(16) == layout.page_bytes
        assert prof.state_bytes == layout.slot_bytes
    # Written out: DeepSeek-V3.2 caches 512 + 64 latent and 128 indexer channels per layer;
    # Qwen3-Next's 12 gated-attention layers K+V of 2 x 256, its 36 GDN layers a float32
    # [32, 128, 128] state and a bf16 conv of 2 * 16 * 128 + 32 * 128 channels x 3.
    ds = from_hf_config(_defaults("DeepseekV32Config", "DeepseekV32ForCausalLM"))
    assert ds.kv_bytes_per_token == 61 * (512 + 64 + 128) * 2 and ds.state_bytes == 0
    qn = from_hf_config(_defaults("Qwen3NextConfig", "Qwen3NextForCausalLM"))
    assert qn.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert qn.state_bytes == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


def test_deepseek_v3_caches_the_latent_only(ckpt_root):
    """DeepSeek-V3 (no indexer): the V3.2 checkpoint's latent region, without its indexer."""
    import torch

    from runtime.checkpoints import load_checkpoint

    directory = _build(ckpt_root, "deepseek_cases", "deepseek_v32")
    v32 = json.loads((directory / "config.json").read_text())
    v3 = {k: v for k, v in v32.items() if not k.startswith("index_")}
    v3.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    layout = _runtime_layout(load_checkpoint(directory, torch.float32).config, 16)
    p3, p32 = from_hf_config(v3), from_hf_config(v32)
    assert p3.page_bytes(16) == layout.region("kv").row_bytes
    assert p32.page_bytes(16) - p3.page_bytes(16) == layout.region("indexer").row_bytes > 0
    # Kimi-K2 style: an unknown model_type with the DeepSeek-V3 architecture.
    assert from_hf_config({**v3, "model_type": "kimi_k2"}).page_bytes(16) == p3.page_bytes(16)


QWEN_NEXT_TINY = {
    "model_type": "qwen3_next",
    "dtype": "bfloat16",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "mlp_only_layers": [1],
}


def test_moe_and_gdn_flops_by_hand():
    p = from_hf_config(QWEN_NEXT_TINY)
    assert (p.attention_layers, p.ssm_layers, p.mlp_layers, p.moe_layers) == (1, 3, 1, 3)
    attention = 2 * 32 * (2 * 4 + 2 * 2) * 8 + 2 * 4 * 8 * 32  # gated q (+gate), k, v; o
    assert attention == 8192
    # GDN: q, k (2 x 2 heads x 8), v, z (2 x 4 x 6), b, a (2 x 4); conv of 56 channels;
    # delta rule 7 x 4 x 8 x 6; out 24 -> 32.
    gdn = 64 * (32 + 48 + 8) + 2 * 56 * 4 + 7 * 4 * 8 * 6 + 2 * 24 * 32
    assert gdn == 8960
    dense = 6 * 32 * 48
    moe = 2 * 32 * 4 + 6 * 32 * (2 * 16 + 24)  # router over 4; 2 active + the shared expert
    assert p.linear_flops_per_token == 3 * gdn + attention + dense + 3 * moe == 77312
    assert p.attention_flops_per_key == 4 * 4 * 8
    assert p.flops(0, 3) == 3 * 77312 + (1 + 2 + 3) * 128
    # Only the active experts count: more experts only widen the router ...
    more = from_hf_config({**QWEN_NEXT_TINY, "num_experts": 8})
    assert more.linear_flops_per_token - p.linear_flops_per_token == 3 * 2 * 32 * 4
    # ... one more expert per token adds one expert's MLP in each MoE layer.
    k3 = from_hf_config({**QWEN_NEXT_TINY, "num_experts_per_tok": 3})
    assert k3.linear_flops_per_token - p.linear_flops_per_token == 3 * 6 * 32 * 16
    # full_attention_interval instead of layer_types: every 2nd layer attention.
    periodic = {k: v for k, v in QWEN_NEXT_TINY.items() if k != "layer_types"}
    q = from_hf_config({**periodic, "full_attention_interval": 2})
    assert (q.attention_layers, q.ssm_layers) == (2, 2)


DEEPSEEK_TINY = {
    "model_type": "deepseek_v32",
    "dtype": "bfloat16",
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
}


def test_mla_flops_by_hand_and_the_top_k_cap():
    p = from_hf_config(DEEPSEEK_TINY)
    assert (p.attention_layers, p.mlp_layers, p.moe_layers, p.ssm_layers) == (3, 1, 2, 0)
    q = 2 * 32 * 24 + 2 * 24 * 4 * 16
    kv = 2 * 32 * (16 + 8) + 2 * 16 * 4 * (8 + 12)  # kv_a (latent + rope key), kv_b
    indexer = 2 * 24 * 8 * 16 + 2 * 32 * 16 + 2 * 32 * 8  # wq_b, wk, weights_proj
    mla = q + kv + 2 * 4 * 12 * 32 + indexer
    assert mla == 19456
    moe = 2 * 32 * 8 + 6 * 32 * (2 * 16 + 16)
    assert p.linear_flops_per_token == 3 * mla + 6 * 32 * 48 + 2 * moe == 87040
    main_key, index_key = 3 * (2 * 4 * 16 + 2 * 4 * 12), 3 * (2 * 8 * 16 + 2 * 8)
    assert (p.sparse_flops_per_key, p.dense_flops_per_key) == (main_key, index_key)
    # Position t: the indexer scores t + 1 keys, attention reads min(t + 1, 6) of them.
    for start, end in [(0, 0), (0, 1), (0, 6), (0, 10), (3, 9), (7, 40)]:
        naive = sum(
            87040 + (t + 1) * index_key + min(t + 1, 6) * main_key for t in range(start, end)
        )
        assert p.flops(start, end) == naive
    assert p.flops(0, 10) == 10 * 87040 + 55 * index_key + 45 * main_key
    # Beyond top-k a token's attention stops growing; the indexer's does not.
    assert p.flops(100, 101) - p.flops(99, 100) == index_key
    # The bytes: latent 16 + rope key 8 + indexer key 16 per layer, bf16, no V.
    assert p.kv_bytes_per_token == 3 * (16 + 8 + 16) * 2 and not p.has_ssm


def test_unknown_architectures_and_missing_keys_raise():
    llama = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "layer_types": ["full_attention"] * 32,
    }
    with pytest.raises(ValueError, match="model_type 'llama'.*LlamaForCausalLM"):
        from_hf_config(llama)
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        from_hf_config({k: v for k, v in QWEN_NEXT_TINY.items() if k != "linear_key_head_dim"})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        from_hf_config({k: v for k, v in DEEPSEEK_TINY.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="index_topk"):
        from_hf_config({k: v for k, v in DEEPSEEK_TINY.items() if k != "index_topk"})
    # A Qwen3.5 wrapper reads its text_config.
    wrapped = {"model_type": "qwen3_5_moe", "dtype": "bfloat16", "text_config": QWEN_NEXT_TINY}
    inner = {**QWEN_NEXT_TINY, "model_type": "qwen3_5_moe_text"}
    assert from_hf_config(wrapped).state_bytes == from_hf_config(inner).state_bytes > 0


# -- scripts/bench_hitrate.py ------------------------------------------------------------------


def test_parse_bytes():
    assert bench_hitrate.parse_bytes("5GB") == 5 * 10**9
    assert bench_hitrate.parse_bytes("1.5GiB") == 3 * 2**29
    assert bench_hitrate.parse_bytes("123") == 123
    assert bench_hitrate.parse_bytes("2e9") == 2 * 10**9
    with pytest.raises(Exception, match="not a byte size"):
        bench_hitrate.parse_bytes("5 parsecs")


def test_bench_hitrate_end_to_end(single_rank_group, tmp_path, capsys):
    trace = make_trace(trace_shape("chat", sessions=12), seed=0)
    path = str(tmp_path / "chat.jsonl")
    write_jsonl(trace, path)
    out = str(tmp_path / "r.json")
    args = [path, "--profile", "hybrid-7b", "--device-bytes", "1GB", "--page-size", "16"]
    assert bench_hitrate.main([*args, "--host-bytes", "4GB", "--json", out]) == 0
    result = bench_common.read_json(out)
    r = result["results"]
    assert r["input_tokens"] == sum(len(t.input_tokens) for t in trace)
    assert r["token_hit_rate"] == pytest.approx(r["reused_tokens"] / r["input_tokens"])
    assert 0 < r["token_hit_rate"] < 1
    tiers = r["per_tier"]
    assert sum(t["reused_tokens"] for t in tiers.values()) == r["reused_tokens"]
    assert sum(t["flops_saved"] for t in tiers.values()) == r["flops_saved"] > 0
    assert tiers["host"]["reused_tokens"] > 0
    # One arena of 1 MiB blocks (a page; a state takes 26) within the 1 GB budget.
    pools = r["pools"]
    assert pools["split"] == "arena" and 0 < pools["device_arena_blocks"] * 2**20 <= 10**9
    assert 0 < pools["end_device_state_fraction"] < 1
    assert "token_hit_rate" in capsys.readouterr().out
    # L1 alone reuses less than L1 + an L2 four times its size on the same trace.
    out1 = str(tmp_path / "r1.json")
    assert bench_hitrate.main([*args, "--json", out1]) == 0
    l1 = bench_common.read_json(out1)["results"]
    assert l1["per_tier"]["host"]["reused_tokens"] == 0
    assert l1["token_hit_rate"] < r["token_hit_rate"]


def test_bench_hitrate_errors(single_rank_group, tmp_path, capsys):
    path = str(tmp_path / "chat.jsonl")
    write_jsonl(make_trace(trace_shape("chat", sessions=2), seed=0), path)
    assert bench_hitrate.main([path, "--device-bytes", "1GB", "--baselines", "1,x"]) == 2
    assert "--baselines '1,x'" in capsys.readouterr().err
    assert bench_hitrate.main([path, "--device-bytes", "1MB"]) == 2
    assert "fewer than one page (1048576 B" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_hitrate.main([path, "--device-bytes", "lots"])


def test_bench_hitrate_policies_and_baselines(single_rank_group, tmp_path, capsys):
    trace = make_trace(trace_shape("chat", sessions=12), seed=0)
    path = str(tmp_path / "chat.jsonl")
    write_jsonl(trace, path)
    out = str(tmp_path / "r.json")
    args = [path, "--device-bytes", "1GB", "--state-share", "0.2", "--json", out]
    assert bench_hitrate.main([*args, "--policy", "cost", "--baselines", "0.5,2"]) == 0
    r = bench_common.read_json(out)["results"]
    assert r["policy"] == "cost" and 0 < r["token_hit_rate"] < 1
    base = r["baselines"]
    assert set(base["marconi"]) == {"0.5", "2.0"}
    best = base["marconi_best"]
    assert best["token_hit_rate"] == max(m["token_hit_rate"] for m in base["marconi"].values())
    assert best["alpha"] in (0.5, 2.0)
    # The baselines are replays of their own: lru equals a plain --policy lru run.
    assert bench_hitrate.main([*args, "--policy", "lru"]) == 0
    lru = bench_common.read_json(out)["results"]
    assert lru["token_hit_rate"] == base["lru"]["token_hit_rate"]
    assert "marconi_best_token_hit_rate" in capsys.readouterr().out


def test_bench_hitrate_default_policy_is_the_decay_cost_policy():
    from baseline_policies import GreedyDualSizePolicy

    from mesh_hicache.config import HiCacheConfig
    from mesh_hicache.radix.eviction import DecayCostPolicy
    from mesh_hicache.radix.policies import make_policy

    args = bench_hitrate.parser().parse_args(["t.jsonl", "--device-bytes", "1GB"])
    assert args.policy == "cost"
    assert HiCacheConfig(device_pages=1).eviction_policy == "lru"  # the cache's: opt-in
    prof = profile("hybrid-7b")
    chosen = make_policy(bench_hitrate.make_policy(args.policy, prof, 1.0), prof.cost_model())
    assert type(chosen) is DecayCostPolicy
    assert type(bench_hitrate.make_policy("gds", prof, 1.0)) is GreedyDualSizePolicy


def test_bench_hitrate_write_back_gate(single_rank_group, tmp_path):
    path = str(tmp_path / "chat.jsonl")
    write_jsonl(make_trace(trace_shape("chat", sessions=12), seed=0), path)
    args = [path, "--device-bytes", "1GB", "--host-bytes", "4GB"]
    runs = {}
    for gate in (False, True):
        out = str(tmp_path / f"r{gate}.json")
        flag = ["--write-back-gate"] if gate else []
        assert bench_hitrate.main([*args, *flag, "--json", out]) == 0
        runs[gate] = bench_common.read_json(out)
    assert runs[True]["config"]["write_back_gate"] is True
    assert runs[False]["results"]["evictions"]["refused_write_backs"] == 0
    for run in runs.values():  # L2 serves with or without the gate
        assert run["results"]["per_tier"]["host"]["reused_tokens"] > 0
