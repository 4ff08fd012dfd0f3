"""Every program under examples/ runs to the end, and the library walk-through of
docs/library.md is code of examples/quickstart.py (so the snippet cannot drift from a
runnable program)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples() -> None:
    assert [p.name for p in EXAMPLES] == ["quickstart.py", "tiny_engine.py"]
    assert (ROOT / "examples" / "engine_integration.md").is_file()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(example)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]  # a clean exit
    assert f"{example.stem}: OK" in proc.stdout
    if example.name == "quickstart.py":  # the second process read the prefix from L3
        assert "process 2: reused 96 tokens, per tier (L1, L2, L3) (0, 0, 96)" in proc.stdout


def _code_lines(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        code = line.split("#", 1)[0].strip()
        if code:
            lines.append(re.sub(r"\s+", " ", code))
    return lines


def test_library_walk_through_is_quickstart_code() -> None:
    page = (ROOT / "docs" / "library.md").read_text()
    section = page.split("## A walk-through", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet, "no python block under '## A walk-through'"
    example = set(_code_lines((ROOT / "examples" / "quickstart.py").read_text()))
    missing = [line for line in _code_lines(snippet.group(1)) if line not in example]
    assert missing == [], f"docs/library.md lines not in examples/quickstart.py: {missing}"
