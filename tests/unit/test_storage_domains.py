"""FileStorage shared with other trust domains, versions and programs: secret-derived
names, objects this reader cannot check left alone, per-object errors, planted huge or
future-dated objects, and a cap and temp cleanup that touch only what is ours."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch

import mesh_hicache.storage.file as file_mod
import mesh_hicache.storage.file_read as file_read
from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, GuardedStorage, KeyNamespace, StorageKey
from mesh_hicache.storage.file_tree import _host_tag
from mesh_hicache.storage.objects import HEADER_SIZE

NS = KeyNamespace("org/model", "float32", 1)
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))
A_SECRET, B_SECRET = b"a" * 32, b"b" * 32


def key(i: int) -> StorageKey:
    return StorageKey(NS, "kv", i.to_bytes(8, "little"), SLICE)


def page(i: int) -> torch.Tensor:
    return torch.randn((4, 64), generator=torch.Generator().manual_seed(i))


def snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# -- trust domains ------------------------------------------------------------------------


def test_two_secrets_share_a_root_and_both_keep_their_hits(tmp_path):
    root = tmp_path / "l3"
    alice = FileStorage(root, secret=A_SECRET)
    assert all(alice.put([key(i) for i in range(8)], [page(i) for i in range(8)]))
    before = snapshot(root)
    # The same keys from another secret and from no secret: neither sees, reads,
    # overwrites nor removes alice's objects; each writes under names of its own.
    bob = FileStorage(root, secret=B_SECRET)
    plain = FileStorage(root)
    for other in (bob, plain):
        assert other.exists([key(i) for i in range(8)]) == 0
        assert not any(other.get([key(0)], [torch.empty_like(page(0))]))
        assert all(other.put([key(i) for i in range(8)], [page(100 + i) for i in range(8)]))
    after = snapshot(root)
    assert all(after[name] == data for name, data in before.items())
    assert len(after) == 3 * len(before)
    for store, base in ((alice, 0), (bob, 100), (plain, 100)):
        for i in range(8):
            dst = torch.empty_like(page(i))
            assert store.get_one(key(i), dst) and torch.equal(dst, page(base + i))
    # Without the secret the names say nothing: no plain page hash, no plain namespace.
    names = "/".join(before)
    assert key(3).page_hash.hex() not in names and NS.digest() not in names


def test_a_new_secret_is_a_new_key_space_and_rotation_is_a_cold_start(tmp_path):
    root = tmp_path / "l3"
    FileStorage(root, secret=A_SECRET).put_one(key(1), page(1))
    rotated = FileStorage(root, secret=B_SECRET)
    assert rotated.exists([key(1)]) == 0  # old objects are not read (and not removed)
    assert len(snapshot(root)) == 1


# -- what a reader cannot check is left alone ---------------------------------------------


def test_an_object_of_a_newer_format_version_is_a_miss_and_left_alone(tmp_path):
    store = FileStorage(tmp_path / "l3")
    assert store.put_one(key(1), page(1))
    path = store.object_path(key(1))
    data = bytearray(path.read_bytes())
    data[4:6] = (3).to_bytes(2, "little")  # written by a newer release
    path.write_bytes(bytes(data))
    dst = torch.empty_like(page(1))
    assert not store.get_one(key(1), dst)
    assert store.stats.corrupt_by_kind == {"version": 1}
    assert path.read_bytes() == bytes(data)  # a rolling upgrade keeps the newer cache
    assert store.put_one(key(1), page(1)) and path.read_bytes() == bytes(data)


def test_a_huge_planted_object_is_a_miss_without_reading_or_allocating_it(tmp_path):
    store = FileStorage(tmp_path / "l3")
    path = store.object_path(key(1))
    for ranged in (False, True):
        assert store.put_one(key(1), page(1))
        with open(path, "r+b") as f:
            f.truncate(4 << 30)  # 4 GiB, sparse: costs no disk
        dst = torch.empty_like(page(1))
        tracemalloc.start()
        try:
            if ranged:
                hit = store.get_ranges([key(1)], [dst], [[(0, 64)]])[0]
            else:
                hit = store.get_one(key(1), dst)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert not hit
        assert peak < 1 << 20, peak  # a few KiB of bookkeeping, not the file's 4 GiB
        assert not path.exists()  # at our own name and damaged by its own length: removed
    assert store.stats.corrupt_by_kind == {"length": 2}


@pytest.mark.parametrize("where, err", [("open", errno.EACCES), ("read", errno.EIO)])
def test_one_unreadable_object_is_one_miss_and_the_tier_stays_up(tmp_path, monkeypatch, where, err):
    store = FileStorage(tmp_path / "l3")
    # Distinct slices, so that each object's file name is its own.
    keys = [
        StorageKey(NS, "kv", b"\x07" * 8, GlobalSlice((0, 2), (i, i + 1), (0, 16)))
        for i in range(10)
    ]
    assert all(store.put(keys, [page(i) for i in range(10)]))
    bad_name = store.object_path(keys[3]).name
    real_open, real_preadv = os.open, os.preadv
    bad_fds: set[int] = set()

    def fake_open(path, flags, *args, **kwargs):
        if path == bad_name and where == "open" and kwargs.get("dir_fd") is not None:
            raise PermissionError(err, os.strerror(err))
        fd = real_open(path, flags, *args, **kwargs)
        (bad_fds.add if path == bad_name else bad_fds.discard)(fd)  # fd numbers are reused
        return fd

    def fake_preadv(fd, buffers, offset, *args):
        if fd in bad_fds and where == "read":
            raise OSError(err, os.strerror(err))
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(file_mod.os, "open", fake_open)
    monkeypatch.setattr(file_read.os, "preadv", fake_preadv)
    guarded = GuardedStorage(store)
    dst = [torch.empty_like(page(i)) for i in range(10)]
    for _ in range(2):  # and the next batch is served too: nothing was disabled
        hits = guarded.get(keys, dst)
        assert hits == [i != 3 for i in range(10)]
        assert not guarded.degraded
    assert all(torch.equal(dst[i], page(i)) for i in range(10) if i != 3)
    stats = guarded.stats
    assert stats.unreadable == 2 and stats.errors == 0
    assert stats.unreadable_by_kind == {errno.errorcode[err]: 2}


# -- the cap and the temp cleanup touch only what is ours ---------------------------------


def test_objects_stamped_in_the_future_are_evicted_first(tmp_path):
    one = HEADER_SIZE + 4 * 64 * 4 + 64  # about one object
    store = FileStorage(tmp_path / "l3", max_bytes=1 << 20)
    assert all(store.put([key(i) for i in range(6)], [page(i) for i in range(6)]))
    future = time.time() + 10 * 365 * 86400
    for i in range(3):  # planted or from a clock that jumped: not our record
        os.utime(store.object_path(key(i)), (future, future))
    small = FileStorage(tmp_path / "l3", max_bytes=4 * one, low_watermark=0.5)
    present = [small.exists_one(key(i)) for i in range(6)]
    assert present == [False] * 4 + [True] * 2, present  # the future ones first


def test_the_cap_and_cleanup_never_touch_files_that_are_not_ours(tmp_path):
    root = tmp_path / "l3"
    store = FileStorage(root)
    assert store.put_one(key(1), page(1))
    obj_dir = store.object_path(key(1)).parent
    old = time.time() - 7 * 86400
    foreign = [
        root / ".tmp-otherapp-lock",
        root / "projects" / "src" / ".tmp-build.o",
        obj_dir / ".tmp-123-crashed",
        # A key-shaped name with someone else's bytes in it.
        store.object_path(key(2)),
    ]
    for p in foreign:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 20000)
        os.utime(p, (old, old))
    capped = FileStorage(root, max_bytes=2000, low_watermark=0.1)  # must evict all it can
    assert all(p.read_bytes() == b"x" * 20000 for p in foreign)
    assert not capped.exists_one(key(1))  # our own object was evicted


def test_temp_files_of_another_pid_namespace_are_not_judged_by_pid(tmp_path):
    # Two containers sharing a root can share a host name; a pid means nothing across
    # their pid namespaces, so the owner tag names the namespace too.
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare to make a pid namespace")
    code = "from mesh_hicache.storage.file_tree import _host_tag; print(_host_tag())"
    out = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    other = out.stdout.strip()
    assert len(other) == 8 and other != _host_tag()
    store = FileStorage(tmp_path / "l3")
    assert store.put_one(key(1), page(1))
    in_flight = store.object_path(key(1)).parent / f".tmp-{other}-1-abcd1234-0"
    in_flight.write_bytes(b"partial")  # pid 1 of that namespace, busy writing
    dead_here = store.object_path(key(1)).parent / f".tmp-{other}-999999-abcd1234-1"
    dead_here.write_bytes(b"partial")  # that pid is free here: says nothing there
    FileStorage(tmp_path / "l3")
    assert in_flight.exists() and dead_here.exists()
