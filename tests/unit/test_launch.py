"""runtime.launch: clear errors for bad mesh sizes; torchrun prints one coordinate per rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_mismatched_mesh_is_a_clear_error():
    proc = _run(sys.executable, "-m", "runtime.launch", "--tp", "2")
    assert proc.returncode == 2
    assert "= 2 ranks, but 1 were launched" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nonpositive_axis_is_a_clear_error():
    proc = _run(sys.executable, "-m", "runtime.launch", "--cp", "0")
    assert proc.returncode == 2 and "--cp must be >= 1" in proc.stderr


def test_torchrun_prints_distinct_coordinates():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this interpreter")
    proc = _run(
        torchrun,
        "--nproc-per-node",
        "4",
        "--standalone",
        "-m",
        "runtime.launch",
        "--pp",
        "2",
        "--tp",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    triples = re.findall(r"\(pp, cp, tp\) = \((\d), (\d), (\d)\)", proc.stdout)
    assert sorted(triples) == [("0", "0", "0"), ("0", "0", "1"), ("1", "0", "0"), ("1", "0", "1")]


def test_a_rank_arriving_late_is_not_read_as_a_collective_timeout(tmp_path):
    # Rank 1 starts 6 s after rank 0, three times --collective-timeout-s 2: the start has
    # its own bound (STARTUP_TIMEOUT_S), the collectives after it keep the short one.
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed beside this interpreter")
    script = tmp_path / "late.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(6)\n"
        "from runtime.launch import exit_process, main\n"
        "exit_process(main(['--tp', '2', '--collective-timeout-s', '2']))\n"
    )
    proc = _run(torchrun, "--nproc-per-node", "2", "--standalone", str(script))
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"\(pp, cp, tp\) = ", proc.stdout)) == 2


def test_nonpositive_collective_timeout_is_a_clear_error():
    proc = _run(sys.executable, "-m", "runtime.launch", "--collective-timeout-s", "0")
    assert proc.returncode == 2 and "--collective-timeout-s must be > 0" in proc.stderr


def test_mesh_failure_names_lost_peers_only():
    import torch.distributed as dist

    from runtime.launch import mesh_failure

    line = mesh_failure(RuntimeError("[gloo.cc:78] Timed out waiting 4500ms for recv\nmore"))
    assert line is not None and "dead or frozen" in line and "Timed out" in line
    assert "\n" not in line
    assert mesh_failure(dist.DistError("Connection closed by peer")) is not None
    assert mesh_failure(RuntimeError("Connection reset by peer [127.0.0.1]:1234")) is not None
    assert mesh_failure(ValueError("bad token 7")) is None
    assert mesh_failure(RuntimeError("shape mismatch in layer 3")) is None
    assert len(mesh_failure(RuntimeError("gloo " + "x" * 1000)) or "") < 320
