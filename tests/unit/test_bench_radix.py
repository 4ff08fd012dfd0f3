"""scripts/bench_radix.py: equal-work weighting by hand, and a tiny end-to-end run against
the OLD tree (extracted from git at run time) whose trees must agree on every hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)

from bench_radix import OLD_REV, REPO  # noqa: E402
from bench_radix_drive import by_victims, equal_work  # noqa: E402


def test_equal_work_reweights_calls_to_the_reference_mix_of_victims():
    # This tree: 3 one-victim calls (10 us) and 1 two-victim call (40 us); the reference
    # made as many one- as two-victim calls, so each group weighs one half.
    groups = by_victims([10_000, 10_000, 10_000, 40_000], [1, 1, 1, 2])
    ref = {1: [1], 2: [1], 5: [1]}  # a victim count only the reference has is left out
    out = equal_work(groups, ref)
    assert out["n"] == 4
    assert out["mean_us"] == pytest.approx(0.5 * 10 + 0.5 * 40)
    assert out["p99_us"] == pytest.approx(40)
    assert equal_work(groups, {3: [1]}) == {"n": 0}


def test_tiny_run_agrees_with_the_old_tree_and_reports_every_size(tmp_path):
    known = subprocess.run(
        ["git", "-C", REPO, "cat-file", "-e", f"{OLD_REV}^{{commit}}"], capture_output=True
    )
    if known.returncode:
        pytest.skip(f"git history without {OLD_REV} (a shallow clone): no OLD tree to run")
    out = tmp_path / "radix.json"
    cmd = [sys.executable, os.path.join(SCRIPTS, "bench_radix.py"), "--pages", "300", "600"]
    cmd += ["--page-sizes", "16", "--hash-page-sizes", "16", "--requests", "40"]
    cmd += ["--warmup", "10", "--flat-requests", "40", "--check", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert [c["pages"] for c in res["configs"]] == [300, 600]
    for c in res["configs"]:
        assert c["same_hits"] is True
        assert c["new"]["match"]["n"] == c["old"]["match"]["n"] == 40
        assert c["new"]["evict"]["n"] > 0  # the pools are small: requests must evict
    (flat,) = res["flatness"]
    for size in ("300", "600"):
        assert flat[size]["evict"]["n"] > 0 and flat[size]["evict_equal_work"]["n"] > 0
    assert res["hashing"]["16"]["new_chained"] > 0
