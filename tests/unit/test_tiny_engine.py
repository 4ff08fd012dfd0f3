"""examples/tiny_engine.py, the engine of docs/engine_guide.md, on one rank: it checks its
cached logits against a recompute itself (and fails if they differ), and a second process
on the same L3 root gets its first prefix from L3. Every run must exit normally (no
``os._exit``): return code 0 and no abort on the way out, five runs in a row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "examples" / "tiny_engine.py"
ABORTS = ("Abort", "terminate called", "Fatal Python error", "gloo threads still running")
HIT = re.compile(
    r"request (\d): prompt (\d+) tokens, reused (\d+) from \(L1, L2, L3\) \((\d+), (\d+), (\d+)\)"
)
DIFF = re.compile(r"max \|logit diff\| (\S+)")


def engine_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    return env


def check_run(proc: subprocess.CompletedProcess[str]) -> dict[int, tuple[int, ...]]:
    """Assert a clean, checked run; return each request's (reused, L1, L2, L3) tokens."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for word in ABORTS:
        assert word not in proc.stderr, proc.stderr[-3000:]
    assert "tiny_engine: OK" in proc.stdout
    diffs = [float(d) for d in DIFF.findall(proc.stdout)]
    assert len(diffs) == 3 and max(diffs) <= 1e-5, proc.stdout
    hits = {int(m[0]): tuple(int(x) for x in m[2:]) for m in HIT.findall(proc.stdout)}
    assert sorted(hits) == [0, 1, 2], proc.stdout
    return hits


@pytest.mark.timeout(300)
def test_one_rank_runs_twice_on_one_root_and_exits_normally(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    runs = []
    for _ in range(5):  # the exit is checked five times in a row
        proc = subprocess.run(
            [sys.executable, str(ENGINE), "--storage-root", str(root)],
            cwd=tmp_path,
            env=engine_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        runs.append(check_run(proc))
    first, second = runs[0], runs[1]
    assert first[0] == (0, 0, 0, 0)  # cold
    assert first[1] == (20, 20, 0, 0)  # L1: the shared 20-token prefix
    assert first[2] == (24, 24, 0, 0)  # L1: the decode checkpoint of request 0
    # A new process: empty L1 and L2, the prefix read from L3 (and checked by the engine).
    assert second[0] == (20, 0, 0, 20)
    assert second[1][0] == 24 and second[1][3] > 0
    assert runs[1:] == [second] * 4  # every later process sees the same tiers


def _code_lines(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        code = line.split("#", 1)[0].strip()
        if code:
            lines.append(re.sub(r"\s+", " ", code))
    return lines


def test_engine_guide_excerpts_are_tiny_engine_code() -> None:
    guide = (ROOT / "docs" / "engine_guide.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) >= 6, "the guide's python blocks are excerpts of the engine"
    engine = set(_code_lines(ENGINE.read_text()))
    missing = [line for b in blocks for line in _code_lines(b) if line not in engine]
    assert missing == [], f"docs/engine_guide.md lines not in examples/tiny_engine.py: {missing}"
    assert "### The prefill split" in guide  # HiCache.insert's error message points here
