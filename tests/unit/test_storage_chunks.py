"""The chunk table's fast paths: the native CRC loop and the file backend's gap reads."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import zlib

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.native import BuildOnce
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey, native_crc, native_mac
from mesh_hicache.storage.keys import HEADER_SIZE
from mesh_hicache.storage.objects import ObjectCodec, chunk_bytes_for, chunk_spans, table_size

NS = KeyNamespace("org/model", "bfloat16", 1)
SECRET = b"s" * 32


@pytest.fixture
def python_only(monkeypatch):
    """The native loop switched off: objects.py's Python loop serves."""
    monkeypatch.setattr(native_crc, "_lib", BuildOnce(lambda: None))


def _python_tags(data: bytes, chunk: int) -> bytes:
    crcs = [zlib.crc32(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return struct.pack(f"<{len(crcs)}I", *crcs)


def _blake2b_tags(data: bytes, chunk: int) -> bytes:
    return b"".join(
        hashlib.blake2b(data[i : i + chunk], digest_size=8).digest()
        for i in range(0, len(data), chunk)
    )


def test_native_loop_equals_zlib_per_chunk_and_whole():
    if not native_crc.available():
        pytest.skip("no C compiler or libz.so.1: the native CRC loop is not built")
    rng = random.Random(0)
    for n in [1, 15, 16, 63, 64, 65, 79, 80, 127, 128, 129, 255, 256, 1000, 4096, 70001]:
        data = rng.randbytes(n)
        assert native_crc.crc32(memoryview(data)) == zlib.crc32(data), n
        for chunk in (64, 72, 256, 512, 4096):
            got = native_crc.chunk_crcs(memoryview(data), chunk)
            assert got == (_python_tags(data, chunk), zlib.crc32(data)), (n, chunk)
    data = bytearray(rng.randbytes(4096))
    tags = _python_tags(bytes(data), 256)
    assert native_crc.first_bad_chunk(memoryview(data), 256, 0, 16, tags) == -1
    data[5 * 256 + 7] ^= 1
    assert native_crc.first_bad_chunk(memoryview(data), 256, 0, 16, tags) == 5
    assert native_crc.first_bad_chunk(memoryview(data), 256, 6, 16, tags) == -1


@pytest.mark.parametrize("secret", [None, SECRET], ids=["crc", "mac"])
def test_encode_chunked_is_the_same_bytes_with_and_without_the_native_loop(secret, monkeypatch):
    codec = ObjectCodec(secret)
    rng = random.Random(1)
    cases = [(rng.randbytes(n), c) for n, c in [(300, 64), (65536, 256), (100_000, 512)]]
    fast = [codec.encode_chunked("k", memoryview(d), c) for d, c in cases]
    for module in (native_crc, native_mac):  # the numpy / zlib loops serve
        monkeypatch.setattr(module, "_lib", BuildOnce(lambda: None))
    slow = [codec.encode_chunked("k", memoryview(d), c) for d, c in cases]
    assert fast == slow
    for (data, chunk), (header, table) in zip(cases, slow, strict=True):
        head = codec.decode_header("k", header)
        parsed = codec.decode_table(head, table)
        codec.check_payload(head, data, parsed)
        assert parsed.chunk_bytes == chunk and len(table) == table_size(
            len(data), chunk, codec.keyed
        )
        if secret is None:
            assert parsed.tags == _python_tags(data, chunk)
            codec.check_payload(head, data)  # the header tag is the whole payload's CRC
            assert header == codec.encode_header("k", data, chunked=True)
        else:  # the header carries the table's MAC; the tags are keyed
            assert head.tag == table[-16:]
            assert parsed.tags != _blake2b_tags(data, chunk)
            with pytest.raises(ValueError, match="encode_chunked"):
                codec.encode_header("k", data, chunked=True)


def _key(i: int, sl: GlobalSlice) -> StorageKey:
    return StorageKey(NS, "kv", i.to_bytes(8, "little"), sl)


def _heads(shape: tuple[int, ...], h: tuple[int, int], item: int) -> list[tuple[int, int]]:
    L, two, T, H, D = shape
    return [
        ((((la * two + k) * T + s) * H + h[0]) * D * item, (h[1] - h[0]) * D * item)
        for la in range(L)
        for k in range(two)
        for s in range(T)
    ]


def test_ranged_read_reads_short_gaps_along_and_checks_them(tmp_path):
    shape = (2, 2, 16, 2, 128)  # bf16: one head = 256 bytes = one chunk
    sl = GlobalSlice((0, 2), (0, 2), (0, 16))
    src = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert chunk_bytes_for(shape, 2) == 256
    gap = FileStorage(tmp_path / "gap")  # default: gaps under 4 KiB read along
    exact = FileStorage(tmp_path / "exact", read_gap_bytes=0)
    for store in (gap, exact):
        assert store.put_one(_key(1, sl), src)
        dst = torch.zeros_like(src)
        assert store.get_ranges([_key(1, sl)], [dst], [_heads(shape, (1, 2), 2)]) == [True]
        assert torch.equal(dst[..., 1:2, :], src[..., 1:2, :])
    # The gaps (head 0 of each token, 256 bytes) were read too: everything but the first
    # head of the first token; the exact store read the asked chunks only.
    assert gap.stats.get_bytes == src.nbytes - 256
    assert exact.stats.get_bytes == src.nbytes // 2
    # A corrupt byte inside a gap is checked like any byte that is read: a miss.
    path = gap.object_path(_key(1, sl))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + table_size(src.nbytes, 256, False) + 512 + 3] ^= 0x40  # head 0, t 1
    path.write_bytes(bytes(data))
    dst = torch.zeros_like(src)
    assert gap.get_ranges([_key(1, sl)], [dst], [_heads(shape, (1, 2), 2)]) == [False]
    assert gap.stats.corrupt_by_kind == {"checksum": 1}
    with pytest.raises(ValueError):
        FileStorage(tmp_path / "bad", read_gap_bytes=-1)
    with pytest.raises(TypeError):
        FileStorage(tmp_path / "bad", read_gap_bytes=1.5)  # type: ignore[arg-type]
    gap.close()
    exact.close()


def test_ranged_read_skips_gaps_of_a_page_or_more(tmp_path):
    shape = (2, 2, 4, 2, 4096)  # bf16: one head = 8 KiB, a gap of 8 KiB is not read
    sl = GlobalSlice((0, 2), (0, 2), (0, 4))
    src = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    store = FileStorage(tmp_path / "l3")
    assert store.put_one(_key(2, sl), src)
    dst = torch.zeros_like(src)
    assert store.get_ranges([_key(2, sl)], [dst], [_heads(shape, (0, 1), 2)]) == [True]
    assert torch.equal(dst[..., 0:1, :], src[..., 0:1, :])
    assert torch.count_nonzero(dst[..., 1:2, :]) == 0
    assert store.stats.get_bytes == src.nbytes // 2
    store.close()


def test_files_written_without_the_native_loop_are_identical(tmp_path, python_only, monkeypatch):
    shape = (2, 2, 16, 2, 128)
    sl = GlobalSlice((0, 2), (0, 2), (0, 16))
    src = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    slow = FileStorage(tmp_path / "slow")
    assert slow.put_one(_key(3, sl), src)
    slow_bytes = slow.object_path(_key(3, sl)).read_bytes()
    dst = torch.zeros_like(src)
    assert slow.get_ranges([_key(3, sl)], [dst], [_heads(shape, (0, 1), 2)]) == [True]
    assert torch.equal(dst[..., 0:1, :], src[..., 0:1, :])
    slow.close()
    monkeypatch.setattr(native_crc, "_lib", BuildOnce(native_crc._build))  # the loop again
    fast = FileStorage(tmp_path / "fast")
    assert fast.put_one(_key(3, sl), src)
    assert fast.object_path(_key(3, sl)).read_bytes() == slow_bytes
    fast.close()
    assert os.path.getsize(tmp_path / "fast" / _key(3, sl).to_str()) == len(slow_bytes)


def _spans_by_loop(ranges, nbytes, chunk, gap):
    out: list[tuple[int, int]] = []
    for off, length in sorted(ranges):
        if length:
            a, b = off // chunk * chunk, min(-(-(off + length) // chunk) * chunk, nbytes)
            if out and a - out[-1][1] < max(gap, 1):
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return out


def test_chunk_spans_of_many_ranges_equal_the_plain_loop():
    rng = random.Random(5)
    for _ in range(500):
        n = rng.randint(1, 5000)
        chunk, gap = rng.choice([1, 7, 64, 256]), rng.choice([0, 1, 64, 300, 4096])
        ranges = []
        for _ in range(rng.randint(17, 60)):  # above 16: the numpy path
            off = rng.randint(0, n)
            ranges.append((off, rng.randint(0, n - off)))
        assert chunk_spans(ranges, n, chunk, gap) == _spans_by_loop(ranges, n, chunk, gap)
    with pytest.raises(ValueError, match="outside"):
        chunk_spans([(0, 1)] * 20 + [(10, 5)], 12, 4)
