"""Sealed format 2 objects: SipHash-2-4 chunk tags (native and numpy) under the table MAC."""

from __future__ import annotations

import hashlib
import hmac
import random
import struct

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.native import BuildOnce
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey, native_mac
from mesh_hicache.storage.keys import HEADER_SIZE, ObjectCodec, key_digest, tensor_bytes
from mesh_hicache.storage.objects import (
    FLAG_CHUNK_SIP,
    FLAG_MAC,
    OBJECT_MAGIC,
    ObjectError,
    chunk_bytes_for,
    table_size,
)

SECRET = b"s" * 32
NS = KeyNamespace("org/model", "float32", 1)
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))
SPEC_KEY = bytes(range(16))


def key(i: int) -> StorageKey:
    return StorageKey(NS, "kv", i.to_bytes(8, "little"), SLICE)


def row(i: int) -> torch.Tensor:  # [L, 2, T, H, D] f32: D = 16 -> 64-byte chunks
    return torch.randn((2, 2, 16, 4, 16), generator=torch.Generator().manual_seed(i))


def heads(t: torch.Tensor, lo: int, hi: int) -> list[tuple[int, int]]:
    L, two, T, H, D = t.shape
    item = t.element_size()
    return [
        ((((a * two + k) * T + s) * H + lo) * D * item, (hi - lo) * D * item)
        for a in range(L)
        for k in range(two)
        for s in range(T)
    ]


@pytest.fixture(params=["native", "numpy"])
def loop(request, monkeypatch):
    if request.param == "native":
        if not native_mac.available():
            pytest.skip("no C compiler: the native SipHash loop is not built")
    else:
        monkeypatch.setattr(native_mac, "_lib", BuildOnce(lambda: None))
    return request.param


def test_siphash_matches_the_reference_vectors(loop):
    message = bytes(range(len(native_mac.SPEC_VECTORS)))
    for n, want in enumerate(native_mac.SPEC_VECTORS):
        assert native_mac.siphash24(SPEC_KEY, message[:n]) == want, n
    assert native_mac.siphash24(SPEC_KEY, message[:15]) == 0xA129CA6149BE45E5  # Appendix A
    assert native_mac.siphash24(bytes(16), b"") != native_mac.SPEC_VECTORS[0]  # keyed


def test_chunk_tags_are_each_chunks_siphash_and_the_loops_agree(monkeypatch):
    rng = random.Random(0)
    cases = [(rng.randbytes(n), c) for n, c in [(1, 64), (300, 64), (4096, 72), (70001, 256)]]
    got = [native_mac.chunk_tags(SPEC_KEY, memoryview(d), c) for d, c in cases]
    for (data, chunk), tags in zip(cases, got, strict=True):
        want = [
            native_mac.siphash24(SPEC_KEY, data[i : i + chunk]) for i in range(0, len(data), chunk)
        ]
        assert tags == struct.pack(f"<{len(want)}Q", *want)
    monkeypatch.setattr(native_mac, "_lib", BuildOnce(lambda: None))
    assert [native_mac.chunk_tags(SPEC_KEY, memoryview(d), c) for d, c in cases] == got


def test_first_bad_chunk_finds_the_changed_chunk(loop):
    data = bytearray(random.Random(1).randbytes(64 * 20 + 9))
    tags = native_mac.chunk_tags(SPEC_KEY, memoryview(bytes(data)), 64)
    view = memoryview(data)
    assert native_mac.first_bad_chunk(SPEC_KEY, view, 64, 0, 21, tags) == -1
    data[7 * 64 + 3] ^= 1
    data[20 * 64 + 8] ^= 1  # the short last chunk
    assert native_mac.first_bad_chunk(SPEC_KEY, view, 64, 0, 21, tags) == 7
    assert native_mac.first_bad_chunk(SPEC_KEY, view, 64, 8, 21, tags) == 20
    assert native_mac.first_bad_chunk(SPEC_KEY, view, 64, 8, 20, tags) == -1


def test_sealed_object_layout_tags_and_whole_and_ranged_reads(tmp_path, loop):
    store = FileStorage(tmp_path / "l3", secret=SECRET)
    src = row(1)
    assert store.put_one(key(1), src)
    blob = store.object_path(key(1)).read_bytes()
    assert blob[:4] == OBJECT_MAGIC
    assert int.from_bytes(blob[6:8], "little") == FLAG_MAC | FLAG_CHUNK_SIP
    chunk = chunk_bytes_for(src.shape, 4)
    payload = bytes(tensor_bytes(src))
    table = blob[HEADER_SIZE : HEADER_SIZE + table_size(len(payload), chunk, True)]
    sip_key = hashlib.blake2b(SECRET, digest_size=16, person=b"mhc-chunk-sip").digest()
    count = -(-len(payload) // chunk)
    assert table[16 : 16 + 8 * count] == native_mac.chunk_tags(sip_key, memoryview(payload), chunk)
    assert blob[48:64] == table[-16:]  # the header's tag is the table's MAC
    assert blob[HEADER_SIZE + len(table) :] == payload
    dst = torch.zeros_like(src)
    assert store.get_one(key(1), dst) and torch.equal(dst, src)
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(1)], [dst], [heads(src, 1, 3)]) == [True]
    assert torch.equal(dst[..., 1:3, :], src[..., 1:3, :])
    store.close()


def _tamper(store: FileStorage, k: StorageKey, offset: int) -> None:
    path = store.object_path(k)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


def test_a_changed_payload_byte_or_tag_is_a_mac_miss_for_whole_and_ranged_reads(tmp_path):
    store = FileStorage(tmp_path / "l3", secret=SECRET, read_gap_bytes=0)
    src = row(2)
    start = HEADER_SIZE + table_size(src.nbytes, 64, True)
    for i in (1, 2, 3, 4):
        assert store.put_one(key(i), src)
    _tamper(store, key(1), start + 5)  # head 0 of the first token: chunk 0
    _tamper(store, key(2), start + 5)
    _tamper(store, key(3), start + src.nbytes - 1)  # the last byte
    _tamper(store, key(4), HEADER_SIZE + 16 + 3)  # chunk 0's tag in the table
    dst = torch.zeros_like(src)
    assert not store.get_one(key(1), dst)  # whole: every chunk is checked
    assert store.get_ranges([key(2)], [dst], [heads(src, 2, 4)]) == [True]  # chunk 0 not read
    assert store.get_ranges([key(2)], [dst], [heads(src, 0, 2)]) == [False]
    assert not store.get_one(key(3), dst)
    assert store.get_ranges([key(4)], [dst], [heads(src, 2, 4)]) == [False]  # table MAC
    assert store.stats.corrupt_by_kind == {"mac": 4}
    store.close()


def test_a_table_made_without_the_secret_is_refused(tmp_path):
    """A writer of the store who swaps a chunk and rebuilds the table under another
    secret (it cannot compute ours) is refused; so is one who keeps the table."""
    src, fake = row(3), row(4)
    ours = FileStorage(tmp_path / "l3", secret=SECRET)
    theirs = ObjectCodec(b"t" * 32)
    k = ours.key_str(key(5))
    ours.object_path(key(5)).parent.mkdir(parents=True, exist_ok=True)
    ours.object_path(key(5)).write_bytes(theirs.encode_object(k, tensor_bytes(fake), 64))
    dst = torch.zeros_like(src)
    assert not ours.get_one(key(5), dst)
    assert ours.put_one(key(6), src)
    path = ours.object_path(key(6))
    blob = bytearray(path.read_bytes())
    start = len(blob) - src.nbytes
    blob[start : start + 64] = bytes(tensor_bytes(fake))[:64]  # chunk 0 replaced, table kept
    path.write_bytes(bytes(blob))
    assert not ours.get_one(key(6), dst)
    assert ours.get_ranges([key(6)], [dst], [heads(src, 0, 1)]) == [False]
    assert ours.stats.corrupt_by_kind == {"mac": 2}
    ours.close()


def _legacy_sealed(codec_secret: bytes, k: str, payload: bytes, chunk: int) -> bytes:
    """A sealed format 2 object as written before FLAG_CHUNK_SIP: unkeyed BLAKE2b-64 chunk
    tags, the header tag the HMAC of the payload (objects.py's documented old layout)."""
    mac_key = hashlib.blake2b(codec_secret, digest_size=32, person=b"mhc-mac-key").digest()
    digest = key_digest(k)
    n = len(payload)
    whole = hmac.new(mac_key, digest + struct.pack("<Q", n) + payload, "sha256").digest()[:16]
    header = struct.pack("<4sHH32sQ16s", OBJECT_MAGIC, 2, FLAG_MAC, digest, n, whole)
    tags = b"".join(
        hashlib.blake2b(payload[i : i + chunk], digest_size=8).digest() for i in range(0, n, chunk)
    )
    body = struct.pack("<QII", n, chunk, -(-n // chunk)) + tags
    tag = hmac.new(mac_key, b"mhc-chunks" + digest + body, "sha256").digest()[:16]
    return header + body + tag + payload


def test_sealed_objects_of_the_previous_layout_stay_readable(tmp_path):
    store = FileStorage(tmp_path / "l3", secret=SECRET)
    src = row(7)
    payload = bytes(tensor_bytes(src))
    path = store.object_path(key(7))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_legacy_sealed(SECRET, store.key_str(key(7)), payload, 64))
    dst = torch.zeros_like(src)
    assert store.get_one(key(7), dst) and torch.equal(dst, src)
    dst = torch.zeros_like(src)
    assert store.get_ranges([key(7)], [dst], [heads(src, 3, 4)]) == [True]
    assert torch.equal(dst[..., 3:4, :], src[..., 3:4, :])
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    assert store.get_ranges([key(7)], [dst], [heads(src, 3, 4)]) == [False]
    assert store.stats.corrupt_by_kind == {"mac": 1}
    store.close()


def test_chunk_sip_flag_needs_a_secret_and_a_table(tmp_path):
    sealed = ObjectCodec(SECRET)
    k = key(8).to_str()
    header, table = sealed.encode_chunked(k, memoryview(bytes(256)), 64)
    with pytest.raises(ObjectError) as info:
        ObjectCodec().decode_header(k, header)  # a reader without the secret
    assert info.value.kind == "unsealed"
    v1 = bytearray(header)
    v1[4:6] = (1).to_bytes(2, "little")  # version 1 cannot carry FLAG_CHUNK_SIP
    with pytest.raises(ObjectError) as info:
        sealed.decode_header(k, bytes(v1))
    assert info.value.kind == "unsealed"
    head = sealed.decode_header(k, header)
    with pytest.raises(ObjectError) as info:
        sealed.check_payload(head, bytes(255) + b"\x01", sealed.decode_table(head, table))
    assert info.value.kind == "mac"
