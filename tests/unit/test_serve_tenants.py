"""runtime.serve tenants: ``--tenant NAME`` and a per-request ``"tenant"`` in a
``--prompts`` file reach the cache; identical prompts of two tenants share nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.serve.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(1, 66))  # 65 tokens: the cache matches 64 = 4 pages of 16


def _prompts(tmp_path: Path, name: str, tenants: list[str | None]) -> Path:
    path = tmp_path / f"{name}.jsonl"
    lines = []
    for t in tenants:
        item: dict = {"input_ids": PROMPT}
        if t is not None:
            item["tenant"] = t
        lines.append(json.dumps(item))
    path.write_text("\n".join(lines) + "\n")
    return path


def _serve(tmp_path: Path, name: str, tenants: list[str | None], *flags: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [
        sys.executable,
        "-m",
        "runtime.serve",
        "--prompts",
        str(_prompts(tmp_path, name, tenants)),
        "--device-pages",
        "32",
        "--prefetch-threshold",
        "16",
        "--max-new-tokens",
        "2",
        "--quiet",
        "--storage-root",
        str(tmp_path / "l3"),
        "--json",
        str(out),
        *flags,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["cached"] for r in json.loads(out.read_text())["requests"]]


def test_tenants_reach_the_cache_from_the_command_line_and_the_prompts_file(tmp_path):
    first = _serve(tmp_path, "first", ["alice", "bob", "alice", None], "--tenant", "carol")
    totals = [sum(c.values()) for c in first]
    # bob and carol (the --tenant default) get nothing of alice's identical prompt.
    assert totals[0] == 0 and totals[1] == 0 and totals[3] == 0
    assert first[2]["device"] == 64  # alice's own repeat hits
    # A new process on the same store: --tenant carol finds carol's objects (L3) ...
    again = _serve(tmp_path, "again", [None, "bob"], "--tenant", "carol")
    assert again[0]["storage"] == 64 and again[1]["storage"] == 64
    # ... and another --tenant finds none of them.
    other = _serve(tmp_path, "other", [None], "--tenant", "dave")
    assert sum(other[0].values()) == 0


@pytest.mark.parametrize("bad", [3, "a\x1fb"])
def test_prompts_file_tenant_is_validated(tmp_path, bad):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2], "tenant": bad}) + "\n")
    with pytest.raises(ValueError, match=":1: tenant"):
        load_prompts(path, 16)


def test_prompts_file_tenant_is_kept(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"input_ids": [1, 2], "tenant": "alice"}) + "\n" + json.dumps({"input_ids": [3]})
    )
    assert [t.tenant for t in load_prompts(path, 16)] == ["alice", None]
