"""The commands of README.md and docs/*.md run as written.

Cheap commands run: a fenced ``bash`` block right after the line ``<!-- test: run -->``
runs whole (the blocks of one page in order, in one temporary directory, so a later block
may use what an earlier one wrote), and so does every other command line that asks for
``--help`` or ``--version``. The other commands (long jobs, torchrun meshes, installs)
are parsed: ``python -m MODULE`` / ``torchrun ... -m MODULE`` names a module that exists,
and for this project's modules and scripts every ``--flag`` is one their ``--help``
lists; ``python PATH`` / ``torchrun PATH`` and ``scripts/*.sh`` name files that exist;
``pip install`` names only extras of ``pyproject.toml``. Relative links name files that
exist. The commands assume the virtual environment of the README is active: here
``python``, ``torchrun`` and ``pip`` are the ones beside this interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- test: run -->"
BLOCK = re.compile(r"^(?P<mark><!-- test: run -->\n)?```bash\n(?P<body>.*?)^```", re.M | re.S)
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1"}
SWITCHES = {"--standalone", "--no-python", "--run-path"}
"""torchrun options that take no value."""


@dataclass
class Block:
    page: Path
    line: int
    body: str
    run: bool

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Call:
    """One program a command line starts: what it is and the flags it passes."""

    kind: str  # "module", "script", "shell", "pip"
    target: str
    args: list[str] = field(default_factory=list)
    where: str = ""


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("body")) + 1
        out.append(Block(page, line, m.group("body"), bool(m.group("mark"))))
    return out


def command_lines(body: str) -> list[str]:
    """Logical lines of a block: continuations joined, comments and blanks dropped."""
    joined = body.replace("\\\n", " ")
    lines = []
    for raw in joined.splitlines():
        tokens = shlex.split(raw, comments=True)
        if tokens:
            lines.append(raw)
    return lines


def _segments(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments: list[list[str]] = [[]]
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in OPERATORS:
            segments.append([])
        elif token in REDIRECTS or token.startswith(">"):
            skip_next = token not in ("2>&1",)
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def calls(line: str, where: str) -> list[Call]:
    """The programs of one command line (``sh -c '...'`` and wrappers' ``--`` followed)."""
    out: list[Call] = []
    for tokens in _segments(line):
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
            tokens = tokens[1:]  # VAR=value prefixes
        if not tokens:
            continue
        head, rest = tokens[0], tokens[1:]
        if head == "taskset":
            while rest and (rest[0].startswith("-") or rest[0][0].isdigit()):
                rest = rest[1:]
            head, rest = rest[0], rest[1:]
        if head in ("sh", "bash") and rest[:1] == ["-c"]:
            out += calls(rest[1], where)
        elif head.startswith("scripts/") and head.endswith(".sh"):
            out.append(Call("shell", head, rest, where))
            if "--" in rest:
                out += calls(shlex.join(rest[rest.index("--") + 1 :]), where)
        elif head in ("python", "python3", "python3.11", "torchrun"):
            out += _python_call(head, rest, where)
        elif head == "pip" and rest[:1] == ["install"]:
            out.append(Call("pip", "install", rest[1:], where))
    return out


def _python_call(head: str, rest: list[str], where: str) -> list[Call]:
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "-m" and rest[i + 1] == "runtime.torchrun":  # torchrun's flags follow
            return [
                Call("module", rest[i + 1], [], where),
                *_python_call("torchrun", rest[i + 2 :], where),
            ]
        if token == "-m":
            return [Call("module", rest[i + 1], rest[i + 2 :], where)]
        if not token.startswith("-"):
            return [Call("script", token, rest[i + 1 :], where)]
        takes_value = head == "torchrun" and "=" not in token and token not in SWITCHES
        i += 2 if takes_value else 1
    return []


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
ALL_CALLS = [
    c
    for b in ALL_BLOCKS
    for n, line in enumerate(command_lines(b.body))
    for c in calls(line, f"{b.where()} #{n + 1}")
]


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("MESH_HICACHE_STORAGE_SECRET_FILE", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env["XDG_CACHE_HOME"] = str(tmp / "xdg-cache")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _bash(script: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_there_are_commands_to_run_and_to_parse() -> None:
    assert sum(b.run for b in ALL_BLOCKS) >= 2 and HELP_LINES
    assert {c.target for c in ALL_CALLS if c.kind == "module"} >= {
        "runtime.serve",
        "runtime.server",
        "runtime.make_checkpoint",
    }


RUN_PAGES = sorted({b.page for b in ALL_BLOCKS if b.run})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_marked_blocks_run(page: Path, tmp_path: Path) -> None:
    for block in (b for b in blocks(page) if b.run):
        proc = _bash(block.body, tmp_path)
        assert proc.returncode == 0, f"{block.where()}:\n{proc.stdout[-1500:]}{proc.stderr[-3000:]}"


HELP_LINES = sorted(
    {
        (line.strip(), b.where())
        for b in ALL_BLOCKS
        if not b.run
        for line in command_lines(b.body)
        if re.search(r"(^|\s)--(help|version)(\s|$)", line)
    }
)


@pytest.mark.parametrize(("line", "where"), HELP_LINES)
def test_help_and_version_lines_run(line: str, where: str, tmp_path: Path) -> None:
    proc = _bash(line, tmp_path, timeout=120)
    assert proc.returncode == 0, f"{where}: {line}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip()


def _own(module: str) -> bool:
    return module.split(".")[0] in ("runtime", "mesh_hicache")


_HELP: dict[str, str] = {}

_SCRIPT_HELPS = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    folder = path.rsplit("/", 1)[0]
    sys.path[:0] = [folder]
    buf = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
    except SystemExit:
        pass
    out[path] = buf.getvalue()
print(json.dumps(out))
"""


def _help_text(call: Call) -> str:
    """``--help`` of one of this project's modules (its ``build_parser``, in process) or
    scripts (all of them in one subprocess: one torch import, not one per script)."""
    key = f"{call.kind}:{call.target}"
    if key in _HELP:
        return _HELP[key]
    if call.kind == "module":
        build = getattr(importlib.import_module(call.target), "build_parser", None)
        if build is not None:
            _HELP[key] = build().format_help()
        else:
            cmd = [sys.executable, "-m", call.target, "--help"]
            proc = subprocess.run(
                cmd, cwd=ROOT, env=_env(ROOT), capture_output=True, text=True, timeout=120
            )
            assert proc.returncode == 0, f"{call.where}: {cmd}\n{proc.stderr[-2000:]}"
            _HELP[key] = proc.stdout
        return _HELP[key]
    scripts = sorted({c.target for c in ALL_CALLS if c.kind == "script"})
    scripts = [t for t in scripts if t.startswith("scripts/") and (ROOT / t).is_file()]
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT_HELPS, *(str(ROOT / t) for t in scripts)],
        cwd=ROOT,
        env=_env(ROOT),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    for target in scripts:
        text = helps[str(ROOT / target)]
        assert "usage:" in text, f"{target} --help printed no usage"
        _HELP[f"script:{target}"] = text
    return _HELP[key]


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def test_modules_exist_and_take_the_flags_used() -> None:
    problems = []
    for call in (c for c in ALL_CALLS if c.kind == "module"):
        if importlib.util.find_spec(call.target) is None:
            problems.append(f"{call.where}: no module {call.target}")
            continue
        if _own(call.target):
            listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", _help_text(call)))
            problems += [
                f"{call.where}: {call.target} has no flag {flag}"
                for flag in _flags(call.args)
                if flag not in listed
            ]
    assert problems == []


def test_scripts_exist_and_take_the_flags_used() -> None:
    problems = []
    for call in (c for c in ALL_CALLS if c.kind in ("script", "shell")):
        path = ROOT / call.target
        if not path.is_file():
            problems.append(f"{call.where}: no file {call.target}")
        elif call.kind == "shell" and not os.access(path, os.X_OK):
            problems.append(f"{call.where}: {call.target} is not executable")
        elif call.kind == "script" and call.target.startswith("scripts/"):
            listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", _help_text(call)))
            problems += [
                f"{call.where}: {call.target} has no flag {flag}"
                for flag in _flags(call.args)
                if flag not in listed
            ]
    assert problems == []


def _extras() -> set[str]:
    """The optional-dependency names of pyproject.toml (Python 3.10 has no tomllib)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([a-z0-9_-]+) = \[", section, re.M))


def test_pip_installs_name_existing_extras() -> None:
    extras = _extras()
    used = set()
    for call in (c for c in ALL_CALLS if c.kind == "pip"):
        for arg in call.args:
            m = re.fullmatch(r"\.\[([a-z0-9,_-]+)\]", arg)
            if m:
                used.update(m.group(1).split(","))
    assert used and used <= extras, used - extras
    # Inline mentions in prose too: pip install -e '.[x]'
    for page in PAGES:
        for found in re.findall(r"pip install -e '\.\[([a-z0-9,_-]+)\]'", page.read_text()):
            assert set(found.split(",")) <= extras, (page.name, found)


def test_relative_links_name_files_that_exist() -> None:
    missing = set()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                missing.add(str(resolved.relative_to(ROOT)))
    assert not missing, missing


def test_commands_are_written_one_way() -> None:
    """With the venv active, never ``.venv/bin/...`` (except the activation itself)."""
    for block in ALL_BLOCKS:
        for line in command_lines(block.body):
            assert not re.search(r"\.venv/bin/(?!activate)", line), (block.where(), line)


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs the README's set-up and test command as written."""
    readme = [b for b in blocks(ROOT / "README.md") if "-m pytest" in b.body]
    assert len(readme) == 1
    assert readme[0].body.strip() in (ROOT / ".ci" / "run").read_text()
