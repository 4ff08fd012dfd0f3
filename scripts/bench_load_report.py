"""Aggregation and reporting of ``bench_serving.py --mode load`` (``bench_load``): the
per-(rate, mode) rows, the ratios against cache-off and the sequential run, the target
checks, and the tables and plot. No torch, no collectives."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import bench_common
from bench_common import Column

LOAD_MODES = ("off", "device", "host", "storage")
LABELS = {"off": "off", "device": "L1", "host": "L1+L2", "storage": "L1+L2+L3"}

TARGET_RATIO = 2.0
"""Target: L1+L2 throughput at the saturating rate is at least this multiple of off's."""


METRICS = (
    "throughput_rps",
    "throughput_tps",
    "ttft_p50_s",
    "ttft_p99_s",
    "decode_tokens_per_s",
    "hit_rate",
    "wall_s",
    "cpu_s",
)


def aggregate(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rate index, mode) from per-run samples.

    A sample holds ``repeat``, ``rate_index``, ``rate``, ``mode``, ``outputs_match`` and
    the ``METRICS``. A row holds the median of each metric over repetitions,
    ``rps_vs_off`` / ``tps_vs_off`` (median over repetitions of the ratio to off's run in
    the same repetition and rate; None without one), ``repeats`` and ``outputs_match``
    (all runs). Rows are ordered by rate, then ``LOAD_MODES`` order."""
    groups: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    off: dict[tuple[int, int], Mapping[str, Any]] = {}
    for s in samples:
        groups.setdefault((s["rate_index"], s["mode"]), []).append(s)
        if s["mode"] == "off":
            off[(s["rate_index"], s["repeat"])] = s
    rows = []
    rank = {m: i for i, m in enumerate(LOAD_MODES)}
    for (ri, mode), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], rank[kv[0][1]])):
        row: dict[str, Any] = {
            "rate": runs[0]["rate"],
            "rate_index": ri,
            "mode": mode,
            "label": LABELS[mode],
            "repeats": len(runs),
            "outputs_match": all(r["outputs_match"] for r in runs),
        }
        for key in METRICS:
            row[key] = statistics.median(r[key] for r in runs)
        for key, metric in (("rps_vs_off", "throughput_rps"), ("tps_vs_off", "throughput_tps")):
            ratios = [
                r[metric] / base[metric]
                for r in runs
                if (base := off.get((ri, r["repeat"]))) is not None and base[metric] > 0
            ]
            row[key] = statistics.median(ratios) if ratios else None
        rows.append(row)
    return rows


def add_sequential_ratios(
    rows: Sequence[dict[str, Any]],
    samples: Sequence[Mapping[str, Any]],
    sequential: Mapping[int, Mapping[str, Any]],
) -> None:
    """Set each row's ``rps_vs_sequential_off`` (median over repetitions of the run's
    req/s over its repetition's sequential cache-off req/s) and ``cpu_vs_sequential_off``
    (the same of the sequential run's process CPU seconds over the run's: above 1 the
    run spent less CPU on the same trace). ``sequential``: per repetition, a sample with
    ``throughput_rps`` and ``cpu_s``. None where a repetition has no sequential run."""
    for row in rows:
        cell = (row["rate_index"], row["mode"])
        runs = [s for s in samples if (s["rate_index"], s["mode"]) == cell]
        for key, ratio in (
            ("rps_vs_sequential_off", lambda r, q: r["throughput_rps"] / q["throughput_rps"]),
            ("cpu_vs_sequential_off", lambda r, q: q["cpu_s"] / r["cpu_s"]),
        ):
            values = [
                ratio(r, q)
                for r in runs
                if (q := sequential.get(r["repeat"])) is not None and r["cpu_s"] > 0
            ]
            row[key] = statistics.median(values) if values else None


def acceptance(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The target checks at the saturating (highest) rate: every cached mode's
    throughput above off's, and L1+L2 at least ``TARGET_RATIO`` x off's."""
    if not rows:
        return {}
    top = max(r["rate_index"] for r in rows)
    at_top = {r["mode"]: r for r in rows if r["rate_index"] == top}
    out: dict[str, Any] = {"saturating_rate": at_top[next(iter(at_top))]["rate"]}
    cached = [m for m in at_top if m != "off" and at_top[m]["rps_vs_off"] is not None]
    out["cached_above_off"] = bool(cached) and all(at_top[m]["rps_vs_off"] > 1 for m in cached)
    if "host" in at_top and at_top["host"]["rps_vs_off"] is not None:
        out["host_rps_vs_off"] = at_top["host"]["rps_vs_off"]
        out["host_at_least_2x_off"] = at_top["host"]["rps_vs_off"] >= TARGET_RATIO
    out["outputs_match"] = all(r["outputs_match"] for r in rows)
    return out


def _ms(value: float) -> str:
    return f"{value * 1e3:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


LOAD_COLUMNS = (
    Column("rate", "sessions/s", "{:.3f}"),
    Column("label", "mode", align="left"),
    Column("throughput_rps", "req/s", "{:.3f}"),
    Column("rps_vs_off", "req/s vs off", _ratio),
    Column("rps_vs_sequential_off", "vs sequential off", _ratio),
    Column("cpu_vs_sequential_off", "CPU vs sequential off", _ratio),
    Column("throughput_tps", "tokens/s", "{:.0f}"),
    Column("ttft_p50_s", "TTFT p50 ms", _ms),
    Column("ttft_p99_s", "TTFT p99 ms", _ms),
    Column("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("outputs_match", "outputs = off", lambda v: "yes" if v else "NO"),
)

HIT_COLUMNS = (
    Column("cached_tokens", "cached tokens"),
    Column("path", "engine", align="left"),
    Column("hit_cached", "served from L1"),
    Column("hit_ttft_s", "hit TTFT ms", lambda v: f"{v * 1e3:.1f}"),
    Column("cold_ttft_s", "cold TTFT ms", lambda v: f"{v * 1e3:.1f}"),
    Column("hit_vs_cold", "hit / cold", "{:.3f}"),
    Column("outputs_match", "hit output = cold", lambda v: "yes" if v else "NO"),
)


def render_load_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-rate, per-mode Markdown table."""
    return bench_common.markdown_table(list(rows), LOAD_COLUMNS)


def render_hit_table(hits: Sequence[Mapping[str, Any]]) -> str:
    """TTFT of a full-prefix L1 hit per cached length (Markdown)."""
    return bench_common.markdown_table(list(hits), HIT_COLUMNS)


def write_load_plot(rows: Sequence[Mapping[str, Any]], path: str) -> bool:
    """Throughput and TTFT p50 against the session rate, one line per mode (PNG);
    False (and a message) without matplotlib."""
    plt = bench_common.pyplot(path)
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in LOAD_MODES:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"])
        if not mine:
            continue
        rates = [r["rate"] for r in mine]
        left.plot(rates, [r["throughput_rps"] for r in mine], marker="o", label=LABELS[mode])
        right.plot(rates, [1e3 * r["ttft_p50_s"] for r in mine], marker="o", label=LABELS[mode])
    for ax, ylabel in ((left, "throughput (requests/s)"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("session rate (sessions/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle("Serving under load by cache mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report_load(out: Mapping[str, Any]) -> str:
    """The tables and acceptance lines, as printed."""
    res = out["results"]
    lines = [
        f"sequential cache-off service rate {res['service_rps']:.3f} requests/s; session "
        f"rates {', '.join(f'{r:.3f}' for r in res['rates'])}/s; think {res['think_s']:.2f} s; "
        f"L1 {res['device_pages']} pages, L2 {res['host_pages']} pages",
        "",
        render_load_table(res["rows"]),
        "",
    ]
    if res["hit_ttft"]:
        lines += [render_hit_table(res["hit_ttft"]), ""]
    for key, value in res["acceptance"].items():
        lines.append(f"{key}: {f'{value:.3f}' if isinstance(value, float) else value}")
    return "\n".join(lines)
