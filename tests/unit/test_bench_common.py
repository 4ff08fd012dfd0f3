"""The shared benchmark result format and its Markdown tables (scripts/bench_common.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_common  # noqa: E402
from bench_common import Column  # noqa: E402


def test_make_result_has_the_shared_keys_and_is_json_safe() -> None:
    result = bench_common.make_result(
        "radix", {"sessions": 3, "pair": (1, 2), "obj": object}, {"ops_per_s": 1.5}
    )
    assert list(result) == list(bench_common.RESULT_KEYS)
    assert result["benchmark"] == "radix"
    assert result["config"]["pair"] == [1, 2]
    assert isinstance(result["config"]["obj"], str)
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert "torch" in result["machine"]
    json.dumps(result)


def test_make_result_rejects_an_empty_name() -> None:
    with pytest.raises(ValueError, match="benchmark name"):
        bench_common.make_result("", {}, {})


def test_write_and_read_round_trip(tmp_path) -> None:
    result = bench_common.make_result("x", {"a": 1}, {"b": [1, 2]}, machine={"m": "test"})
    path = tmp_path / "sub" / "x.json"
    bench_common.write_json(result, str(path))
    assert bench_common.read_json(str(path)) == result


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"benchmark": "x"}, "lacks keys"),
        ({"format": 99, "benchmark": "x", "machine": {}, "config": {}, "results": {}}, "format"),
        ({"format": 1, "benchmark": "x", "machine": {}, "config": {}, "results": 3}, "results"),
    ],
)
def test_check_result_rejects_malformed(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench_common.check_result(bad)


def test_markdown_table_formats_aligns_and_marks_missing() -> None:
    rows = [{"name": "off", "t": 0.5, "n": 10}, {"name": "host", "t": 0.25}]
    text = bench_common.markdown_table(
        rows,
        [
            Column("name", "mode", align="left"),
            Column("t", "ms", lambda v: f"{v * 1e3:.0f}"),
            Column("n"),
        ],
    )
    lines = text.splitlines()
    assert lines[0] == "| mode |  ms |   n |"
    assert lines[1] == "| ---- | --: | --: |"
    assert lines[2] == "| off  | 500 |  10 |"
    assert lines[3] == "| host | 250 |   - |"


def test_markdown_table_rejects_bad_columns() -> None:
    with pytest.raises(ValueError, match="at least one column"):
        bench_common.markdown_table([], [])
    with pytest.raises(ValueError, match="align"):
        bench_common.markdown_table([{"a": 1}], [Column("a", align="center")])


def test_key_value_table() -> None:
    text = bench_common.key_value_table({"rate": 0.123456, "n": 7})
    assert "| rate   | 0.1235 |" in text
    assert "| n      |      7 |" in text
