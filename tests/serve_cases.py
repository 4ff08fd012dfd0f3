"""Running ``runtime.serve`` as a subprocess (one rank, or ``nproc`` under torchrun) on
a small workload, for the end-to-end serve tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    "--sessions",
    "3",
    "--turns",
    "3",
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
    "--quiet",
]


def run_serve(
    out_dir: Path, name: str, *extra: str, nproc: int = 1, drop_env: tuple[str, ...] = ()
) -> tuple[dict, subprocess.CompletedProcess[str]]:
    """``runtime.serve`` with ``SMALL`` + ``--json out_dir/name.json`` + ``extra``: the
    JSON report and the finished process (asserted to exit 0). The rank variables of an
    outer launcher and ``drop_env`` are removed from the environment; ``nproc > 1``
    skips when torchrun is not installed beside this interpreter."""
    out = out_dir / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for key in drop_env:
        env.pop(key, None)
    cmd = [sys.executable, "-m", "runtime.serve"]
    if nproc > 1:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        if not os.path.exists(torchrun):
            pytest.skip("torchrun is not installed beside this interpreter")
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "runtime.serve"]
    cmd += [*SMALL, "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc
