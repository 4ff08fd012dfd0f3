"""runtime.serve end to end: cache off vs full give identical outputs; mesh = one rank;
--concurrency / --request-rate hand the (timed) trace to the scheduler; throughput summary."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import pytest

from runtime.engine import Engine
from runtime.model.config import PRESETS
from runtime.serve import main as serve
from runtime.workloads.generate import Turn, with_arrivals
from tests.serve_cases import ROOT, run_serve


def _serve(tmp_path, name, *extra, nproc=1):
    l3 = ("--storage-root", str(tmp_path / "l3"))
    run, proc = run_serve(tmp_path, name, *l3, *extra, nproc=nproc)
    return run, proc.stdout


def test_cache_off_and_full_agree_and_later_turns_hit(tmp_path):
    off, _ = _serve(tmp_path, "off", "--cache", "off")
    full, stdout = _serve(tmp_path, "full", "--cache", "full")
    assert [r["output_ids"] for r in full["requests"]] == [r["output_ids"] for r in off["requests"]]
    later = [r for r in full["requests"] if r["turn"] > 0]
    assert later and all(sum(r["cached"].values()) > 0 for r in later)
    assert full["summary"]["prefill_tokens_computed"] < off["summary"]["prefill_tokens_computed"]
    assert "hit rate" in stdout and "TTFT p50" in stdout
    # A restart on the same storage root serves the first turns from L3.
    again, _ = _serve(tmp_path, "again", "--cache", "full")
    assert again["summary"]["cached_storage"] > 0
    assert [r["output_ids"] for r in again["requests"]] == [
        r["output_ids"] for r in off["requests"]
    ]


def test_four_ranks_equal_one_rank(tmp_path):
    one, _ = _serve(tmp_path, "one", "--cache", "off", "--dump-logits")
    mesh, _ = _serve(
        tmp_path,
        "mesh",
        "--cache",
        "full",
        "--cp",
        "2",
        "--tp",
        "2",
        "--cp-kv",
        "shard",
        "--dump-logits",
        nproc=4,
    )
    assert [r["output_ids"] for r in mesh["requests"]] == [r["output_ids"] for r in one["requests"]]
    worst = max(
        max(abs(a - b) for a, b in zip(r["last_logits"], s["last_logits"], strict=True))
        for r, s in zip(mesh["requests"], one["requests"], strict=True)
    )
    assert worst < 1e-4  # float32 reduction order only (see tests/engine_cases.py)
    assert mesh["summary"]["cached_host"] + mesh["summary"]["cached_device"] > 0


def test_bad_mesh_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.serve", "--tp", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "runtime.serve: error" in proc.stderr


# -- load flags: --concurrency / --request-rate drive the scheduler ----------------------------

TINY = ["--model", "tiny", "--sessions", "3", "--turns", "2", "--max-new-tokens", "2"]
TINY += ["--first-prompt-len", "40", "--append-len", "8", "--threads", "1", "--quiet"]


class _StubSchedulerModule(types.ModuleType):
    """A stand-in ``runtime.scheduler`` (the contract's interface): serves sequentially
    through ``Engine.run`` and records what runtime.serve handed it."""

    def __init__(self) -> None:
        super().__init__("runtime.scheduler")
        self.seen: list[tuple[object, list[Turn]]] = []
        seen = self.seen

        @dataclasses.dataclass(frozen=True)
        class SchedulerConfig:
            max_running: int = 8
            token_budget: int = 256
            realtime: bool = False

        class Scheduler:
            def __init__(self, model, cache, config, *, max_new_tokens=8, keep_logits=False):
                self.engine = Engine(model, cache, max_new_tokens, keep_logits)
                self.config = config

            def run(self, trace, progress=None):
                seen.append((self.config, list(trace)))
                return self.engine.run(trace, progress)

        self.SchedulerConfig = SchedulerConfig
        self.Scheduler = Scheduler


def _main(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert serve.main([*TINY, "--cache", "device", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_load_flags_reach_the_scheduler_and_the_summary(tmp_path, monkeypatch):
    stub = _StubSchedulerModule()
    monkeypatch.setitem(sys.modules, "runtime.scheduler", stub)
    seq = _main(tmp_path, "seq")
    assert stub.seen == []  # --concurrency 1 without times: Engine.run
    flags = ("--concurrency", "3", "--token-budget", "64", "--request-rate", "40")
    got = _main(tmp_path, "load", *flags, "--think-s", "0.01", "--seed", "0")
    ((config, trace),) = stub.seen
    assert (config.max_running, config.token_budget, config.realtime) == (3, 64, True)
    plain = serve.workload(serve.build_parser().parse_args(TINY), PRESETS["tiny"].vocab_size)
    assert trace == with_arrivals(plain, 40.0, seed=0, think_s=0.01)
    assert [r["output_ids"] for r in got["requests"]] == [r["output_ids"] for r in seq["requests"]]
    # --concurrency alone: batched, all at once (no real-time replay).
    _main(tmp_path, "batch", "--concurrency", "2")
    assert stub.seen[1][0].realtime is False and stub.seen[1][1] == plain
    for run in (seq, got):
        s, reqs = run["summary"], run["requests"]
        tokens = sum(r["prompt_len"] + len(r["output_ids"]) for r in reqs)
        assert s["generated_tokens"] == sum(len(r["output_ids"]) for r in reqs) == 12
        assert s["throughput_tps"] == pytest.approx(tokens / s["wall_s"])
        assert s["throughput_rps"] == pytest.approx(len(reqs) / s["wall_s"])
        assert s["ttft_p99_s"] >= s["ttft_p50_s"] > 0


def test_prompts_file_times_select_the_scheduler(tmp_path, monkeypatch):
    stub = _StubSchedulerModule()
    monkeypatch.setitem(sys.modules, "runtime.scheduler", stub)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"input_ids": [1, 2, 3], "session": 1, "arrival_s": 0.02}\n'
        '{"input_ids": [4, 5], "session": 1, "think_s": 0.01}\n'
    )
    _main(tmp_path, "p", "--prompts", str(prompts))
    ((config, trace),) = stub.seen
    assert config.realtime and config.max_running == 1
    assert [(t.arrival_s, t.think_s) for t in trace] == [(0.02, 0.0), (None, 0.01)]


def test_batched_timed_serve_equals_sequential(tmp_path):
    """The real scheduler: 3 in flight, Poisson arrivals; the same tokens as one by one,
    TTFT counted from each arrival, the summary's throughput over the whole run."""
    seq = _main(tmp_path, "seq")
    got = _main(tmp_path, "load", "--concurrency", "3", "--request-rate", "20", "--think-s", "0.02")
    assert [r["output_ids"] for r in got["requests"]] == [r["output_ids"] for r in seq["requests"]]
    firsts = [r for r in got["requests"] if r["turn"] == 0]
    plain = serve.workload(serve.build_parser().parse_args(TINY), PRESETS["tiny"].vocab_size)
    planned = [t.arrival_s for t in with_arrivals(plain, 20.0, seed=0) if t.turn == 0]
    # Served no earlier than planned (real time), TTFT from arrival.
    for r, when in zip(firsts, planned, strict=True):
        assert r["arrival_s"] >= when - 1e-6
        assert r["ttft_s"] == pytest.approx(r["first_token_s"] - r["arrival_s"])
    s = got["summary"]
    assert s["wall_s"] >= max(r["finish_s"] for r in got["requests"]) - 1e-6
    assert s["throughput_rps"] == pytest.approx(len(got["requests"]) / s["wall_s"])
