"""Authenticated objects: a keyed MAC over key and payload when a storage secret is set."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import FileStorage, KeyNamespace, StorageKey, make_storage, open_storage
from mesh_hicache.storage.base import load_secret
from mesh_hicache.storage.keys import (
    FLAG_MAC,
    HEADER_SIZE,
    PLAIN_CODEC,
    ObjectCodec,
    ObjectError,
    decode_object,
    encode_object,
    key_digest,
    tensor_bytes,
)

SECRET = b"s" * 32
NS = KeyNamespace("org/model", "float32", 1, tenant="alice")
SLICE = GlobalSlice((0, 2), (0, 4), (0, 16))


def key(i: int, ns: KeyNamespace = NS) -> StorageKey:
    return StorageKey(ns, "kv", i.to_bytes(8, "little"), SLICE)


def page(i: int) -> torch.Tensor:
    return torch.randn((4, 64), generator=torch.Generator().manual_seed(i))


def kind_of(fn) -> str:
    with pytest.raises(ObjectError) as info:
        fn()
    return info.value.kind


def test_codec_round_trip_and_what_a_secret_rejects():
    k = key(1).to_str()
    payload = tensor_bytes(page(1))
    sealed = ObjectCodec(SECRET)
    blob = sealed.encode_object(k, payload)
    assert bytes(sealed.decode_object(k, blob, payload.nbytes)) == bytes(payload)
    assert int.from_bytes(blob[6:8], "little") == FLAG_MAC
    # Forgeries: an unsealed (CRC32) object, one sealed under another secret, one with
    # the MAC flag and a made-up tag, a payload changed after sealing.
    plain = encode_object(k, payload)
    assert kind_of(lambda: sealed.decode_object(k, plain)) == "unsealed"
    other = ObjectCodec(b"t" * 32).encode_object(k, payload)
    assert kind_of(lambda: sealed.decode_object(k, other)) == "mac"
    made_up = bytearray(blob)
    made_up[HEADER_SIZE - 16 : HEADER_SIZE] = bytes(16)
    assert kind_of(lambda: sealed.decode_object(k, bytes(made_up))) == "mac"
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    assert kind_of(lambda: sealed.decode_object(k, bytes(flipped))) == "mac"
    # The MAC binds the key: a valid object copied under another key is refused.
    assert kind_of(lambda: sealed.decode_object(key(2).to_str(), blob)) == "foreign"
    # A reader without a secret cannot check a MAC and refuses sealed objects.
    assert kind_of(lambda: decode_object(k, blob)) == "unsealed"
    assert bytes(decode_object(k, plain)) == bytes(payload)
    assert not PLAIN_CODEC.keyed and sealed.keyed


def test_mac_differs_from_crc_and_binds_length_and_digest():
    payload = tensor_bytes(page(3))
    codec = ObjectCodec(SECRET)
    d1, d2 = key_digest(key(1).to_str()), key_digest(key(2).to_str())
    assert codec.tag(d1, payload) != codec.tag(d2, payload)
    assert codec.tag(d1, payload) != PLAIN_CODEC.tag(d1, payload)
    assert codec.tag(d1, payload[:-4]) != codec.tag(d1, payload)


@pytest.mark.parametrize("bad", [b"short", "", 12345])
def test_bad_secrets_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        ObjectCodec(bad)  # type: ignore[arg-type]


def test_load_secret(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    assert load_secret(secret_file=f) == SECRET
    assert load_secret(secret="x" * 20) == b"x" * 20
    assert load_secret() is None
    with pytest.raises(ValueError, match="not both"):
        load_secret(SECRET, f)
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(secret_file=tmp_path / "missing")
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(secret_file=tmp_path / "empty")
    (tmp_path / "tiny").write_bytes(b"abc")
    with pytest.raises(ValueError, match="at least"):
        load_secret(secret_file=tmp_path / "tiny")


def _forge(store: FileStorage, k: StorageKey, fake: torch.Tensor, codec: ObjectCodec) -> None:
    """What a writer of the store without the secret can do once it has seen an object's
    name (by listing the root): a well-formed object under that name."""
    path = store.object_path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(codec.encode_object(store.key_str(k), tensor_bytes(fake)))


def test_forged_object_is_a_miss_with_a_secret(tmp_path, caplog):
    store = FileStorage(tmp_path / "l3", secret=SECRET)
    assert store.put_one(key(1), page(1))
    dst = torch.empty_like(page(1))
    assert store.get_one(key(1), dst) and torch.equal(dst, page(1))
    _forge(store, key(1), page(666), PLAIN_CODEC)  # CRC-valid forgery over a real object
    _forge(store, key(2), page(667), ObjectCodec(b"guessed-wrong-secret"))
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert store.get([key(1), key(2)], [dst, torch.empty_like(dst)]) == [False, False]
    assert store.stats.corrupt_by_kind == {"unsealed": 1, "mac": 1}
    # An object this reader cannot check (unsealed) is left in place; one that fails the
    # MAC under a name derived from this secret is damage and is removed, so a fresh put
    # replaces it with a good object.
    assert store.put_one(key(1), page(1)) and not store.get_one(key(1), dst)
    assert store.put_one(key(2), page(2)) and store.get_one(key(2), dst)
    assert torch.equal(dst, page(2))
    # Without a secret the same forgery is accepted: what the secret is for.
    open_store = FileStorage(tmp_path / "plain")
    _forge(open_store, key(1), page(666), PLAIN_CODEC)
    assert open_store.get_one(key(1), dst) and torch.equal(dst, page(666))


def test_per_tenant_secrets_keep_tenants_apart(tmp_path):
    # Two tenants share one root, each with its own secret. Tenant B asks for A's key
    # (names are derived from the secret, so B's objects land under names of its own).
    root = tmp_path / "shared"
    bob_ns = dataclasses.replace(NS, tenant="bob")
    alice = make_storage("file", root=root, secret=b"a" * 32)
    bob = make_storage("file", root=root, secret=b"b" * 32)
    assert bob.put([key(1), key(2, bob_ns)], [page(666), page(2)]) == [True, True]
    dst = torch.empty_like(page(1))
    assert alice.get_one(key(1), dst) is False  # poisoned: a miss, never served
    assert bob.get_one(key(2, bob_ns), dst) and torch.equal(dst, page(2))
    assert alice.get_one(key(2, bob_ns), dst) is False  # and A cannot read B's objects
    assert alice.put_one(key(1), page(1)) and alice.get_one(key(1), dst)
    assert torch.equal(dst, page(1))
    assert bob.get_one(key(1), dst) and torch.equal(dst, page(666))  # B's own, untouched


def test_secret_file_option(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    store = make_storage("file", root=tmp_path / "l3", secret_file=str(f))
    assert store.codec.keyed
    assert store.put_one(key(1), page(1))
    same = FileStorage(tmp_path / "l3", secret=SECRET)
    assert same.get_one(key(1), torch.empty_like(page(1)))
    with pytest.raises(ValueError):
        FileStorage(tmp_path / "l3", secret_file=tmp_path / "nope")


def test_open_storage_checks_the_secret_at_once(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        open_storage("file", root=str(tmp_path / "l3"), secret_file=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="at least"):
        open_storage("file", root=str(tmp_path / "l3"), secret=b"short")
    f = tmp_path / "secret"
    f.write_bytes(SECRET)
    guard = open_storage("file", root=str(tmp_path / "l3"), secret_file=str(f))
    assert guard.put_one(key(1), page(1)) and not guard.degraded
    assert isinstance(guard.backend, FileStorage) and guard.backend.codec.keyed
    guard.close()
