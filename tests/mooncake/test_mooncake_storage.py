"""MooncakeStorage against a real master + client on loopback (see conftest.py)."""

from __future__ import annotations

import pytest

from tests.mooncake import bodies
from tests.mooncake.services import MooncakeServices, NetnsWorker


def test_round_trip_kv_and_mamba_zero_copy(worker: NetnsWorker) -> None:
    out = worker.call(bodies.round_trip, 11, "zc", True)
    assert out["zero_copy"], "registered pool rows must take the zero-copy path"
    assert out["staging_bytes"] == 0, "zero-copy path must not stage through a copy"
    assert all(out["put"]) and len(out["put"]) == 12
    assert all(out["get"]) and len(out["get"]) == 12
    assert out["equal"] == {"kv": True, "mamba_conv": True, "mamba_ssm": True}


def test_round_trip_copy_path_for_unregistered_tensors(worker: NetnsWorker) -> None:
    out = worker.call(bodies.round_trip, 12, "copy", False)
    assert not out["zero_copy"]
    assert out["staging_bytes"] > 0
    assert all(out["put"]) and all(out["get"])
    assert out["equal"] == {"kv": True, "mamba_conv": True, "mamba_ssm": True}


def test_exists_is_a_consecutive_prefix(worker: NetnsWorker) -> None:
    out = worker.call(bodies.exists_prefix, "prefix", [0, 1, 3], 5)
    assert out["all"] == 2
    assert out["from_missing"] == 0
    assert out["empty"] == 0
    assert out["single"] == [True, True, False, True, False]
    assert out["again"] == [True]


def test_corrupt_short_and_foreign_objects_are_misses(worker: NetnsWorker) -> None:
    before = worker.call(bodies.stats)["corrupt_by_kind"]
    out = worker.call(bodies.corrupt_objects, "corrupt")
    assert out["codes"] == [0] * 5
    assert out["hits"] == [True, False, False, False, False]
    assert out["good_equal"]
    after = worker.call(bodies.stats)["corrupt_by_kind"]
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grown == {"checksum": 1, "foreign": 1, "length": 2}


def test_with_a_secret_forged_and_foreign_objects_are_misses(
    mooncake_services: MooncakeServices,
) -> None:
    w = NetnsWorker(mooncake_services, timeout=60)
    try:
        w.call(bodies.open_storage, mooncake_services.master_address, secret=b"k" * 32)
        out = w.call(bodies.sealed_objects, "sealed")
        kinds = w.call(bodies.stats)["corrupt_by_kind"]
    finally:
        w.close()
    assert out["codes"] == [0, 0, 0] and out["put"]
    assert out["hits"] == [False, False, False, True] and out["equal"]
    assert kinds == {"unsealed": 1, "mac": 2}


def test_second_process_reads_what_the_first_put(
    mooncake_services: MooncakeServices, worker: NetnsWorker
) -> None:
    # The shared ``worker`` (its own process and store client) is the reader.
    writer = NetnsWorker(mooncake_services, timeout=60)
    try:
        writer.call(bodies.open_storage, mooncake_services.master_address)
        assert all(writer.call(bodies.put_pages, 21, "shared"))
        # The writer contributes no memory: its objects live in the mooncake_client and
        # outlive it.
        writer.call(bodies.close_storage)
    finally:
        writer.close()
    out = worker.call(bodies.get_pages, 21, "shared")
    assert all(out["get"]) and len(out["get"]) == 12
    assert out["equal"] == {"kv": True, "mamba_conv": True, "mamba_ssm": True}


def test_full_store_drops_backups_without_raising(private_services: MooncakeServices) -> None:
    w = NetnsWorker(private_services, timeout=60)
    try:
        w.call(bodies.open_storage, private_services.master_address)
        out = w.call(bodies.fill, "full", 32, 1 << 20)  # 32 MiB into a 16 MiB store
        stats = w.call(bodies.stats)
    finally:
        w.close()
    stored = sum(out["flags"])
    assert 0 < stored < 32
    assert stats["dropped"] == 32 - stored
    assert stats["dropped_by_code"].get(-200, 0) == 32 - stored
    assert stats["puts"] == stored
    assert all(out["hits"]) and out["equal"], "what was reported stored must read back"


def test_master_killed_degrades_to_misses_and_recovers(
    private_services: MooncakeServices,
) -> None:
    w = NetnsWorker(private_services, timeout=60)
    try:
        w.call(bodies.open_guarded, private_services.master_address, 0.5)
        before = w.call(bodies.guarded_round_trip, 31, "kill")
        assert all(before["put"]) and all(before["get"]) and before["equal"]
        assert not before["degraded"]

        private_services.kill_master()
        # The worker call timeout (60 s) bounds these: a hang fails the test.
        during = w.call(bodies.guarded_get_after_outage, 31, "kill", 5)
        assert during["degraded"]
        assert during["errors"] >= 1
        for r in during["results"]:
            assert r["exists"] == 0
            assert r["get"] == [False] * 6

        private_services.start_master()
        after = w.call(bodies.guarded_wait_recovered, 32, "back", 40.0)
        assert not after["degraded"]
        assert all(after["put"]) and all(after["get"]) and after["equal"]
        assert after["exists"] == 6
    finally:
        w.close()


def test_frozen_master_degrades_within_the_call_deadline_and_recovers(
    private_services: MooncakeServices,
) -> None:
    # A stopped master still accepts TCP connections, so the port probe passes and the
    # Mooncake client would wait inside its call for good: the deadline bounds it.
    w = NetnsWorker(private_services, timeout=90)
    try:
        w.call(bodies.open_guarded, private_services.master_address, 0.5, call_timeout_s=2.0)
        before = w.call(bodies.guarded_round_trip, 41, "frozen")
        assert all(before["put"]) and all(before["get"]) and before["equal"]
        private_services.freeze_master(True)
        try:
            during = w.call(bodies.timed_guarded_calls, 41, "frozen", 4)
        finally:
            private_services.freeze_master(False)
        assert during["degraded"]
        for r in during["results"]:
            assert r["exists"] == 0 and r["get"] == [False] * 6
        # One deadline (2 s, + slack for a loaded machine) for the first call, then the
        # overrun call is still pending and every later call fails at once.
        assert during["seconds"][0] < 2.0 * 2 + 10, during["seconds"]
        assert sum(during["seconds"]) < 2.0 * 2 * 2 + 10, during["seconds"]
        after = w.call(bodies.guarded_wait_recovered, 42, "thawed", 40.0)
        assert not after["degraded"] and all(after["get"]) and after["equal"]
    finally:
        w.close()


def test_unreachable_master_at_start_degrades_at_once(worker: NetnsWorker) -> None:
    # Port 1 has no listener in the namespace: construction fails fast, the guard
    # answers misses instead of raising.
    out = worker.call(bodies.construct_against_dead_master, "127.0.0.1:1")
    assert out == {"exists": 0, "get": [False], "degraded": True, "errors": 1}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"master_address": "no-port"}, "host:port"),
        ({"master_address": "127.0.0.1:1", "protocol": "udp"}, "protocol"),
        ({"master_address": "127.0.0.1:1", "global_segment_size": -1}, "global_segment_size"),
    ],
)
def test_bad_configuration_is_a_value_error(kwargs: dict[str, object], match: str) -> None:
    from mesh_hicache.storage.mooncake import MooncakeStorage

    with pytest.raises(ValueError, match=match):
        MooncakeStorage(**kwargs)  # type: ignore[arg-type]


def test_ranged_reads_fetch_only_the_asked_chunks(worker: NetnsWorker) -> None:
    out = worker.call(bodies.ranged_reads, "ranged")
    assert out["put"]
    assert out["hits"] == [True, True, True, False]  # staged, zero-copy, version 1, absent
    assert out["heads_equal"] and out["others_untouched"] and out["old_equal"]
    # SSM heads 2..3 of 4 in each layer (64-byte chunks of one state vector): half the row.
    assert out["bytes_read"] == out["row_bytes"] // 2 and out["range_gets"] == 1
