"""mesh_hicache.metrics: CacheStats as samples (always) and as Prometheus text (with the extra)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from mesh_hicache.metrics import (
    COUNTER,
    GAUGE,
    CacheStatsCollector,
    cache_metric_samples,
    register_cache_metrics,
    topology_labels,
)
from mesh_hicache.stats import CacheStats
from mesh_hicache.topology import MeshTopology

HAS_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None
needs_prometheus = pytest.mark.skipif(
    not HAS_PROMETHEUS, reason="needs prometheus-client (pip install 'mesh-hicache[prometheus]')"
)


def _stats() -> CacheStats:
    s = CacheStats(prefetch_policy="timeout")
    s.requests, s.prompt_tokens = 3, 100
    s.hit_tokens_device, s.hit_tokens_host, s.hit_tokens_storage = 10, 20, 30
    s.bytes_host_to_device, s.seconds_host_to_device = 2_000_000_000, 2.0
    s.evicted_host_pages = 4
    s.storage_errors = 2
    s.storage_degraded = True
    s.record_prefetch("timeout", "partial")
    return s


def _by_key(samples):  # type: ignore[no-untyped-def]
    return {(s.name, tuple(sorted(s.labels.items()))): s for s in samples}


def test_samples_carry_the_counters_by_tier_and_direction() -> None:
    got = _by_key(cache_metric_samples(_stats()))
    assert got[("mesh_hicache_hit_tokens_total", (("tier", "host"),))].value == 20
    assert got[("mesh_hicache_hit_tokens_total", (("tier", "storage"),))].kind == COUNTER
    key = ("mesh_hicache_transfer_bytes_total", (("direction", "host_to_device"),))
    assert got[key].value == 2e9
    assert got[("mesh_hicache_evicted_pages_total", (("tier", "host"),))].value == 4
    part = ("mesh_hicache_prefetch_total", (("outcome", "partial"), ("policy", "timeout")))
    assert got[part].value == 1
    assert got[("mesh_hicache_requests_total", ())].value == 3
    assert got[("mesh_hicache_storage_errors_total", ())].value == 2
    assert got[("mesh_hicache_storage_degraded", ())].kind == GAUGE
    assert got[("mesh_hicache_storage_degraded", ())].value == 1.0
    assert got[("mesh_hicache_hit_rate", ())].value == pytest.approx(0.6)
    assert got[("mesh_hicache_load_gbps", ())].value == pytest.approx(1.0)
    assert got[("mesh_hicache_seconds_host_to_device_total", ())].kind == COUNTER
    assert all(s.name.endswith("_total") == (s.kind == COUNTER) for s in got.values())


def test_every_numeric_stats_field_is_exported() -> None:
    stats = CacheStats()
    numeric = [
        f.name
        for f in dataclasses.fields(stats)
        if isinstance(getattr(stats, f.name), bool | int | float)
    ]
    # Give every field a distinct value; each must surface in exactly one sample.
    for i, name in enumerate(numeric, start=1):
        setattr(stats, name, True if isinstance(getattr(stats, name), bool) else 1000 + i)
    values = [s.value for s in cache_metric_samples(stats)]
    for i, name in enumerate(numeric, start=1):
        expected = 1.0 if isinstance(getattr(stats, name), bool) else float(1000 + i)
        assert values.count(expected) >= 1, f"CacheStats.{name} is not exported"


def test_topology_labels(one_rank_topology: MeshTopology) -> None:
    assert topology_labels(one_rank_topology) == {"pp": "0", "cp": "0", "tp": "0"}


@needs_prometheus
def test_exporter_text_reads_live_stats() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    stats = _stats()
    registry = CollectorRegistry()
    collector = register_cache_metrics(lambda: stats, {"pp": "0", "tp": "1"}, registry)
    text = generate_latest(registry).decode()
    assert "# TYPE mesh_hicache_hit_tokens_total counter" in text
    assert 'mesh_hicache_hit_tokens_total{pp="0",tier="host",tp="1"} 20.0' in text
    assert "# TYPE mesh_hicache_storage_degraded gauge" in text
    assert 'mesh_hicache_storage_degraded{pp="0",tp="1"} 1.0' in text
    # A scrape reads the stats anew: the exporter keeps no copy.
    stats.hit_tokens_host = 25
    text = generate_latest(registry).decode()
    assert 'mesh_hicache_hit_tokens_total{pp="0",tier="host",tp="1"} 25.0' in text
    assert (
        registry.get_sample_value(
            "mesh_hicache_prefetch_total",
            {"pp": "0", "tp": "1", "policy": "timeout", "outcome": "partial"},
        )
        == 1.0
    )
    registry.unregister(collector)
    assert "mesh_hicache" not in generate_latest(registry).decode()


@needs_prometheus
def test_exporter_rejects_labels_that_clash() -> None:
    with pytest.raises(ValueError, match="tier"):
        CacheStatsCollector(CacheStats, {"tier": "x"})


def test_without_prometheus_the_error_names_the_extra(monkeypatch) -> None:
    for name in ("prometheus_client", "prometheus_client.core"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    with pytest.raises(ImportError, match="prometheus"):
        CacheStatsCollector(CacheStats)
