"""One result format for every benchmark in ``scripts/``, and a Markdown table renderer.

A result is a JSON object::

    {
      "format": 1,
      "benchmark": "serving",            # which script
      "machine": {...},                  # machine_info(): platform, CPUs, torch, GPU name
      "config": {...},                   # the script's arguments
      "results": {...}                   # the script's numbers (free-form, JSON-safe)
    }

Scripts import this module as ``bench_common`` (they are run as ``python scripts/X.py``,
which puts ``scripts/`` on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
RESULT_KEYS = ("format", "benchmark", "machine", "config", "results")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: OS, CPU count, Python, torch and GPU (if any)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch
    except ImportError:  # the format itself does not need torch
        return info
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["cuda"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and unknown objects as strings (argparse values)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def make_result(
    benchmark: str,
    config: Mapping[str, Any],
    results: Mapping[str, Any],
    machine: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A result object in the shared format; ``machine`` defaults to ``machine_info()``.

    Raises ``ValueError`` for an empty ``benchmark`` name.
    """
    if not benchmark:
        raise ValueError("benchmark name must be a non-empty string")
    return {
        "format": FORMAT_VERSION,
        "benchmark": benchmark,
        "machine": _jsonable(machine if machine is not None else machine_info()),
        "config": _jsonable(config),
        "results": _jsonable(results),
    }


def check_result(result: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``result`` has the shared format's keys and types."""
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"benchmark result lacks keys {missing}; expected {RESULT_KEYS}")
    if result["format"] != FORMAT_VERSION:
        raise ValueError(f"result format {result['format']!r}; this code reads {FORMAT_VERSION}")
    for key in ("machine", "config", "results"):
        if not isinstance(result[key], Mapping):
            raise ValueError(f"result[{key!r}] must be an object, got {type(result[key]).__name__}")


def write_json(result: Mapping[str, Any], path: str) -> None:
    """Check ``result`` and write it to ``path`` (parent folders are created)."""
    check_result(result)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def read_json(path: str) -> dict[str, Any]:
    """Read a result written by ``write_json``; ``ValueError`` if it is not in the format."""
    with open(path) as f:
        result = json.load(f)
    check_result(result)
    return result


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a Markdown table: ``key`` of each row, shown under ``header``."""

    key: str
    header: str = ""
    fmt: str | Callable[[Any], str] = "{}"
    """A ``str.format`` pattern for the value, or a function of it."""
    align: str = field(default="right")
    """``left`` or ``right``."""

    def render(self, row: Mapping[str, Any]) -> str:
        if self.key not in row or row[self.key] is None:
            return "-"
        value = row[self.key]
        return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """Render ``rows`` as a GitHub Markdown table (a missing or None value prints ``-``).

    Raises ``ValueError`` for no columns or an ``align`` other than left/right.
    """
    if not columns:
        raise ValueError("markdown_table needs at least one column")
    for col in columns:
        if col.align not in ("left", "right"):
            raise ValueError(f"Column.align={col.align!r}; choose from ('left', 'right')")
    headers = [col.header or col.key for col in columns]
    cells = [[col.render(row) for col in columns] for row in rows]
    # At least 3 wide so the rule row has a dash beside an alignment colon.
    widths = [max([3, len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.ljust(w) if col.align == "left" else v.rjust(w)
            for v, w, col in zip(values, widths, columns, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        ("-" * (w - 1) + ":") if col.align == "right" else ("-" * w)
        for w, col in zip(widths, columns, strict=True)
    ]
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |", *map(line, cells)])


def key_value_table(values: Mapping[str, Any], float_fmt: str = "{:.4g}") -> str:
    """A two-column Markdown table of a flat mapping (floats through ``float_fmt``)."""
    rows = [{"name": k, "value": v} for k, v in values.items()]
    return markdown_table(
        rows,
        [
            Column("name", "metric", align="left"),
            Column(
                "value",
                "value",
                lambda v: float_fmt.format(v) if isinstance(v, float) else str(v),
            ),
        ],
    )


def pyplot(path: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend for writing ``path``, or None (and a
    message naming the package) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"--plot {path}: matplotlib is not installed (pip install -e '.[plot]'); "
            "skipping the plot",
            file=sys.stderr,
        )
        return None
    return plt
