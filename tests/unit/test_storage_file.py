"""FileStorage: round trips, integrity checks, atomicity, traversal, LRU cap, sharing."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch

import mesh_hicache.storage.file as file_mod
from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey
from mesh_hicache.storage.keys import HEADER_SIZE
from mesh_hicache.storage.objects import REMOVABLE_KINDS, chunk_bytes_for, table_size
from tests.distributed.harness import run_on_mesh

NS = KeyNamespace("org/model", "bfloat16", 1)
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))


def key(i: int, region: str = "kv", ns: KeyNamespace = NS) -> StorageKey:
    return StorageKey(ns, region, i.to_bytes(8, "little"), SLICE)


def page(i: int, dtype: torch.dtype = torch.float32, shape=(2, 16, 4, 8)) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def store(tmp_path):
    s = FileStorage(tmp_path / "l3")
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64])
def test_round_trip_is_bit_exact(store, dtype):
    keys = [key(i) for i in range(3)]
    src = [page(i, dtype) for i in range(3)]
    src[0].view(-1)[0] = float("nan") if dtype.is_floating_point else -1
    assert store.put(keys, src) == [True] * 3
    dst = [torch.empty_like(t) for t in src]
    assert store.get(keys, dst) == [True] * 3
    assert all(same_bits(a, b) for a, b in zip(src, dst, strict=True))
    st = store.stats
    assert (st.puts, st.gets, st.get_hits, st.get_misses) == (3, 3, 3, 0)
    assert st.put_bytes == st.get_bytes == 3 * src[0].nbytes


def test_bytes_not_dtype_matter(store):
    src = page(1, torch.bfloat16)
    assert store.put_one(key(1), src)
    dst = torch.empty(src.nbytes, dtype=torch.uint8)
    assert store.get_one(key(1), dst)
    assert torch.equal(dst, src.view(-1).view(torch.uint8))


def test_exists_is_the_consecutive_prefix(store):
    keys = [key(i) for i in range(5)]
    store.put([keys[0], keys[1], keys[3]], [page(0), page(1), page(3)])
    assert store.exists(keys) == 2
    assert store.exists(keys[3:]) == 1
    assert store.exists(keys[2:]) == 0
    assert store.exists([]) == 0
    assert store.exists_one(keys[3]) and not store.exists_one(keys[4])


def test_absent_and_other_namespace_miss(store):
    store.put_one(key(1), page(1))
    other = key(1, ns=dataclasses.replace(NS, tenant="acme"))
    dst = torch.empty_like(page(1))
    assert store.get([key(2), other], [dst, dst]) == [False, False]
    assert store.stats.get_misses == 2 and store.stats.corrupt == 0


def _corrupt_case(store, how: str) -> None:
    path = store.object_path(key(1))
    data = bytearray(path.read_bytes())
    if how == "checksum":
        data[-7] ^= 0x40  # a payload byte (the payload ends the file)
        path.write_bytes(bytes(data))
    elif how == "short":
        path.write_bytes(bytes(data[:-5]))
    elif how == "short_header":
        path.write_bytes(bytes(data[: HEADER_SIZE - 1]))
    elif how == "magic":
        path.write_bytes(b"JUNK" + bytes(data[4:]))
    elif how == "foreign":
        store.put_one(key(2), page(1))  # same bytes and size, other key
        shutil.copyfile(store.object_path(key(2)), path)
    elif how == "length":
        path.write_bytes(bytes(data) + b"\x00")


@pytest.mark.parametrize(
    "how, kind",
    [
        ("checksum", "checksum"),
        ("short", "short"),
        ("short_header", "short"),
        ("magic", "magic"),
        ("foreign", "foreign"),
        ("length", "length"),
    ],
)
def test_bad_object_is_a_miss_with_one_warning(store, caplog, how, kind):
    src = page(1)
    store.put_one(key(1), src)
    _corrupt_case(store, how)
    dst = torch.zeros_like(src)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.get_one(key(1), dst) is False
    st = store.stats
    assert st.corrupt == 1 and st.corrupt_by_kind == {kind: 1} and st.get_misses == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and kind in warnings[0].getMessage()
    if kind in REMOVABLE_KINDS:
        # Damaged by its own format: removed so that a fresh put can replace it.
        assert not store.exists_one(key(1))
        assert store.put_one(key(1), src) and store.get_one(key(1), dst)
        assert same_bits(src, dst)
    else:
        # Not checkable by this reader (another program's file, another key's object):
        # a miss, left where it is.
        assert store.exists_one(key(1)) and not store.get_one(key(1), dst)


def test_warns_once_per_kind(store, caplog):
    for i in range(3):
        store.put_one(key(i), page(i))
        _corrupt_case_simple(store.object_path(key(i)))
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.get([key(i) for i in range(3)], [page(0)] * 3) == [False] * 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert store.stats.corrupt_by_kind == {"checksum": 3}


def _corrupt_case_simple(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_wrong_destination_size_is_a_miss(store):
    store.put_one(key(1), page(1))
    assert not store.get_one(key(1), torch.empty(3, dtype=torch.float32))
    assert store.stats.corrupt_by_kind == {"length": 1}


class _EvilKey:
    def __init__(self, s: str) -> None:
        self.s = s

    def to_str(self, name_key: bytes | None = None) -> str:
        return self.s


@pytest.mark.parametrize(
    "evil",
    [
        "../../../../tmp/evil",
        "/etc/passwd",
        "v1/" + "0" * 32 + "/kv/00/../../../../../x",
        "v1/" + "0" * 32 + "/kv/00/L0-1.H0-1.T0-1/../../../../..",
    ],
)
def test_traversal_is_rejected(store, evil):
    k = _EvilKey(evil)
    for call in (
        lambda: store.put([k], [page(1)]),  # type: ignore[list-item]
        lambda: store.get([k], [page(1)]),  # type: ignore[list-item]
        lambda: store.exists([k]),  # type: ignore[list-item]
    ):
        with pytest.raises(ValueError):
            call()
    assert not any(p.is_file() for p in store.root.parent.rglob("*"))


def test_symlink_escape_is_refused(store, tmp_path, caplog):
    # A symlink in the root is refused (a drop / a miss and one warning), not followed,
    # not removed, and never raises.
    outside = tmp_path / "outside"
    outside.mkdir()
    link = store.root / "v1"
    link.symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.put([key(1), key(2)], [page(1), page(2)]) == [False, False]
        assert store.exists([key(1)]) == 0
        assert store.get_one(key(1), page(1)) is False
    assert not any(outside.rglob("*"))
    assert link.is_symlink()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    st = store.stats
    assert st.unsafe == 4 and st.dropped == 2 and st.get_misses == 1


def test_interrupted_write_leaves_no_object(store, monkeypatch):
    def half_then_fail(f, payload):
        f.write(payload[: payload.nbytes // 2])
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(file_mod, "_write_payload", half_then_fail)
    with pytest.raises(OSError):
        store.put_one(key(1), page(1))
    assert not store.exists_one(key(1))
    assert not store.get_one(key(1), page(1))
    assert [p for p in store.root.rglob("*") if p.is_file()] == []  # temp file cleaned up
    monkeypatch.undo()
    assert store.put_one(key(1), page(1))


def test_store_full_is_a_drop(store, monkeypatch, caplog):
    def full(f, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_mod, "_write_payload", full)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.put([key(1), key(2)], [page(1), page(2)]) == [False, False]
    assert store.stats.dropped == 2 and store.stats.puts == 0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert store.exists([key(1)]) == 0


def test_leftover_temp_file_is_not_an_object(store):
    store.put_one(key(1), page(1))
    path = store.object_path(key(1))
    (path.parent / ".tmp-123-crashed").write_bytes(b"partial")
    assert store.exists([key(1)]) == 1
    assert store.get_one(key(1), torch.empty_like(page(1)))


def test_present_object_is_not_rewritten(store):
    assert store.put_one(key(1), page(1))
    path = store.object_path(key(1))
    before = path.stat()
    assert store.put_one(key(1), page(99))  # other bytes: still not rewritten
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
    dst = torch.empty_like(page(1))
    assert store.get_one(key(1), dst) and same_bits(dst, page(1))
    assert store.stats.puts == 1 and store.stats.already_present == 1


def object_bytes(t: torch.Tensor) -> int:
    """Bytes of the file of one stored row: header, payload and chunk table."""
    chunk = chunk_bytes_for(t.shape, t.element_size())
    return HEADER_SIZE + t.nbytes + table_size(t.nbytes, chunk, keyed=False)


def test_size_cap_evicts_least_recently_used(tmp_path, monkeypatch):
    # Stamps far in the future, so the kernel's own atime updates on read (relatime)
    # cannot stand in for the backend's explicit recency stamps.
    monkeypatch.setattr(file_mod, "_clock_ns", lambda: 4 * 10**18)
    obj = object_bytes(page(0))
    store = FileStorage(tmp_path / "l3", max_bytes=int(3.5 * obj))
    dst = torch.empty_like(page(0))
    store.put([key(0), key(1), key(2)], [page(0), page(1), page(2)])
    assert store.get_one(key(0), dst)  # 0 is now more recent than 1 and 2
    store.put_one(key(3), page(3))  # 4 objects > 3.5: evict the LRU one (key 1)
    present = [store.exists_one(key(i)) for i in range(4)]
    assert present == [True, False, True, True]
    assert store.stats.evicted == 1
    store.put_one(key(2), page(2))  # present: refreshes recency, no write
    store.put_one(key(4), page(4))  # evicts key 0 (key 2 was refreshed)
    assert [store.exists_one(key(i)) for i in range(5)] == [False, False, True, True, True]
    total = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
    assert total <= 3.5 * obj
    # The empty page directories of evicted objects are removed too.
    assert not store.object_path(key(1)).parent.exists()


def test_object_larger_than_cap_is_dropped(tmp_path):
    store = FileStorage(tmp_path / "l3", max_bytes=100)
    assert store.put_one(key(1), page(1)) is False
    assert store.stats.dropped == 1 and not store.exists_one(key(1))


def test_new_instance_reads_and_caps_existing_root(tmp_path):
    first = FileStorage(tmp_path / "l3")
    first.put([key(i) for i in range(4)], [page(i) for i in range(4)])
    second = FileStorage(tmp_path / "l3")
    dst = torch.empty_like(page(2))
    assert second.get_one(key(2), dst) and same_bits(dst, page(2))
    obj = object_bytes(page(0))
    capped = FileStorage(tmp_path / "l3", max_bytes=2 * obj)  # evicts at start-up
    assert capped.exists([key(i) for i in range(4)]) < 4
    assert capped.stats.evicted >= 2


def test_bad_arguments(tmp_path, store):
    with pytest.raises(ValueError):
        FileStorage(tmp_path / "x", max_bytes=0)
    with pytest.raises(ValueError):
        store.put([key(1)], [])
    with pytest.raises(ValueError):
        store.put_one(key(1), page(1).transpose(0, 1))  # not contiguous


def _write_half(mesh, root: str) -> list[bool]:
    store = FileStorage(root)
    me = mesh.get_local_rank()
    # Each rank writes its own keys, and both write the shared keys 100..109.
    keys = [key(1000 * (me + 1) + i) for i in range(20)] + [key(100 + i) for i in range(10)]
    src = [page(k.page_hash[0] + 256 * k.page_hash[1]) for k in keys]
    return store.put(keys, src)


def test_two_processes_share_one_root(tmp_path):
    root = str(tmp_path / "shared")
    results = run_on_mesh((2,), _write_half, root)
    assert all(all(r) for r in results)
    store = FileStorage(root)
    keys = [key(b + i) for b in (1000, 2000) for i in range(20)] + [key(100 + i) for i in range(10)]
    dst = [torch.empty_like(page(0)) for _ in keys]
    assert store.get(keys, dst) == [True] * len(keys)
    for k, d in zip(keys, dst, strict=True):
        assert same_bits(d, page(k.page_hash[0] + 256 * k.page_hash[1]))
    assert list(store.root.rglob(".tmp-*")) == []


def test_threads_share_one_store(store):
    import threading

    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            for i in range(40):
                assert store.put_one(key(base + i), page(base + i))
        except BaseException as err:  # reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(1000 * t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    keys = [key(1000 * t + i) for t in range(1, 5) for i in range(40)]
    assert store.exists(keys) == len(keys) and store.stats.puts == len(keys)
