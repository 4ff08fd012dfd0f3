"""Cache budgets sized from the machine (``runtime.budgets``): the defaults, the flags
that override them, the one-line error for a budget larger than the machine, and the
startup line of ``runtime.serve``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.budgets import (
    L1_CPU_BYTES,
    Machine,
    auto_device,
    check_budgets,
    size_from_machine,
)
from runtime.serve.flags import build_parser

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--model", "tiny", *argv])


def test_cpu_defaults_hold_the_stated_shares() -> None:
    big = Machine(gpu=False, device_free=0, device_total=0, host_available=64 * GIB, local_ranks=2)
    args = _args()
    assert auto_device(args)
    source = size_from_machine(args, big)
    assert args.device_bytes == L1_CPU_BYTES  # 1 GiB: below 1/8 of 32 GiB per rank
    assert args.host_bytes == 2 * L1_CPU_BYTES  # 25 % of 32 GiB = 8 GiB, at most 2x L1
    assert args.device_pages == 0 and "CPU default" in source
    small = Machine(gpu=False, device_free=0, device_total=0, host_available=4 * GIB, local_ranks=1)
    args = _args()
    size_from_machine(args, small)
    assert args.device_bytes == GIB // 2  # at most 1/8 of the host's 4 GiB
    assert args.host_bytes == GIB  # 25 % of 4 GiB


def test_gpu_defaults_take_a_share_of_free_memory() -> None:
    gpu = Machine(gpu=True, device_free=40 * GIB, device_total=80 * GIB, host_available=100 * GIB,
                  local_ranks=4)  # fmt: skip
    args = _args()
    source = size_from_machine(args, gpu)
    assert args.device_bytes == int(0.8 * 40 * GIB)
    assert args.host_bytes == int(0.25 * 25 * GIB)  # a quarter of this rank's host share
    assert "free device memory" in source


@pytest.mark.parametrize(
    ("flags", "device", "host"),
    [
        (("--device-pages", "64"), 0, 0),  # pages: no byte budget at all
        (("--device-bytes", str(GIB)), GIB, 0),  # L2 then follows host_ratio
        (("--host-bytes", str(GIB)), L1_CPU_BYTES, GIB),  # L1 sized, L2 given
    ],
)
def test_flags_override_the_machine(flags, device: int, host: int) -> None:
    machine = Machine(gpu=False, device_free=0, device_total=0, host_available=64 * GIB,
                      local_ranks=1)  # fmt: skip
    args = _args(*flags)
    size_from_machine(args, machine)
    assert (args.device_bytes, args.host_bytes) == (device, host)


def test_a_budget_larger_than_the_machine_is_an_error() -> None:
    machine = Machine(gpu=False, device_free=0, device_total=0, host_available=8 * GIB,
                      local_ranks=2)  # fmt: skip
    with pytest.raises(ValueError, match="--device-bytes .* more than this machine has"):
        check_budgets(_args("--device-bytes", str(5 * GIB)), machine)
    with pytest.raises(ValueError, match=r"--host-bytes .*\(2 local ranks\)"):
        check_budgets(_args("--device-bytes", str(GIB), "--host-bytes", str(4 * GIB)), machine)
    check_budgets(_args("--device-bytes", str(GIB), "--host-bytes", str(2 * GIB)), machine)
    gpu = Machine(gpu=True, device_free=GIB, device_total=2 * GIB, host_available=8 * GIB,
                  local_ranks=1)  # fmt: skip
    with pytest.raises(ValueError, match="of device memory"):
        check_budgets(_args("--device-bytes", str(3 * GIB)), gpu)


def _serve(*flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "runtime.serve", "--model", "tiny", "--sessions", "1"]
    cmd += ["--turns", "1", "--cache", "host", "--quiet", *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_serve_prints_the_budgets_and_refuses_too_much() -> None:
    proc = _serve("--device-bytes", str(4 << 20), "--host-bytes", str(8 << 20))
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if "cache budgets per rank" in x)
    assert "L1 4194304 bytes" in line and "L2 8388608 bytes" in line and "tokens" in line
    proc = _serve("--device-bytes", str(1 << 60))
    assert proc.returncode == 2
    errors = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(errors) == 1 and "more than this machine has" in errors[0], proc.stderr
