"""scripts/bench_serving.py: speedup math, mode comparisons, table, and a tiny end-to-end run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_load  # noqa: E402
import bench_load_report  # noqa: E402
import bench_serving  # noqa: E402

from runtime.engine import RequestResult  # noqa: E402
from runtime.serve.main import percentile  # noqa: E402
from runtime.workloads.generate import Turn  # noqa: E402


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


# -- --mode load (scripts/bench_load.py) ------------------------------------------------------


def _sample(rep: int, ri: int, mode: str, rps: float, **extra) -> dict:
    base = {k: 1.0 for k in bench_load_report.METRICS}
    base.update(repeat=rep, rate_index=ri, rate=0.1 * (ri + 1), mode=mode, outputs_match=True)
    base.update(throughput_rps=rps, throughput_tps=100 * rps, **extra)
    return base


def test_rates_order_and_parsing() -> None:
    assert bench_load.choose_rates(2.0, 4, (0.5, 2.0)) == [0.25, 1.0]
    with pytest.raises(ValueError, match="positive service rate"):
        bench_load.choose_rates(0.0, 4, (1.0,))
    assert bench_load.mode_order(["off", "device", "host"], 0) == ["off", "device", "host"]
    assert bench_load.mode_order(["off", "device", "host"], 1) == ["host", "device", "off"]
    assert bench_load.parse_numbers("0.5, 2,,8", "--x") == [0.5, 2.0, 8.0]
    assert bench_load.parse_numbers("", "--x") == []
    with pytest.raises(ValueError, match="--rates: 'fast' is not a number"):
        bench_load.parse_numbers("1,fast", "--rates")
    with pytest.raises(ValueError, match="--hit-lengths: '0' must be > 0"):
        bench_load.parse_numbers("0", "--hit-lengths", int)
    assert bench_load.parse_load_modes("host") == ("off", "host")
    with pytest.raises(ValueError, match="unknown --load-modes \\['l9'\\]"):
        bench_load.parse_load_modes("l9")


def test_aggregate_takes_medians_and_same_run_ratios() -> None:
    samples = [
        _sample(0, 0, "off", 1.0),
        _sample(0, 0, "host", 3.0),
        _sample(1, 0, "host", 1.0),  # repetition 1: off was slow too
        _sample(1, 0, "off", 0.25),
        _sample(2, 0, "off", 2.0),
        _sample(2, 0, "host", 2.0, outputs_match=False),
        _sample(0, 1, "device", 5.0),  # no off at this rate
    ]
    rows = bench_load_report.aggregate(samples)
    assert [(r["rate_index"], r["mode"]) for r in rows] == [(0, "off"), (0, "host"), (1, "device")]
    off, host, device = rows
    assert off["throughput_rps"] == 1.0 and off["rps_vs_off"] == 1.0 and off["repeats"] == 3
    # Ratios per repetition (3, 4, 1), then the median; not median(host) / median(off).
    assert host["rps_vs_off"] == 3.0 and host["tps_vs_off"] == 3.0
    assert host["throughput_rps"] == 2.0 and host["label"] == "L1+L2"
    assert host["outputs_match"] is False and off["outputs_match"] is True
    assert device["rps_vs_off"] is None
    accept = bench_load_report.acceptance(rows)
    assert accept["saturating_rate"] == pytest.approx(0.2)
    assert accept["cached_above_off"] is False  # device has no ratio at the top rate
    top = bench_load_report.acceptance(rows[:2])
    assert top["host_rps_vs_off"] == 3.0 and top["host_at_least_2x_off"] is True
    assert top["cached_above_off"] is True and top["outputs_match"] is False
    table = bench_load_report.render_load_table(rows)
    assert "| L1+L2 " in table and "3.00x" in table and "NO" in table


def test_sequential_ratios_use_each_repetitions_own_run() -> None:
    samples = [
        _sample(0, 0, "off", 1.0, cpu_s=10.0),
        _sample(1, 0, "off", 2.0, cpu_s=20.0),
        _sample(2, 0, "off", 3.0, cpu_s=5.0),  # repetition 2 has no sequential run
        _sample(0, 0, "host", 4.0, cpu_s=5.0),
    ]
    rows = bench_load_report.aggregate(samples)
    sequential = {
        0: {"throughput_rps": 2.0, "cpu_s": 8.0},
        1: {"throughput_rps": 1.0, "cpu_s": 30.0},
    }
    bench_load_report.add_sequential_ratios(rows, samples, sequential)
    off, host = rows
    # Per repetition (0.5x, 2x), then the median; repetition 2 is left out.
    assert off["rps_vs_sequential_off"] == pytest.approx(1.25)
    assert off["cpu_vs_sequential_off"] == pytest.approx((0.8 + 1.5) / 2)
    assert host["rps_vs_sequential_off"] == 2.0 and host["cpu_vs_sequential_off"] == 1.6
    bench_load_report.add_sequential_ratios(rows, samples, {})
    assert off["rps_vs_sequential_off"] is None and off["cpu_vs_sequential_off"] is None
    table = bench_load_report.render_load_table(rows)
    assert "CPU vs sequential off" in table


def test_load_pages_fit_the_batch_not_the_working_set() -> None:
    args = bench_serving.build_parser().parse_args(["--device-pages", "8", "--host-pages", "4"])
    args.concurrency = 2
    trace = [Turn(i, i % 4, i // 4, tuple(range(30))) for i in range(8)]  # 4 sessions x 2
    device, host = bench_load.load_pages(args, trace)
    per_session = -(-(2 * (30 + args.max_new_tokens)) // args.page_size) + 1
    assert device == 3 * per_session  # the batch of 2 plus one: less than 4 sessions' worth
    assert host == 2 * 4 * per_session
    args.device_pages, args.host_pages = 1000, 2000
    assert bench_load.load_pages(args, trace) == (1000, 2000)  # never below the flags


def test_load_flags_are_checked(capsys) -> None:
    for argv, message in [
        (["--mode", "load", "--repeats", "0"], "--repeats must be >= 1"),
        (["--mode", "load", "--rate-factors", ""], "--rate-factors names no rate"),
        (["--mode", "load", "--rates", "-1"], "--rates: '-1' must be > 0"),
        (["--mode", "load", "--load-modes", "off,x"], "unknown --load-modes"),
        (["--mode", "load", "--concurrency", "0"], "--concurrency must be >= 1"),
    ]:
        assert bench_serving.main(argv) == 2
        assert message in capsys.readouterr().err


def test_smoke_load_run(single_rank_group, tmp_path, capsys) -> None:
    """--mode load on the tiny model: 2 rates x 4 modes x 2 repetitions, one hit length."""
    path = tmp_path / "load.json"
    argv = [
        "--mode", "load", "--model", "tiny", "--sessions", "2", "--turns", "2",
        "--first-prompt-len", "64", "--append-len", "16", "--max-new-tokens", "3",
        "--rate-factors", "0.5,50", "--repeats", "2", "--hit-lengths", "48",
        "--hit-repeats", "2", "--think-s", "0", "--concurrency", "2",
        "--storage-root", str(tmp_path / "l3"), "--json", str(path), "--threads", "1",
    ]  # fmt: skip
    assert bench_serving.main(argv) == 0
    out = json.loads(path.read_text())
    assert out["benchmark"] == "serving-load"
    res = out["results"]
    assert len(res["samples"]) == 2 * 2 * 4
    # Repetition 1 ran the modes in reverse order.
    first = [s["mode"] for s in res["samples"] if s["repeat"] == 0][:4]
    second = [s["mode"] for s in res["samples"] if s["repeat"] == 1][:4]
    assert first == list(bench_load.LOAD_MODES) and second == first[::-1]
    seq_rate = res["service_rps"] / 2  # sessions per second, 2 turns a session
    assert res["rates"] == pytest.approx([0.5 * seq_rate, 50 * seq_rate])
    # One sequential cache-off run per repetition (the first is the reference).
    assert [q["repeat"] for q in res["sequential"]] == [0, 1]
    assert all(q["outputs_match"] and q["cpu_s"] > 0 for q in res["sequential"])
    rows = res["rows"]
    assert [(r["rate_index"], r["mode"]) for r in rows] == [
        (i, m) for i in range(2) for m in bench_load.LOAD_MODES
    ]
    for r in rows:
        assert r["outputs_match"] is True and r["repeats"] == 2
        assert r["throughput_rps"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
        assert r["rps_vs_sequential_off"] > 0 and r["cpu_vs_sequential_off"] > 0
        if r["mode"] == "off":
            assert r["hit_rate"] == 0.0 and r["rps_vs_off"] == 1.0
        else:
            assert r["hit_rate"] > 0
    # The light rate is arrival-bound: its wall time covers the Poisson arrivals.
    light = [s for s in res["samples"] if s["rate_index"] == 0]
    assert all(s["throughput_rps"] <= 4 / s["wall_s"] + 1e-9 for s in light)
    hits = res["hit_ttft"]  # one row per engine path (paged / copy where Engine has both)
    assert len(hits) == len({h["path"] for h in hits}) >= 1
    for hit in hits:
        assert hit["cached_tokens"] == 48 and hit["hit_cached"] == 48 and hit["outputs_match"]
        assert len(hit["hit_ttft_all_s"]) == 2 and hit["hit_ttft_s"] > 0
    assert res["acceptance"]["outputs_match"] is True
    printed = capsys.readouterr().out
    assert "| L1+L2+L3 " in printed and "| cached tokens " in printed
    assert not any((tmp_path / "l3").iterdir())  # every fresh L3 root was removed


def test_load_plot_is_written(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e '.[plot]')")
    samples = [_sample(0, i, m, 1.0 + i) for i in range(2) for m in ("off", "host")]
    rows = bench_load_report.aggregate(samples)
    path = tmp_path / "load.png"
    assert bench_load_report.write_load_plot(rows, str(path)) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_plot_without_matplotlib(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert bench_load_report.write_load_plot([], str(tmp_path / "x.png")) is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
