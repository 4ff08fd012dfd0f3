"""runtime.serve end to end: cache off vs full give identical outputs; mesh = one rank."""

from __future__ import annotations

import subprocess
import sys

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
