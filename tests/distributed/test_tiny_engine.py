"""examples/tiny_engine.py under torchrun at tp=2 (two gloo ranks, as docs/engine_guide.md
shows it): each rank holds half the heads of every layer and half the channels of every
recurrent state, the engine checks its cached logits against a recompute, a second
``torchrun`` on the same L3 root gets its first prefix from L3, and both exit with 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_tiny_engine import ENGINE, check_run, engine_env

TIMEOUT_S = 300


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_tp2_under_torchrun_with_an_l3_hit_in_a_new_process(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch.distributed.run") is None:
        pytest.skip("torch.distributed.run (torchrun) is not available")
    root = tmp_path / "l3"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ENGINE),
        "--tp",
        "2",
        "--storage-root",
        str(root),
    ]
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            command,
            cwd=tmp_path,
            env=engine_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        runs.append(check_run(proc))
    assert runs[0][0] == (0, 0, 0, 0) and runs[0][1] == (20, 20, 0, 0)
    assert runs[1][0] == (20, 0, 0, 20)  # the new process read the prefix from L3
