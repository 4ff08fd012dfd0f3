"""Ranged reads: only the chunks holding the asked byte ranges are read, each verified."""

from __future__ import annotations

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, GuardedStorage, KeyNamespace, StorageKey
from mesh_hicache.storage.keys import HEADER_SIZE
from mesh_hicache.storage.objects import (
    ObjectCodec,
    ObjectError,
    chunk_bytes_for,
    table_size,
)

NS = KeyNamespace("org/model", "float32", 1)
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))
SECRET = b"s" * 32
SHAPE = (2, 2, 16, 4, 8)  # [L, 2, T, H, D]: D*4 bytes = 32 -> 64-byte chunks (2 heads)


def key(i: int) -> StorageKey:
    return StorageKey(NS, "kv", i.to_bytes(8, "little"), SLICE)


def row(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def head_ranges(t: torch.Tensor, heads: tuple[int, int]) -> list[tuple[int, int]]:
    """Byte ranges of heads [h0, h1) of a [L, 2, T, H, D] row (one run per (l, kv, t))."""
    L, two, T, H, D = t.shape
    item = t.element_size()
    h0, h1 = heads
    return [
        (((la * two + k) * T + s) * H * D * item + h0 * D * item, (h1 - h0) * D * item)
        for la in range(L)
        for k in range(two)
        for s in range(T)
    ]


@pytest.fixture(params=[None, SECRET], ids=["crc", "mac"])
def store(request, tmp_path):
    s = FileStorage(tmp_path / "l3", secret=request.param, read_gap_bytes=0)
    yield s
    s.close()


def test_ranged_read_returns_the_ranges_and_reads_only_their_chunks(store):
    src = row(1)
    assert store.put_one(key(1), src)
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(1)], [dst], [head_ranges(src, (2, 4))]) == [True]
    assert torch.equal(dst[..., 2:4, :], src[..., 2:4, :])
    assert torch.count_nonzero(dst[..., 0:2, :]) == 0  # never fetched
    st = store.stats
    assert st.range_gets == 1 and st.get_hits == 1
    assert st.get_bytes == src.nbytes // 2  # two of four heads, chunks of two heads


def test_whole_ranges_and_empty_ranges(store):
    src = row(2)
    store.put_one(key(2), src)
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(2)], [dst], [[(0, src.nbytes)]]) == [True]
    assert torch.equal(dst, src)
    assert store.get_ranges([key(2)], [torch.zeros_like(src)], [[]]) == [True]
    assert store.get_ranges([key(3)], [dst], [[(0, 4)]]) == [False]  # absent: a miss


def test_corrupt_chunk_inside_the_ranges_is_a_miss_outside_is_not_read(store):
    src = row(3)
    store.put_one(key(3), src)
    path = store.object_path(key(3))
    data = bytearray(path.read_bytes())
    start = HEADER_SIZE + table_size(src.nbytes, 64, store.codec.keyed)  # the payload
    data[start + 8] ^= 0x10  # head 0 of the first (l, kv, t) run
    path.write_bytes(bytes(data))
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(3)], [dst], [head_ranges(src, (2, 4))]) == [True]
    assert torch.equal(dst[..., 2:4, :], src[..., 2:4, :])
    assert store.get_ranges([key(3)], [dst], [head_ranges(src, (0, 2))]) == [False]
    kind = "mac" if store.codec.keyed else "checksum"
    assert store.stats.corrupt_by_kind == {kind: 1}
    assert not path.exists()  # removed, so that a later put stores a good copy


def test_forged_chunk_table_is_a_miss(store):
    src = row(4)
    store.put_one(key(4), src)
    path = store.object_path(key(4))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 20] ^= 1  # inside the chunk tags
    path.write_bytes(bytes(data))
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(4)], [dst], [head_ranges(src, (0, 2))]) == [False]
    kind = "mac" if store.codec.keyed else "checksum"
    assert store.stats.corrupt_by_kind == {kind: 1}


def test_format_version_1_objects_stay_readable_whole(tmp_path):
    store = FileStorage(tmp_path / "l3")
    src = row(5)
    path = store.object_path(key(5))
    path.parent.mkdir(parents=True)
    path.write_bytes(store.codec.encode_object(key(5).to_str(), src.view(-1).numpy().data))
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(5)], [dst], [head_ranges(src, (0, 1))]) == [True]
    assert torch.equal(dst, src) and store.stats.get_bytes == src.nbytes  # read whole
    assert store.get_one(key(5), torch.zeros_like(src))


def test_guard_passes_ranged_reads_through(tmp_path):
    inner = FileStorage(tmp_path / "l3")
    guard = GuardedStorage(inner)
    src = row(6)
    guard.put_one(key(6), src)
    dst = torch.zeros_like(src)
    assert guard.get_ranges([key(6)], [dst], [head_ranges(src, (1, 2))]) == [True]
    assert torch.equal(dst[..., 1:2, :], src[..., 1:2, :])
    assert guard.stats.range_gets == 1
    with pytest.raises(ValueError):
        guard.get_ranges([key(6)], [dst], [])


def test_chunk_rule_and_table_size():
    assert chunk_bytes_for((4, 2, 16, 8, 128), 2) == 256  # one bf16 head of D=128
    assert chunk_bytes_for((4, 2, 16, 4, 8), 4) == 64  # two 32-byte heads
    assert chunk_bytes_for((3, 12, 3), 4) == 72  # conv rows: 6 channels of K-1=3
    codec = ObjectCodec()
    payload = memoryview(bytes(300))
    table = codec.encode_table("k", payload, 64)
    assert len(table) == table_size(300, 64, keyed=False)
    header = codec.decode_header("k", codec.encode_header("k", payload, chunked=True))
    parsed = codec.decode_table(header, table)
    assert parsed.spans([(70, 10), (0, 1), (200, 10), (290, 10)]) == [(0, 128), (192, 300)]
    with pytest.raises(ValueError):
        parsed.spans([(290, 11)])
    with pytest.raises(ObjectError):
        ObjectCodec(SECRET).decode_table(header, table)  # wrong seal: a table tag mismatch
