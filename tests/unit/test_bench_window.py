"""scripts/bench_window_bytes.py: the windowed profile's bytes and one small replay."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_window_bytes as bench  # noqa: E402


def test_window_pages_and_profile_bytes() -> None:
    # A page-aligned boundary needs [b - 127, b): 8 pages of 16, 9 with one sink token.
    assert bench.window_pages(16, 128, 0) == 8
    assert bench.window_pages(16, 128, 1) == 9
    assert bench.window_pages(16, 129, 0) == 8  # [b - 128, b): exactly 8 pages
    assert bench.window_pages(16, 130, 0) == 9
    prof = bench.GPT_OSS_20B
    assert prof.kv_bytes_per_token == 24 * 2 * 8 * 64 * 2
    win = bench.WindowedProfile(
        **{f: getattr(prof, f) for f in prof.__dataclass_fields__},
        window_layers=12,
        window_pages=8,
        page_size=16,
    )
    assert win.page_bytes(16) == prof.page_bytes(16) // 2
    assert win.state_bytes == 8 * 16 * 12 * 2 * 8 * 64 * 2


def test_small_replay(tmp_path, capsys) -> None:
    out = tmp_path / "w.json"
    argv = ["--sessions", "6", "--device-bytes", "100MB", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "window_bytes"
    cell = result["results"]["budgets"]["100000000"]
    full, win = cell["full"], cell["window"]
    assert full["bytes_per_cached_token"] == 24 * 2 * 8 * 64 * 2
    # The windowed layers cost per boundary, not per token: less than full, at least
    # the full layers' half.
    assert full["bytes_per_cached_token"] / 2 <= win["bytes_per_cached_token"]
    assert win["bytes_per_cached_token"] < full["bytes_per_cached_token"]
    assert 0.5 <= full["page_rule_ratio_end"] <= 1.0
    assert 0.0 <= full["token_hit_rate"] <= 1.0 and 0.0 <= win["token_hit_rate"] <= 1.0
    assert win["end_device_states"] > 0


def test_l3_replay_stores_fewer_windowed_pages(tmp_path, capsys) -> None:
    import bench_window_l3 as l3

    out = tmp_path / "l3.json"
    argv = ["--sessions", "3", "--checkpoints", "256", "--device-pages", "256"]
    argv += ["--cap-fraction", "0.5"]
    assert l3.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "window_l3"
    every, sparse = result["results"]["runs"]  # 0 (every page) is added as the baseline
    assert every["checkpoint_tokens"] == 0 and sparse["checkpoint_tokens"] == 256
    # Every page: one windowed object per page, the bytes of 24 full layers per token.
    assert every["kv_window_objects"] == every["kv_objects"] > 0
    assert every["l3_bytes_per_cached_token"] == 24 * 2 * 8 * 64 * 2
    # Sparse: the same pages, fewer windowed objects, never below the full layers' half.
    assert sparse["kv_objects"] == every["kv_objects"]
    assert 0 < sparse["kv_window_objects"] < every["kv_window_objects"]
    assert 0.5 < sparse["bytes_ratio"] < 1.0
    assert 0.0 < sparse["restart"]["token_hit_rate"] <= every["restart"]["token_hit_rate"]
    # Capped at half the baseline's store: both settings under the same byte cap.
    capped = result["results"]["capped"]
    assert [c["checkpoint_tokens"] for c in capped] == [0, 256]
    cap = capped[0]["store_cap"]
    assert cap == int(0.5 * every["store_bytes"]) and capped[1]["store_cap"] == cap
    assert all(c["store_bytes"] <= cap for c in capped)


def test_host_replay_keeps_fewer_windowed_pages_at_equal_bytes(tmp_path, capsys) -> None:
    import bench_window_host as host

    out = tmp_path / "host.json"
    argv = ["--sessions", "4", "--checkpoints", "256", "--device-pages", "64"]
    assert host.main([*argv, "--host-pages", "128", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "window_host"
    every, sparse = result["results"]["runs"]  # 0 (every page) is added as the baseline
    assert every["checkpoint_tokens"] == 0 and sparse["checkpoint_tokens"] == 256
    # Every page: one window row per host page, the bytes of 24 full layers per token.
    assert every["host_window_rows"] == every["host_pages"] > 0
    assert every["l2_bytes_per_cached_token"] == 24 * 2 * 8 * 64 * 2
    # Sparse, in the same bytes: fewer rows per page, so more pages held.
    assert 0 < sparse["host_window_rows"] < sparse["host_pages"]
    assert sparse["host_pages"] > every["host_pages"]
    assert 0.5 < sparse["bytes_ratio"] < 1.0
    for r in (every, sparse):
        assert 0.0 < r["served"]["host_share"] <= r["served"]["token_hit_rate"] <= 1.0
