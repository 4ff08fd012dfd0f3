"""Prometheus exporter for ``CacheStats`` (optional: needs ``prometheus-client``).

The exporter is a collector: every scrape reads a fresh ``CacheStats`` snapshot through a
callable (``cache.stats``), so the cache keeps one set of counters and the exporter keeps
none. ``prometheus_client`` is imported only when a collector is built; this module and
:func:`cache_metric_samples` work without it.

    from prometheus_client import start_http_server
    from mesh_hicache.metrics import register_cache_metrics, topology_labels

    register_cache_metrics(cache.stats, labels=topology_labels(cache_topology))
    start_http_server(9400, addr="127.0.0.1")

Names (all prefixed ``mesh_hicache_``): ``*_total`` are counters, the rest gauges.
Per-tier and per-direction counters are one metric family with a ``tier`` or
``direction`` label; every other numeric ``CacheStats`` field is exported under its own
name, so a counter added there shows up here without a change.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from mesh_hicache.stats import CacheStats
from mesh_hicache.topology import MeshTopology

PREFIX = "mesh_hicache"
COUNTER = "counter"
GAUGE = "gauge"

# Families with a label: (metric, help, label name, {label value: CacheStats field}).
_LABELED: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    (
        "hit_tokens",
        "Prompt tokens served from the cache, by the tier they came from.",
        "tier",
        {
            "device": "hit_tokens_device",
            "host": "hit_tokens_host",
            "storage": "hit_tokens_storage",
        },
    ),
    (
        "mamba_hits",
        "Mamba state hits, by tier.",
        "tier",
        {"device": "mamba_hits_device", "host": "mamba_hits_host"},
    ),
    (
        "transfer_bytes",
        "Bytes moved between tiers (this rank's shard), by direction.",
        "direction",
        {
            "device_to_host": "bytes_device_to_host",
            "host_to_device": "bytes_host_to_device",
            "host_to_storage": "bytes_host_to_storage",
            "storage_to_host": "bytes_storage_to_host",
        },
    ),
    (
        "evicted_pages",
        "KV pages evicted, by tier.",
        "tier",
        {"device": "evicted_device_pages", "host": "evicted_host_pages"},
    ),
    (
        "evicted_slots",
        "Mamba state slots evicted, by tier.",
        "tier",
        {"device": "evicted_device_slots", "host": "evicted_host_slots"},
    ),
)
_GAUGES = {
    "hit_rate": "Hit tokens / prompt tokens since the cache was built.",
    "load_gbps": "Host to device GB/s over the measured loads.",
    "storage_degraded": "1 while the storage tier is bypassed after errors, else 0.",
}
_SKIP = {"prefetch_policy", "prefetch", "lock"}


class MetricSample(NamedTuple):
    """One exported value: ``name`` is the full Prometheus name (``*_total`` for counters)."""

    name: str
    kind: str
    """``counter`` or ``gauge``."""
    help: str
    labels: dict[str, str]
    value: float


def cache_metric_samples(stats: CacheStats) -> list[MetricSample]:
    """Every counter and gauge of ``stats`` as samples (pure; no ``prometheus_client``).

    Reads a snapshot, so ``stats`` may keep changing. Counter names end in ``_total``.
    """
    snap = stats.snapshot()
    values: dict[str, Any] = {
        f.name: getattr(snap, f.name) for f in dataclasses.fields(snap) if f.name not in _SKIP
    }
    values.update(hit_rate=snap.hit_rate, load_gbps=snap.load_gbps)
    out: list[MetricSample] = []
    for metric, doc, label, fields in _LABELED:
        for label_value, name in fields.items():
            out.append(
                MetricSample(
                    f"{PREFIX}_{metric}_total",
                    COUNTER,
                    doc,
                    {label: label_value},
                    float(values.pop(name)),
                )
            )
    for outcome, count in sorted(snap.prefetch.items()):
        out.append(
            MetricSample(
                f"{PREFIX}_prefetch_total",
                COUNTER,
                "L3 prefetches by outcome under the configured policy.",
                {"policy": snap.prefetch_policy, "outcome": outcome},
                float(count),
            )
        )
    for name, value in values.items():
        # Ints are event counts; floats and flags are levels. seconds_host_to_device is a
        # float but only grows, so it is a counter.
        if name in _GAUGES or (isinstance(value, float) and not name.startswith("seconds_")):
            kind, full = GAUGE, f"{PREFIX}_{name}"
        else:
            kind, full = COUNTER, f"{PREFIX}_{name}_total"
        doc = _GAUGES.get(name, f"CacheStats.{name}.")
        out.append(MetricSample(full, kind, doc, {}, float(value)))
    return out


def topology_labels(topology: MeshTopology) -> dict[str, str]:
    """Constant labels naming this rank by its mesh coordinates: ``{"pp", "cp", "tp"}``."""
    pp, cp, tp = topology.coords
    return {"pp": str(pp), "cp": str(cp), "tp": str(tp)}


def _prometheus(module: str = "prometheus_client") -> Any:
    """``module`` of prometheus_client, imported on first use (it is an optional extra)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            "mesh_hicache.metrics needs prometheus-client: pip install 'mesh-hicache[prometheus]'"
        ) from err


class CacheStatsCollector:
    """A ``prometheus_client`` collector reading ``stats_fn()`` on every scrape.

    ``stats_fn`` is typically ``cache.stats`` (a ``CacheStats`` of this rank);
    ``labels`` are added to every sample (e.g. :func:`topology_labels`). Raises
    ``ImportError`` when ``prometheus_client`` is missing.
    """

    def __init__(
        self, stats_fn: Callable[[], CacheStats], labels: Mapping[str, str] | None = None
    ) -> None:
        self._core = _prometheus("prometheus_client.core")
        self._stats_fn = stats_fn
        self._labels = dict(labels or {})
        for key in self._labels:
            if key in ("tier", "direction", "policy", "outcome"):
                raise ValueError(f"label {key!r} is used by the exported metrics; rename it")

    def collect(self) -> Iterator[Any]:
        """Metric families for one scrape (the ``Collector`` protocol)."""
        core = self._core
        families: dict[str, Any] = {}
        for s in cache_metric_samples(self._stats_fn()):
            labels = {**self._labels, **s.labels}
            if s.name not in families:
                if s.kind == COUNTER:
                    # The client appends "_total" to a counter family's samples itself.
                    families[s.name] = core.CounterMetricFamily(
                        s.name.removesuffix("_total"), s.help, labels=list(labels)
                    )
                else:
                    families[s.name] = core.GaugeMetricFamily(s.name, s.help, labels=list(labels))
            families[s.name].add_metric(list(labels.values()), s.value)
        yield from families.values()

    def describe(self) -> list[Any]:
        # Empty: registering must not scrape (the cache may be mid-construction).
        return []


def register_cache_metrics(
    stats_fn: Callable[[], CacheStats],
    labels: Mapping[str, str] | None = None,
    registry: Any = None,
) -> CacheStatsCollector:
    """Build a :class:`CacheStatsCollector` and register it (default: the global registry).

    Mutates ``registry``; unregister with ``registry.unregister(collector)``.
    """
    collector = CacheStatsCollector(stats_fn, labels)
    target = registry if registry is not None else _prometheus().REGISTRY
    target.register(collector)
    return collector
