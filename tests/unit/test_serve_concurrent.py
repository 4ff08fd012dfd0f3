"""runtime.serve with requests in flight together on a warm cache: prefixes that overlap
on host (L2) and storage (L3) are loaded once and shared, the outputs (tokens and
last-prompt logits) equal a cache-off run, and the tree and pools stay consistent.

Each run is ``runtime.serve.main`` in this process (no interpreter start-up); every cache
is checked with ``check_integrity`` after its final flush."""

from __future__ import annotations

import json

import pytest

from mesh_hicache.cache import HiCache
from runtime.serve import main as serve
from tests.engine_cases import ATOL

# Small L1 (16 pages of 16 tokens) and L2 (32 pages): the second half of the trace finds
# its prefixes on device, on host only, in storage only or split over tiers, and loads
# evict what the earlier ones brought.
FLAGS = ["--model", "tiny", "--first-prompt-len", "96", "--append-len", "24"]
FLAGS += ["--device-pages", "24", "--host-pages", "48", "--prefetch-threshold", "16"]
FLAGS += ["--max-new-tokens", "3", "--threads", "1", "--quiet", "--dump-logits"]


@pytest.fixture
def checked_caches(monkeypatch):
    """Count the caches closed, each after ``check_integrity`` passed on it."""
    closed: list[HiCache] = []
    close = HiCache.close

    def check_then_close(self: HiCache) -> None:
        if self not in closed:
            self.check_integrity()
            closed.append(self)
        close(self)

    monkeypatch.setattr(HiCache, "close", check_then_close)
    return closed


def _serve(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert serve.main([*FLAGS, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _assert_same(got, want, what):
    assert [r["output_ids"] for r in got["requests"]] == [
        r["output_ids"] for r in want["requests"]
    ], what
    worst = max(
        max(abs(a - b) for a, b in zip(r["last_logits"], s["last_logits"], strict=True))
        for r, s in zip(got["requests"], want["requests"], strict=True)
    )
    assert worst < ATOL, (what, worst)  # float32 reduction order only


@pytest.mark.parametrize("workload", ["multiturn", "shared-prefix"])
def test_concurrent_runs_on_a_warm_root_equal_cache_off(tmp_path, checked_caches, workload):
    trace = ["--workload", workload, "--sessions", "4", "--turns", "2"]
    root = ["--storage-root", str(tmp_path / "l3")]
    off = _serve(tmp_path, "off", *trace, "--cache", "off")
    # A first run warms L3; then every later run starts with an empty L1/L2 and finds the
    # shared prefixes of several requests in flight in storage at once.
    _assert_same(_serve(tmp_path, "warm", *trace, *root), off, "warm-up")
    storage = 0
    for c in (2, 4, 8):
        got = _serve(tmp_path, f"c{c}", *trace, *root, "--concurrency", str(c))
        _assert_same(got, off, f"--concurrency {c}")
        storage += got["summary"]["cached_storage"]
    timed = ("--concurrency", "4", "--request-rate", "200", "--think-s", "0.001")
    _assert_same(_serve(tmp_path, "rate", *trace, *root, *timed), off, "--request-rate")
    assert storage > 0  # the warm root was read
    assert len(checked_caches) == 5
