"""FileStorage under a hostile root: symlinks, special files, races, stale temps, read-only."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import mesh_hicache.storage.file as file_mod
from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, GuardedStorage, KeyNamespace, StorageKey

NS = KeyNamespace("org/model", "float32", 1)
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))


def key(i: int) -> StorageKey:
    return StorageKey(NS, "kv", i.to_bytes(8, "little"), SLICE)


def page(i: int) -> torch.Tensor:
    return torch.randn((4, 64), generator=torch.Generator().manual_seed(i))


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def files_under(path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*") if p.is_file() or p.is_symlink())


@pytest.fixture
def store(tmp_path):
    s = FileStorage(tmp_path / "l3")
    yield s
    s.close()


# One symlink at each level of the key path: v1 / ns / region / page hash / object.
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_planted_symlink_at_any_level_is_a_miss_and_one_warning(store, tmp_path, caplog, depth):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"not yours")
    assert store.put_one(key(1), page(1))
    path = store.object_path(key(1))
    victim = path
    for _ in range(5 - depth):
        victim = victim.parent
    if victim.is_dir():
        shutil.copytree(victim, outside / "copy")  # a look-alike tree behind the link
        shutil.rmtree(victim)
        victim.symlink_to(outside / "copy", target_is_directory=True)
    else:
        shutil.copyfile(victim, outside / "copy")
        victim.unlink()
        victim.symlink_to(outside / "copy")
    before = files_under(outside)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.exists([key(1)]) == 0
        assert store.get_one(key(1), torch.empty_like(page(1))) is False
        assert store.put_one(key(1), page(1)) is False
        assert store.put_one(key(2), page(2)) is (depth >= 4)  # key 2 shares dirs 1-3
    assert files_under(outside) == before  # nothing written, nothing removed
    assert victim.is_symlink()  # not removed either
    assert len(warnings_in(caplog)) == 1 and "symlink" in warnings_in(caplog)[0]
    assert store.stats.unsafe == 3 + (depth < 4)


def test_symlink_between_two_keys_deletes_nothing(store):
    store.put([key(1), key(2)], [page(1), page(2)])
    a, b = store.object_path(key(1)), store.object_path(key(2))
    a.unlink()
    a.symlink_to(b)  # key 1 now "holds" key 2's object
    dst = torch.empty_like(page(1))
    assert store.get_one(key(1), dst) is False
    assert b.is_file() and a.is_symlink()
    assert store.get_one(key(2), dst) and torch.equal(dst, page(2))
    assert store.stats.corrupt == 0 and store.stats.unsafe == 1


@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_special_entry_at_an_object_is_a_miss(store, what):
    assert store.put_one(key(1), page(1))
    path = store.object_path(key(1))
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)  # opening it for reading must not block
    else:
        path.mkdir()
    assert store.exists([key(1)]) == 0
    assert store.get_one(key(1), torch.empty_like(page(1))) is False
    assert store.put_one(key(1), page(1)) is False
    assert path.exists() and not path.is_file()
    assert store.stats.unsafe == 3 and store.stats.dropped == 1


def test_guard_passes_refusals_as_misses(tmp_path):
    guard = GuardedStorage(FileStorage(tmp_path / "l3"))
    (tmp_path / "outside").mkdir()
    (tmp_path / "l3" / "v1").symlink_to(tmp_path / "outside", target_is_directory=True)
    assert guard.put_one(key(1), page(1)) is False
    assert guard.get_one(key(1), page(1)) is False and guard.exists([key(1)]) == 0
    st = guard.stats
    assert not guard.degraded and st.errors == 0 and st.unsafe == 3


def test_swapping_a_directory_for_a_symlink_never_writes_outside(tmp_path):
    # The check-then-open race: a thread keeps replacing the region directory with a
    # symlink to a directory outside the root (and back) while puts and gets run.
    store = FileStorage(tmp_path / "l3")
    outside = tmp_path / "outside"
    outside.mkdir()
    store.put_one(key(0), page(0))
    region = store.object_path(key(0)).parent.parent
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        # Each swap moves the real directory aside for good (a put may still be writing in
        # it, so it is not removed); the store recreates it on its next put. Moving it
        # back raced that recreation: under load the swapper spun there, 1 swap in 120 s.
        while not stop.is_set():
            aside = region.with_name(f"kv-aside-{swaps[0]}-{time.monotonic_ns()}")
            try:
                os.rename(region, aside)
            except OSError:  # not there: the store has not recreated it yet
                time.sleep(0.0001)
                continue
            try:
                region.symlink_to(outside, target_is_directory=True)
                swaps[0] += 1
            except FileExistsError:
                pass  # the store recreated the directory first
            time.sleep(0.0005)
            if region.is_symlink():  # the store refuses a symlink and never removes it
                region.unlink()

    # The swapper needs the GIL for every syscall it makes; at the default 5 ms switch
    # interval the store's loop starves it (11 swaps in 4,000 puts on a 2-core CI box).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        dst = torch.empty_like(page(0))
        wrong = 0
        i = 0
        # Until the race was hit often enough, bounded by time rather than by puts: a
        # loaded machine swaps slowly, and the count of puts per swap varies with load.
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and (i < 300 or swaps[0] < 20 or store.stats.unsafe == 0):
            i += 1
            store.put_one(key(i), page(i))
            if store.get_one(key(i), dst) and not torch.equal(dst, page(i)):
                wrong += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert swaps[0] >= 20, swaps
    assert files_under(outside) == [] and wrong == 0
    assert store.stats.unsafe > 0  # the race was actually hit


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_are_removed_at_open_without_a_cap(tmp_path):
    store = FileStorage(tmp_path / "l3")
    store.put_one(key(1), page(1))
    d = store.object_path(key(1)).parent
    host = next(store._tmp_names).split("-")[1]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = d / f".tmp-{host}-{_dead_pid()}-abcd1234-0"
        live = d / f".tmp-{host}-{sleeper.pid}-abcd1234-0"
        other_host = d / f".tmp-00000000-{_dead_pid()}-abcd1234-0"
        old = d / f".tmp-00000000-{sleeper.pid}-abcd1234-0"  # ours, another host's, aged
        not_ours = d / ".tmp-123-crashed"  # another program's temp file, however old
        for p in (dead, live, other_host, old, not_ours):
            p.write_bytes(b"partial")
        for p in (old, not_ours):
            os.utime(p, (time.time() - 7200, time.time() - 7200))
        foreign = d / "notes.txt"
        foreign.write_bytes(b"someone else's")
        link = d / f".tmp-{host}-{_dead_pid()}-abcd1234-1"
        link.symlink_to(foreign)
        FileStorage(tmp_path / "l3")  # no max_bytes: the open still cleans up
        assert not dead.exists() and not old.exists()
        assert live.exists() and other_host.exists()  # a live writer, another host's pid
        assert not_ours.exists()
        assert foreign.read_bytes() == b"someone else's" and link.is_symlink()
        assert store.exists([key(1)]) == 1
    finally:
        sleeper.kill()
        sleeper.wait()


def _read_only(monkeypatch) -> None:
    """Every create (mkdir, O_CREAT) fails with EROFS, as on a read-only mount."""
    real_open = os.open

    def ro_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args, **kwargs)

    def ro_mkdir(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(file_mod.os, "open", ro_open)
    monkeypatch.setattr(file_mod.os, "mkdir", ro_mkdir)


def test_read_only_store_serves_reads_and_warns_once(tmp_path, monkeypatch, caplog):
    FileStorage(tmp_path / "l3").put_one(key(1), page(1))
    clock = [0.0]
    guard = GuardedStorage(
        FileStorage(tmp_path / "l3"), retry_interval_s=1.0, clock=lambda: clock[0]
    )
    _read_only(monkeypatch)
    dst = torch.empty_like(page(1))
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        for i in range(20):
            clock[0] += 2.0  # every call would be a retry, were the guard degraded
            assert guard.put([key(i + 2)], [page(i + 2)]) == [False]
            assert guard.get_one(key(1), dst) and torch.equal(dst, page(1))
    monkeypatch.undo()
    assert len(warnings_in(caplog)) == 1 and "read-only" in warnings_in(caplog)[0]
    st = guard.stats
    assert st.dropped == 20 and st.get_hits == 20 and st.errors == 0 and not guard.degraded


def test_removed_root_is_recreated(tmp_path):
    store = FileStorage(tmp_path / "l3")
    store.put_one(key(1), page(1))
    shutil.rmtree(tmp_path / "l3")
    assert store.exists([key(1)]) == 0
    assert store.put_one(key(2), page(2))
    dst = torch.empty_like(page(2))
    assert store.get_one(key(2), dst) and torch.equal(dst, page(2))
    assert store.object_path(key(2)).is_file()
