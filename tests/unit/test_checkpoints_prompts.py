"""``--prompts FILE.jsonl`` parsing: sessions become turns, errors name the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.serve.prompts import load_prompts


class _WordTokenizer:
    """Stands in for ``tokenizers.Tokenizer``: one id per word (``w<id>``)."""

    class _Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    def encode(self, text: str) -> _Encoding:
        return self._Encoding([int(w[1:]) for w in text.split()])


def _write(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines))
    return path


def test_sessions_turns_and_max_new_tokens(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            {"input_ids": [1, 2, 3], "session": "a", "max_new_tokens": 4},
            {"text": "w5 w6", "session": 7},
            "",
            {"input_ids": [9], "session": "a"},
            {"input_ids": [4, 4]},
            {"input_ids": [8], "session": 7},
        ],
    )
    turns = load_prompts(path, 16, _WordTokenizer())
    assert [t.request_id for t in turns] == [0, 1, 2, 3, 4]
    assert [(t.session, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1)]
    assert [t.user_tokens for t in turns] == [(1, 2, 3), (5, 6), (9,), (4, 4), (8,)]
    assert [t.max_new_tokens for t in turns] == [4, None, None, None, None]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ([1, 2], "expected an object"),
        ({"input_ids": [1], "text": "w1"}, "exactly one"),
        ({}, "exactly one"),
        ({"input_ids": [1], "foo": 1}, "unknown keys"),
        ({"input_ids": [1, 99]}, r"not in range\(16\)"),
        ({"input_ids": []}, "no tokens"),
        ({"input_ids": ["a"]}, "list of ints"),
        ({"input_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"text": "w1"}, "tokenizer.json"),
        ({"input_ids": [1], "stop_at_eos": 1}, "stop_at_eos must be a boolean"),
        ({"input_ids": [1], "stop_at_eos": True}, "names no eos_token_id"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: object, message: str) -> None:
    path = _write(tmp_path, [{"input_ids": [1]}, line])
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(path, 16, None)
    assert f"{path}:2" in str(err.value)


def test_stop_at_eos_sets_the_turns_stop_token(tmp_path: Path) -> None:
    lines = [{"input_ids": [1], "stop_at_eos": True}, {"input_ids": [2]}]
    lines.append({"input_ids": [3], "stop_at_eos": False})
    turns = load_prompts(_write(tmp_path, lines), 16, None, eos_token_ids=(7, 9))
    assert [t.stop_tokens for t in turns] == [(7, 9), (), ()]


def test_empty_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        load_prompts(_write(tmp_path, [""]), 16)
    with pytest.raises(ValueError, match="--prompts"):
        load_prompts(tmp_path / "missing.jsonl", 16)


def test_serve_rejects_a_bad_model_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "runtime.serve", "--model", str(tmp_path / "nope")]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "neither a preset" in proc.stderr


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"input_ids": [1, True]}, "list of ints, not True"),
        ({"input_ids": [1], "max_new_tokens": True}, "max_new_tokens must be an int"),
        ({"input_ids": [1], "session": {"a": 1}}, "session must be a JSON scalar"),
        ({"input_ids": [1], "arrival_s": True}, "arrival_s must be a number"),
        ('{"input_ids": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
    ],
)
def test_bools_and_deep_nesting_name_the_line(tmp_path: Path, line: object, message: str) -> None:
    path = _write(tmp_path, [{"input_ids": [1]}, line])
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(path, 16, None)
    assert f"{path}:2:" in str(err.value)


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path: Path, monkeypatch) -> None:
    import runtime.serve.prompts as prompts

    monkeypatch.setattr(prompts, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "p.jsonl"
    path.write_text('{"input_ids": [1]}\n{"input_ids": [' + "1, " * 2000 + "1]}\n")
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, f) -> None:
            self.f = f

        def readline(self, limit: int = -1) -> bytes:
            reads.append(limit)
            return self.f.readline(limit)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    monkeypatch.setattr(
        prompts, "open", lambda p, mode="r": Counting(real_open(p, mode)), raising=False
    )
    with pytest.raises(ValueError, match=f"{path}:2: the line is longer than 1000 bytes"):
        load_prompts(path, 16, None)
    assert reads and all(0 < limit <= 1001 for limit in reads)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input_ids": [1]}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not UTF-8"):
        load_prompts(path, 16, None)
