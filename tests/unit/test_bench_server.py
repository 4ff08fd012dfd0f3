"""scripts/bench_server.py: prompts, summaries, B/A ratios, the output check, and a tiny
end-to-end run against two real server subprocesses."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_server  # noqa: E402
from bench_server_client import RequestRecord  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _rec(conv: int, turn: int, out: tuple[int, ...], ttft: float = 0.1) -> RequestRecord:
    return RequestRecord(conv, turn, 10, 4, out, ttft, 2 * ttft)


def test_conversations_share_system_prompts() -> None:
    convs = bench_server.make_conversations(256, 2, 32, 5, 8, 3, seed=0)
    assert [c.index for c in convs] == list(range(5))
    assert all(len(c.first_prompt) == 40 and len(c.appends) == 2 for c in convs)
    assert convs[0].first_prompt[:32] == convs[2].first_prompt[:32] == convs[4].first_prompt[:32]
    assert convs[0].first_prompt[:32] != convs[1].first_prompt[:32]
    assert len({c.first_prompt for c in convs}) == 5  # distinct user suffixes
    assert all(0 < t < 256 for c in convs for t in c.first_prompt)
    assert bench_server.make_conversations(256, 2, 32, 5, 8, 3, seed=0) == convs
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_server.make_conversations(256, 0, 32, 5, 8, 3, seed=0)


def test_summarize_and_output_mismatches() -> None:
    ref = [_rec(0, 0, (1, 2), 0.1), _rec(0, 1, (3,), 0.3), _rec(1, 0, (4, 5), 0.2)]
    s = bench_server.summarize(ref, wall_s=2.0)
    assert s["requests"] == 3 and s["requests_per_s"] == 1.5
    assert s["output_tokens"] == 5 and s["output_tokens_per_s"] == 2.5
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["latency_p50_s"] == pytest.approx(0.4)
    assert s["hit_rate"] == pytest.approx(0.4)
    assert bench_server.output_mismatches(list(reversed(ref)), ref) == []
    bad = bench_server.output_mismatches([ref[0], _rec(0, 1, (9,)), ref[2]], ref)
    assert bad == ["conversation 0 turn 1: reference (3,), got (9,)"]
    assert bench_server.output_mismatches(ref[:2], ref) == [
        "conversation 1 turn 0: reference (4, 5), got None"
    ]
    many = bench_server.output_mismatches([], ref, limit=1)
    assert len(many) == 2 and many[1] == "... 2 more"


def test_ratios_are_per_repetition_then_median() -> None:
    def run(rep: int, mode: str, rps: float, ttft: float) -> dict:
        return {
            "repeat": rep,
            "mode": mode,
            "concurrency": 1 if mode == "A" else 8,
            "requests_per_s": rps,
            "output_tokens_per_s": 10 * rps,
            "ttft_p50_s": ttft,
            "ttft_p99_s": 2 * ttft,
        }

    runs = [
        run(0, "A", 1.0, 1.0),
        run(0, "B", 3.0, 0.5),
        run(1, "B", 1.0, 0.5),  # repetition 1: the box was slow for both
        run(1, "A", 0.25, 2.0),
        run(2, "A", 2.0, 1.0),
        run(2, "B", 2.0, 1.0),
        run(3, "A", 5.0, 1.0),  # no B: left out
    ]
    r = bench_server.ratios(runs)
    assert [row["repeat"] for row in r["per_repeat"]] == [0, 1, 2]
    # (3, 4, 1): the median is 3, not median(B) / median(A) = 2 / 1.
    assert r["requests_per_s"] == {"median": 3.0, "min": 1.0, "max": 4.0}
    assert r["ttft_p50_s"]["median"] == 0.5 and r["ttft_p99_s"]["min"] == 0.25
    medians = bench_server.mode_medians(runs, "A")
    assert medians["requests_per_s"] == 1.5 and medians["repeats"] == 4
    assert medians["concurrency"] == 1 and medians["mode"] == "A"


def test_bad_flags_exit_2(capsys) -> None:
    assert bench_server.main(["--clients", "0"]) == 2
    assert "--clients must be >= 1" in capsys.readouterr().err
    assert bench_server.main(["--model", "no-such-preset"]) == 2
    assert "neither a preset" in capsys.readouterr().err


TINY = [
    "--model", "tiny", "--clients", "3", "--conversations", "3", "--turns", "2",
    "--system-prompts", "2", "--system-len", "32", "--user-len", "8", "--max-tokens", "3",
    "--repeats", "1", "--warmup", "1", "--b-concurrency", "4",
]  # fmt: skip


def test_smoke_tiny_run(tmp_path, capsys) -> None:
    """A and B on two fresh server subprocesses: JSON fields, equal outputs, no leftovers."""
    path = tmp_path / "server.json"
    assert bench_server.main([*TINY, "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["benchmark"] == "server"
    res = out["results"]
    assert [(r["repeat"], r["mode"], r["concurrency"]) for r in res["runs"]] == [
        (0, "A", 1),
        (0, "B", 4),
    ]
    for r in res["runs"]:
        assert r["requests"] == 6 and r["output_tokens"] == 18
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
        assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
        assert r["latency_p50_s"] >= r["ttft_p50_s"]
        assert r["hit_rate"] > 0  # every second turn extends its first
    assert res["runs"][0]["peak_running"] == 1
    for mode in ("A", "B"):
        for key in ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "hit_rate"):
            assert key in res["modes"][mode], key
    for metric in bench_server.RATIO_METRICS:
        assert res["ratios"][metric]["median"] > 0
    assert len(res["ratios"]["per_repeat"]) == 1
    assert res["outputs_match"] is True and res["mismatches"] == []
    assert len(res["requests"]) == 6 and all(len(r["output_ids"]) == 3 for r in res["requests"])
    captured = capsys.readouterr()
    assert "[repeat 1/1] B" in captured.err and "| B " in captured.out


def test_a_mismatch_is_loud_and_exits_1(tmp_path, capsys, monkeypatch) -> None:
    """B's outputs altered (no servers: run_mode is replaced): exit 1, JSON says so."""

    def fake_run_mode(args, repeat, mode, concurrency, conversations, warmup):
        records = [
            RequestRecord(c.index, t, 40, 0, (1, 2, 3) if mode == "A" else (1, 2, 4), 0.1, 0.2)
            for c in conversations
            for t in range(len(c.appends) + 1)
        ]
        return bench_server.ModeRun(repeat, mode, concurrency, records, 1.0, concurrency)

    monkeypatch.setattr(bench_server, "run_mode", fake_run_mode)
    path = tmp_path / "server.json"
    assert bench_server.main([*TINY, "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: greedy outputs differ" in err
    assert "repeat 0 B vs first A: conversation 0 turn 0: reference (1, 2, 3), got (1, 2, 4)" in err
    res = json.loads(path.read_text())["results"]
    assert res["outputs_match"] is False and len(res["mismatches"]) == 6
