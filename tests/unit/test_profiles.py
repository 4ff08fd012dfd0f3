"""runtime.profiles: bytes per page/state and FLOPs per token; scripts/bench_hitrate.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

from runtime.profiles import ModelProfile, from_hf_config, load_hf_config, profile
from runtime.traces import make_trace, trace_shape, write_jsonl

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
    assert p.state_bytes == 4 * (conv_dim * 3 + 32 * 64 * 128) * 2
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
    from mesh_hicache.config import HiCacheConfig
    from mesh_hicache.radix.eviction import CostPolicy, DecayCostPolicy, make_policy

    args = bench_hitrate.parser().parse_args(["t.jsonl", "--device-bytes", "1GB"])
    assert args.policy == "cost"
    assert HiCacheConfig(device_pages=1).eviction_policy == "lru"  # the cache's: opt-in
    prof = profile("hybrid-7b")
    chosen = make_policy(bench_hitrate.make_policy(args.policy, prof, 1.0), prof.cost_model())
    assert type(chosen) is DecayCostPolicy
    assert type(bench_hitrate.make_policy("gds", prof, 1.0)) is CostPolicy


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
