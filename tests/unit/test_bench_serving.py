"""scripts/bench_serving.py: speedup math, mode comparisons, table, and a tiny end-to-end run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_serving  # noqa: E402

from runtime.engine import RequestResult  # noqa: E402
from runtime.serve import percentile  # noqa: E402


def _result(request_id: int, turn: int, ttft: float, out: list[int]) -> RequestResult:
    return RequestResult(
        request_id=request_id,
        session=request_id % 2,
        turn=turn,
        prompt_len=10,
        cached_device=0,
        cached_host=0,
        cached_storage=0,
        ttft_s=ttft,
        decode_s=0.0,
        output_ids=out,
    )


def test_ideal_speedup() -> None:
    assert bench_serving.ideal_speedup(0.0) == 1.0
    assert bench_serving.ideal_speedup(0.75) == pytest.approx(4.0)
    assert bench_serving.ideal_speedup(1.0) == math.inf
    with pytest.raises(ValueError, match="hit_rate"):
        bench_serving.ideal_speedup(1.5)


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.95) == pytest.approx(9.5)


def test_speedup_and_comparisons() -> None:
    assert bench_serving.speedup(2.0, 0.5) == 4.0
    assert bench_serving.speedup(2.0, 0.0) == 0.0
    modes = {
        "off": {"ttft_p50_s": 1.0, "ttft_mean_s": 1.2, "hit_rate": 0.0},
        "host": {"ttft_p50_s": 0.4, "ttft_mean_s": 0.3, "hit_rate": 0.75},
        "all": {"ttft_p50_s": 0.1, "ttft_mean_s": 0.1, "hit_rate": 1.0},
    }
    bench_serving.add_comparisons(modes)
    assert modes["off"]["speedup"] == 1.0 and modes["off"]["speedup_vs_ideal"] == 1.0
    host = modes["host"]
    assert host["speedup"] == pytest.approx(2.5)
    assert host["speedup_mean"] == pytest.approx(4.0)
    assert host["ideal_speedup"] == pytest.approx(4.0)
    assert host["speedup_vs_ideal"] == pytest.approx(0.625)
    assert modes["all"]["ideal_speedup"] is None and modes["all"]["speedup_vs_ideal"] is None
    with pytest.raises(ValueError, match="'off'"):
        bench_serving.add_comparisons({"host": dict(host)})


def test_acceptance_checks() -> None:
    modes = {
        "off": {"prefill_tokens_computed": 100, "outputs_match": True},
        "device": {"prefill_tokens_computed": 80, "outputs_match": True},
        "host": {"prefill_tokens_computed": 60, "speedup_vs_ideal": 0.5, "outputs_match": True},
        "restart": {"prefill_tokens_computed": 100, "outputs_match": False},
    }
    got = bench_serving.acceptance(modes)
    assert got == {
        "host_fewer_prefill_than_device": True,
        "host_speedup_vs_ideal": 0.5,
        "host_speedup_vs_ideal_ok": False,
        "restart_fewer_prefill_than_off": False,
        "restart_outputs_match": False,
    }
    assert bench_serving.acceptance({"off": modes["off"]}) == {}


def test_outputs_match_and_ttft_by_turn() -> None:
    ref = [_result(0, 0, 1.0, [1, 2]), _result(1, 0, 3.0, [3]), _result(2, 1, 0.5, [4])]
    assert bench_serving.outputs_match(list(reversed(ref)), ref)
    assert not bench_serving.outputs_match(ref[:2] + [_result(2, 1, 0.5, [5])], ref)
    assert not bench_serving.outputs_match(ref[:2], ref)
    assert bench_serving.ttft_by_turn(ref) == [2.0, 0.5]
    assert bench_serving.ttft_by_turn([]) == []


def test_parse_modes() -> None:
    assert bench_serving.parse_modes("host,device") == ("off", "device", "host")
    assert bench_serving.parse_modes("restart,storage") == ("off", "storage", "restart")
    with pytest.raises(ValueError, match="unknown modes"):
        bench_serving.parse_modes("off,l4")
    with pytest.raises(ValueError, match="add 'storage'"):
        bench_serving.parse_modes("restart")


def test_render_table_rows_in_order() -> None:
    row = {
        "ttft_p50_s": 0.0123,
        "ttft_p95_s": 0.02,
        "prefill_tokens_computed": 7,
        "hit_rate": 0.5,
        "speedup": 2.0,
        "ideal_speedup": 2.0,
        "speedup_vs_ideal": 1.0,
        "outputs_match": True,
    }
    text = bench_serving.render_table({"off": row, "host": {**row, "outputs_match": False}})
    lines = text.splitlines()
    assert lines[0].startswith("| mode ")
    assert lines[2].startswith("| off ") and "12.3" in lines[2] and "50.0%" in lines[2]
    assert lines[3].startswith("| host ") and lines[3].rstrip(" |").endswith("NO")


def test_smoke_tiny_run(single_rank_group, tmp_path, capsys) -> None:
    """Every mode on 2 sessions x 2 turns of the tiny model, L1 too small for both."""
    path = tmp_path / "serving.json"
    argv = [
        "--model", "tiny", "--sessions", "2", "--turns", "2", "--first-prompt-len", "64",
        "--device-pages", "9", "--host-pages", "64", "--prefetch-threshold", "16",
        "--storage-root", str(tmp_path / "l3"), "--json", str(path), "--quiet", "--threads", "1",
    ]  # fmt: skip
    assert bench_serving.main(argv) == 0
    out = json.loads(path.read_text())
    assert out["benchmark"] == "serving"
    modes = out["modes"]
    assert list(modes) == list(bench_serving.MODES)
    assert out["results"]["modes"] == modes
    for m in modes.values():
        for key in (
            "ttft_p50_s",
            "ttft_p95_s",
            "prefill_tokens_computed",
            "hit_rate",
            "speedup",
            "ideal_speedup",
        ):
            assert key in m, key
        assert m["outputs_match"] is True
        assert len(m["ttft_by_turn_s"]) == 2
    assert out["results"]["outputs_match"] is True
    off = modes["off"]
    assert off["hit_rate"] == 0.0 and off["prefill_tokens_computed"] == off["prompt_tokens"]
    assert modes["host"]["prefill_tokens_computed"] < modes["device"]["prefill_tokens_computed"]
    assert modes["host"]["cached_host"] > 0
    assert modes["restart"]["cached_storage"] > 0
    assert modes["restart"]["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert modes["storage"]["cache_stats"]["storage_put_objects"] > 0
    accept = out["results"]["acceptance"]
    assert accept["host_fewer_prefill_than_device"] is True
    assert accept["restart_outputs_match"] is True
    # The fresh L3 root is removed afterwards; the table was printed.
    assert not any((tmp_path / "l3").iterdir())
    assert "| restart " in capsys.readouterr().out
