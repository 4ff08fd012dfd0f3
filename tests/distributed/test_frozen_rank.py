"""Bounded stalls: a frozen (SIGSTOP) or dead (SIGKILL) rank of a 4-rank ``runtime.serve``
mesh makes every other rank exit non-zero within ``--collective-timeout-s``, each with
one line naming the cause. Ranks are plain processes on loopback (no torchrun, so no
agent kills the survivors for us: each must leave by itself)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 10.0
SLACK_S = 3.0
"""Process exit and this test's polling on a loaded 2-core machine (measured < 0.5 s)."""
WORKLOAD = [
    "--cp",
    "2",
    "--tp",
    "2",
    "--sessions",
    "64",
    "--turns",
    "4",
    "--first-prompt-len",
    "96",
    "--append-len",
    "24",
    "--device-pages",
    "16",
    "--prefetch-threshold",
    "32",
    "--max-new-tokens",
    "4",
    "--log-every",
    "1",
    "--threads",
    "1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(root: str, logs: str) -> list[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    procs = []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        log = os.path.join(logs, f"rank{rank}.log")
        with open(log, "wb") as out:
            cmd = [sys.executable, "-m", "runtime.serve", *WORKLOAD]
            cmd += ["--collective-timeout-s", str(TIMEOUT_S), "--storage-root", root]
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out), log))
    return procs


def _read(log: str) -> str:
    with open(log, errors="replace") as f:
        return f.read()


def _wait_serving(procs, deadline_s: float = 240.0) -> None:
    """Until rank 0 has logged its first served request (all ranks are in the loop)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if "[1/" in _read(procs[0][1]):
            return
        if any(p.poll() is not None for p, _ in procs):
            tails = "\n".join(_read(log)[-2000:] for _, log in procs)
            pytest.fail("a rank exited early:\n" + tails)
        time.sleep(0.2)
    pytest.fail("the mesh never started serving")


@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_a_frozen_or_dead_rank_ends_every_other_rank_within_the_bound(how):
    with tempfile.TemporaryDirectory() as tmp:
        procs = _spawn(os.path.join(tmp, "l3"), tmp)
        victim = procs[3][0]
        try:
            _wait_serving(procs)
            stopped_at = time.monotonic()
            victim.send_signal(signal.SIGSTOP if how == "sigstop" else signal.SIGKILL)
            exits = {}
            while len(exits) < 3 and time.monotonic() - stopped_at < TIMEOUT_S + SLACK_S:
                for rank, (p, _) in enumerate(procs[:3]):
                    if rank not in exits and p.poll() is not None:
                        exits[rank] = time.monotonic() - stopped_at
                time.sleep(0.1)
            logs = [_read(log) for _, log in procs[:3]]
            assert len(exits) == 3, f"still running after {TIMEOUT_S + SLACK_S} s: {exits}"
            for rank, (p, _) in enumerate(procs[:3]):
                assert p.returncode != 0, logs[rank][-2000:]
                lines = [ln for ln in logs[rank].splitlines() if "runtime.serve: error" in ln]
                assert len(lines) == 1, logs[rank][-3000:]
                assert "dead or frozen" in lines[0] and f"rank {rank}" in lines[0]
                assert "Traceback" not in logs[rank], logs[rank][-3000:]
            print(f"{how}: survivors exited after {sorted(exits.values())} s")
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                p.wait()
