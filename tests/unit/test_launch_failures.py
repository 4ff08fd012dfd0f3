"""A failed launch of ``runtime.serve`` / ``runtime.server`` on a mesh says why in one line
per cause, with no Python or torch traceback: a wrong process count, a bad flag (once,
not once per rank), Ctrl-C, and ranks started with different flags or inputs (a
mismatch is found before any collective, and every rank exits 2)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _torchrun(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "runtime.torchrun", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        command + list(args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_wrong_process_count_is_one_line() -> None:
    proc = _torchrun("-m", "runtime.serve", "--tp", "4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "runtime.serve: error: --pp 1 x --cp 1 x --tp 4 = 4 ranks, but 2 were launched; "
        "use torchrun --nproc-per-node 4"
    ], proc.stderr[-3000:]


def test_a_bad_flag_is_printed_once() -> None:
    proc = _torchrun("-m", "runtime.server", "--bogus")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("unrecognized arguments: --bogus") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("usage:") == 1 and "Traceback" not in proc.stderr


def test_ctrl_c_stops_a_mesh_server_without_a_traceback() -> None:
    command = [sys.executable, "-m", "runtime.torchrun", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "runtime.server", "--tp", "2", "--port", "0", "--cache", "off"]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert any("serving" in line for line in lines), "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    log = "".join(lines) + rest
    assert "Traceback" not in log and "SignalException" not in log, log
    assert "requests served" in log, log
    assert proc.returncode in (0, 130), (proc.returncode, log)


def test_a_stop_message_to_ranks_that_left_is_one_warning(caplog) -> None:
    """After Ctrl-C the other ranks may be gone before rank 0's stop message: a lost peer
    then is one warning line, while any other error still propagates."""
    from runtime.server.worker import _Control

    def lost_peer() -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    def bug() -> None:
        raise ValueError("not a mesh failure")

    control = _Control(None)
    with caplog.at_level("WARNING"):
        control.last(lost_peer)
    assert [r.getMessage() for r in caplog.records] == [
        "runtime.server: the stop message did not reach every rank: a peer rank is dead or "
        "frozen (collective failed: [gloo/transport/tcp/pair.cc:553] Connection closed by peer)"
    ]
    with pytest.raises(ValueError, match="not a mesh failure"):
        control.last(bug)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(module: str, common: list[str], per_rank: list[list[str]]) -> list[tuple[int, str]]:
    """Start rank 0 and rank 1 of a 2-rank launch by hand (as two nodes would, each
    with its own command line); their exit codes and stderr."""
    port = _free_port()
    procs = []
    for rank, extra in enumerate(per_rank):
        env = dict(ENV, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *common, *extra],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        _, err = p.communicate(timeout=200)
        out.append((p.returncode, err))
    return out


def test_ranks_with_another_seed_stop_before_any_work(tmp_path: Path) -> None:
    common = ["--tp", "2", "--cache", "off", "--sessions", "1", "--turns", "1"]
    common += ["--json", str(tmp_path / "out.json")]
    t0 = time.monotonic()
    ranks = _two_ranks("runtime.serve", common, [["--seed", "0"], ["--seed", "5"]])
    assert [code for code, _ in ranks] == [2, 2], ranks
    assert ranks[0][1].strip().splitlines() == [
        "runtime.serve: error: the ranks disagree on --seed: rank 0 has 0, rank 1 has 5; "
        "start every rank with the same flags and inputs"
    ], ranks
    assert ranks[1][1].strip() == "", ranks  # one line for the launch, from rank 0
    assert not (tmp_path / "out.json").exists()
    assert time.monotonic() - t0 < 120  # not a collective timeout


def test_ranks_with_another_prompts_file_content_or_page_size_stop(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"input_ids": [1, 2, 3]}\n')
    b.write_text('{"input_ids": [1, 2, 4]}\n')
    ranks = _two_ranks(
        "runtime.serve",
        ["--tp", "2", "--cache", "off"],
        [["--prompts", str(a)], ["--prompts", str(b)]],
    )
    assert [code for code, _ in ranks] == [2, 2], ranks
    assert "the ranks disagree on the content of --prompts: rank 0 has sha256" in ranks[0][1]
    # The same content under another path is the same work.
    assert "disagree" not in "".join(
        e
        for _, e in _two_ranks(
            "runtime.serve",
            ["--tp", "2", "--cache", "off", "--quiet"],
            [["--prompts", str(a)], ["--prompts", str(_copy(a, tmp_path / "c.jsonl"))]],
        )
    )
    ranks = _two_ranks(
        "runtime.server",
        ["--tp", "2", "--port", "0"],
        [["--page-size", "16"], ["--page-size", "8"]],
    )
    assert [code for code, _ in ranks] == [2, 2], ranks
    assert "the ranks disagree on --page-size: rank 0 has 16, rank 1 has 8" in ranks[0][1]


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst
