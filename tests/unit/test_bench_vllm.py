"""scripts/bench_vllm.py: the workload's conversations, /metrics parsing, vLLM's block bytes,
ratios over vLLM alone, and its smallest end-to-end run (vLLM's CPU build and runtime.server
as real subprocesses; needs the vLLM venv that scripts/setup_vllm.sh makes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_vllm  # noqa: E402
import bench_vllm_servers as servers  # noqa: E402

pytestmark = pytest.mark.timeout(120)
VLLM_PYTHON = SCRIPTS.parent / ".venv-vllm" / "bin" / "python"


def test_conversations_follow_the_multiturn_workload() -> None:
    convs = bench_vllm.conversations_from_workload(3, 4, 100, 64, 8, seed=1)
    assert [c.index for c in convs] == [0, 1, 2]
    assert all(len(c.first_prompt) == 64 and len(c.appends) == 3 for c in convs)
    assert all(len(a) == 8 for c in convs for a in c.appends)
    # The shared 32-token instruction, then each session's own tokens.
    assert convs[0].first_prompt[:32] == convs[1].first_prompt[:32] == convs[2].first_prompt[:32]
    assert len({c.first_prompt for c in convs}) == 3
    assert bench_vllm.conversations_from_workload(3, 4, 100, 64, 8, seed=1) == convs


VLLM_TEXT = """# HELP vllm:prefix_cache_hits_total hits
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 300.0
vllm:prefix_cache_hits_created{engine="0",model_name="bench"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 1000.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 200.0
vllm:prompt_tokens_total{engine="0",model_name="bench"} 1000.0
"""
RUNTIME_TEXT = """mesh_hicache_hit_tokens_total{cp="0",pp="0",tier="device",tp="0"} 10.0
mesh_hicache_hit_tokens_total{cp="0",pp="0",tier="host",tp="0"} 5.0
mesh_hicache_hit_tokens_total{cp="0",pp="0",tier="storage",tp="0"} 1.0
mesh_hicache_hit_tokens_total{cp="1",pp="0",tier="host",tp="0"} 2.0
mesh_hicache_server_prompt_tokens_total 40.0
"""


def test_counter_sums_and_tier_rates() -> None:
    v = servers.counter_sums(VLLM_TEXT, servers.VLLM_METRICS)
    assert v == {
        "device_queries": 1000.0,
        "device_hits": 300.0,
        "external_queries": 0.0,
        "external_hits": 200.0,
        "prompt_tokens": 1000.0,
    }
    r = servers.counter_sums(RUNTIME_TEXT, servers.RUNTIME_METRICS)
    assert r == {"device_hits": 10.0, "host_hits": 7.0, "storage_hits": 1.0, "prompt_tokens": 40.0}
    before = dict.fromkeys(r, 0.0) | {"host_hits": 3.0}
    rates = bench_vllm.tier_rates(before, r, prompt=20)
    assert rates == {"device_hit_rate": 0.5, "host_hit_rate": 0.2, "storage_hit_rate": 0.05}


def test_connector_counters_from_its_stats_file(tmp_path: Path) -> None:
    assert servers.connector_counters(None) == {}
    assert servers.connector_counters(tmp_path / "absent.json") == {}
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"scheduler": {"l2_hit_tokens": 128, "l3_hit_tokens": 256}}))
    got = servers.connector_counters(stats)
    assert got["connector_l2_hits"] == 128 and got["connector_l3_hits"] == 256
    rates = bench_vllm.tier_rates({}, got, prompt=512)
    assert rates == {"connector_l2_hit_rate": 0.25, "connector_l3_hit_rate": 0.5}


def test_root_cause_is_the_first_error() -> None:
    lines = [
        "INFO starting\n",
        "(EngineCore pid=1) ERROR ValueError: To serve at least one request ...\n",
        "RuntimeError: Engine core initialization failed. See root cause above.\n",
    ]
    assert servers.root_cause(lines) == "ValueError: To serve at least one request ..."
    assert servers.root_cause(["just a line\n"]) == "just a line"


def test_block_bytes() -> None:
    llama = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    llama["num_hidden_layers"] = 3
    assert servers.block_bytes(llama, 16) == 16 * 2 * 2 * 64 * 4 * 3
    hybrid = dict(llama, layer_types=["mamba", "attention"] * 2 + ["mamba"] * 2)
    assert servers.block_bytes(hybrid, 128) == 128 * 2 * 2 * 64 * 4 * 2  # 2 attention layers


def test_ratios_over_vllm_alone_per_repetition() -> None:
    def row(rep: int, mode: str, rps: float) -> dict:
        return {
            "repeat": rep,
            "mode": mode,
            "requests_per_s": rps,
            "output_tokens_per_s": rps * 4,
            "ttft_p50_s": 1 / rps,
            "ttft_p99_s": 2 / rps,
            "hit_rate": 0.5,
        }

    runs = [row(0, "vllm", 2), row(0, "runtime", 4), row(1, "runtime", 3), row(1, "vllm", 1)]
    runs.append(row(2, "runtime", 9))  # no vLLM run in repetition 2: left out
    out = bench_vllm.ratios(runs, ["vllm", "runtime"])
    assert set(out) == {"runtime"}
    assert out["runtime"]["requests_per_s"] == {"median": 2.5, "min": 2.0, "max": 3.0}
    assert out["runtime"]["ttft_p50_s"]["median"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert out["runtime"]["hit_rate"]["median"] == 1.0


@pytest.mark.timeout(1800)
def test_smallest_run_vllm_and_runtime_server(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("needs the vLLM venv .venv-vllm (bash scripts/setup_vllm.sh)")
    out = tmp_path / "vllm.json"
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), OMP_NUM_THREADS="1")
    argv = [sys.executable, str(SCRIPTS / "bench_vllm.py"), "--modes", "vllm,runtime"]
    argv += ["--sessions", "2", "--turns", "2", "--first-len", "160", "--append-len", "16"]
    argv += ["--max-tokens", "4", "--clients", "2", "--repeats", "1", "--warmup", "0"]
    argv += ["--device-bytes", "0", "--json", str(out)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert results["outputs_match"] and len(results["requests"]) == 4
    assert all(len(r["output_ids"]) == 4 for r in results["requests"])
    for mode in ("vllm", "runtime"):
        row = results["modes"][mode]
        assert row["requests"] == 4 and row["requests_per_s"] > 0 and row["ttft_p50_s"] > 0
    # The second turn extends the first: both servers serve part of it from the cache.
    assert results["modes"]["vllm"]["device_hit_rate"] > 0
    assert results["modes"]["runtime"]["hit_rate"] > 0
    assert results["ratios"]["runtime"]["requests_per_s"]["median"] > 0
