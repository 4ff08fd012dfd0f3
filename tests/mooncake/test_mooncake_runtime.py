"""The runtime on Mooncake: two instances share L3, writer election on a mesh, faults.

Every run serves the same small multi-turn workload (2 sessions x 2 turns, 256-token
first prompts); its shared prefixes are long enough (>= the 64-token prefetch
threshold) to be prefetched from L3 by an instance whose L1/L2 are empty. Different
tests use different ``--seed``s where they share a store, so no test sees another's
objects.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.mooncake import bodies, runtime_bodies
from tests.mooncake.services import MooncakeServices, NetnsWorker

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = [
    "--sessions", "2", "--turns", "2", "--first-prompt-len", "256", "--append-len", "32",
    "--prefetch-threshold", "64",
]  # fmt: skip
# One torch thread per process: two cores, several processes at once.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _outputs(run: dict[str, Any]) -> list[list[int]]:
    return [r["output_ids"] for r in run["requests"]]


def _serve_argv(seed: int, *extra: str) -> list[str]:
    return [*WORKLOAD, "--seed", str(seed), "--quiet", *extra]


def test_second_runtime_instance_reads_shared_prefixes_from_mooncake(
    mooncake_available: None, tmp_path: Path
) -> None:
    """Two ``python -m runtime.serve`` processes under ``scripts/mooncake_local.sh``."""
    py = sys.executable
    full = [py, "-m", "runtime.serve", "--cache", "full", "--storage", "mooncake"]
    full += ["--mooncake-master", "@MASTER@", *_serve_argv(1)]
    # A file where the file backend's root directory would be: if --storage mooncake
    # silently fell back to the file backend, L3 would fail and the second run miss.
    decoy = tmp_path / "not-a-directory"
    decoy.write_text("x")
    full += ["--storage-root", str(decoy)]
    # The script exports MOONCAKE_MASTER; the shell inside it expands it.
    line = " ".join(shlex.quote(a) for a in full).replace("@MASTER@", '"$MOONCAKE_MASTER"')
    first = f"{line} --json {shlex.quote(str(tmp_path / 'first.json'))}"
    second = f"{line} --json {shlex.quote(str(tmp_path / 'second.json'))}"
    # A third with both sessions in flight: their shared prefix is loaded from Mooncake
    # by two requests at once.
    third = f"{line} --concurrency 2 --json {shlex.quote(str(tmp_path / 'third.json'))}"
    # The cache-off baseline needs no store: it runs beside the script.
    off = subprocess.Popen(
        [py, "-m", "runtime.serve", "--cache", "off", *_serve_argv(1)]
        + ["--json", str(tmp_path / "off.json")],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
    )
    try:
        script = subprocess.run(
            [str(REPO / "scripts" / "mooncake_local.sh"), "--segment", str(64 << 20), "--"]
            + ["sh", "-c", f"{first} && {second} && {third}"],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert off.wait(timeout=120) == 0
    finally:
        if off.poll() is None:
            off.kill()
            off.wait()
    assert script.returncode == 0, script.stderr[-4000:]
    names = ("off", "first", "second", "third")
    runs = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}
    first_stats, second_stats = runs["first"]["cache_stats"], runs["second"]["cache_stats"]
    # The first instance found nothing in L3 and backed its pages up.
    assert runs["first"]["summary"]["cached_storage"] == 0
    assert first_stats["storage_put_objects"] > 0
    assert first_stats["storage_put_dropped"] == 0
    # The second started empty (a new process): its first turns came from Mooncake.
    assert runs["second"]["summary"]["cached_storage"] > 0
    for r in runs["second"]["requests"]:
        if r["turn"] == 0:
            assert r["cached"]["storage"] >= 64, f"first turn of session {r['session']}: {r}"
    assert second_stats["bytes_storage_to_host"] > 0
    assert not first_stats["storage_degraded"] and not second_stats["storage_degraded"]
    assert _outputs(runs["first"]) == _outputs(runs["off"])
    assert _outputs(runs["second"]) == _outputs(runs["off"])
    assert runs["third"]["summary"]["cached_storage"] > 0
    assert _outputs(runs["third"]) == _outputs(runs["off"])


def test_mesh_only_elected_writers_put_and_every_rank_reads(
    mooncake_services: MooncakeServices,
) -> None:
    """pp=1, cp=2, tp=2 with replicated CP KV: cp rank 0 writes each tp shard, both read."""
    argv = ["--cache", "full", "--storage", "mooncake"]
    argv += ["--mooncake-master", mooncake_services.master_address]
    argv += [*WORKLOAD, "--first-prompt-len", "128", "--seed", "2"]
    w = NetnsWorker(mooncake_services, timeout=240)
    try:
        first = w.call(runtime_bodies.serve_mesh, (1, 2, 2), argv)
        second = w.call(runtime_bodies.serve_mesh, (1, 2, 2), argv)
    finally:
        w.close()
    by_coords = {tuple(r["coords"]): r for r in first}
    assert set(by_coords) == {(0, c, t) for c in range(2) for t in range(2)}
    for (_, cp, tp), r in by_coords.items():
        peer = by_coords[(0, 1 - cp, tp)]
        assert not r["degraded"] and r["storage_put_dropped"] == 0
        for name, region in r["regions"].items():
            # Replicated over cp: both cp ranks hold the same shard (same tag), cp 0 writes.
            assert region["tag"] == peer["regions"][name]["tag"]
            assert region["writer"] == (cp == 0), (r["coords"], name)
            assert region["stored"] > 0, f"{r['coords']} {name}: no object of its shard"
            assert region["stored"] == peer["regions"][name]["stored"]
        stored = sum(region["stored"] for region in r["regions"].values())
        # The writer stored exactly the objects of its shards (rank (0, 0, 0) also records
        # the mesh's one layout-registry entry, tiers/discovery.py); the other never tried.
        if cp == 0:
            registry = 1 if tuple(r["coords"]) == (0, 0, 0) else 0
            assert r["puts"] == stored + registry, (r["coords"], r["puts"], stored)
        else:
            assert r["put_attempts"] == 0 and r["storage_put_objects"] == 0, r
    # tp splits the heads: the two tp ranks own different shards.
    tags = {tp: by_coords[(0, 0, tp)]["regions"]["kv"]["tag"] for tp in range(2)}
    assert tags[0] != tags[1]
    # New processes, empty L1/L2: every rank reads its own shard of the shared prefixes.
    for r in second:
        assert r["hit_tokens_storage"] > 0, r["coords"]
        assert r["get_hits"] > 0 and r["bytes_storage_to_host"] > 0, r["coords"]
        assert r["outputs"] == first[0]["outputs"]
        assert r["cached_storage"] == second[0]["cached_storage"]


def test_full_store_then_master_killed_mid_run_keep_serving(
    private_services: MooncakeServices, tmp_path: Path
) -> None:
    """Runtime-level faults on a 16 MiB store: first full (backups dropped), then the
    master SIGKILLed after the first request (L3 degraded). Both runs finish with the
    cache-off outputs."""
    assert private_services.master is not None
    full_argv = ["--cache", "full", "--storage", "mooncake"]
    full_argv += ["--mooncake-master", private_services.master_address, *WORKLOAD, "--seed", "3"]
    w = NetnsWorker(private_services, timeout=180)
    try:
        off = w.call(
            runtime_bodies.serve_cli,
            ["--cache", "off", *_serve_argv(3)],
            str(tmp_path / "off.json"),
        )
        # Fill the store (eviction is off in private_services): no room is left for
        # even the smallest runtime object (a 4 KiB KV page). The objects live in the
        # mooncake_client, beyond this storage's close.
        w.call(bodies.open_storage, private_services.master_address)
        packed = w.call(bodies.fill, "junk", 400, 48 << 10)
        w.call(bodies.close_storage)
        filled = w.call(
            runtime_bodies.serve_cli, [*full_argv, "--quiet"], str(tmp_path / "filled.json")
        )
        killed = w.call(
            runtime_bodies.serve_cli,
            [*full_argv, "--log-every", "1"],
            str(tmp_path / "killed.json"),
            kill_master_pid=private_services.master.pid,
            kill_after=1,
            master_address=private_services.master_address,
        )
    finally:
        w.close()
    assert 0 < sum(packed["flags"]) < 400, "the store was not filled"

    stats = filled["cache_stats"]
    assert stats["storage_put_dropped"] > 0, "a full store must drop backups"
    assert stats["storage_errors"] == 0 and not stats["storage_degraded"]
    assert _outputs(filled) == _outputs(off)

    assert killed["killed_at"] == 1, "the master was not killed after the first request"
    assert private_services.master.poll() is not None
    assert len(killed["requests"]) == 4
    assert _outputs(killed) == _outputs(off)
    stats = killed["cache_stats"]
    assert stats["storage_degraded"]
    assert stats["storage_errors"] >= 1
    assert killed["summary"]["cached_storage"] == 0
    # The second turns still hit: their sessions' prefixes come from L1/L2.
    for r in killed["requests"]:
        if r["turn"] == 1:
            assert r["cached"]["device"] + r["cached"]["host"] > 0, r
