"""Storage key schema and object format (mesh_hicache/storage/keys.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage.keys import (
    HEADER_SIZE,
    KEY_PATTERN,
    REGIONS,
    KeyNamespace,
    ObjectError,
    StorageKey,
    check_key_str,
    decode_object,
    encode_object,
    tensor_bytes,
)

NS = KeyNamespace("org/model-7b", "bfloat16", 1, tenant="")
SLICE = GlobalSlice((0, 4), (2, 4), (0, 16))
KEY = StorageKey(NS, "kv", bytes(range(16)), SLICE)


def _variants() -> dict[str, StorageKey]:
    return {
        "base": KEY,
        "model": dataclasses.replace(KEY, namespace=dataclasses.replace(NS, model_id="org/x")),
        "dtype": dataclasses.replace(KEY, namespace=dataclasses.replace(NS, dtype="float16")),
        "layout": dataclasses.replace(KEY, namespace=dataclasses.replace(NS, layout_version=2)),
        "tenant": dataclasses.replace(KEY, namespace=dataclasses.replace(NS, tenant="acme")),
        "region": dataclasses.replace(KEY, region="indexer"),
        "hash": dataclasses.replace(KEY, page_hash=bytes(range(1, 17))),
        "layers": dataclasses.replace(KEY, slice=GlobalSlice((4, 8), (2, 4), (0, 16))),
        "heads": dataclasses.replace(KEY, slice=GlobalSlice((0, 4), (0, 2), (0, 16))),
        "tokens": dataclasses.replace(KEY, slice=GlobalSlice((0, 4), (2, 4), (0, 8))),
    }


def test_any_field_change_gives_a_different_key():
    strs = {name: k.to_str() for name, k in _variants().items()}
    assert len(set(strs.values())) == len(strs), strs
    for s in strs.values():
        assert KEY_PATTERN.fullmatch(s)


def test_key_is_stable_and_versioned():
    again = StorageKey(
        KeyNamespace("org/model-7b", torch.bfloat16, 1), "kv", bytes(range(16)), SLICE
    )
    assert again.to_str() == KEY.to_str()
    assert KEY.to_str().startswith("v1/")
    assert KEY.to_str().endswith("/kv/" + bytes(range(16)).hex() + "/L0-4.H2-4.T0-16")


def test_namespace_fields_are_length_prefixed():
    a = KeyNamespace("a", "bf16", 1, tenant="bc")
    b = KeyNamespace("ab", "bf16", 1, tenant="c")
    assert a.digest() != b.digest()


@pytest.mark.parametrize("model_id", ["../../etc/passwd", "/abs/path", "a/../b", "..", "x\\y"])
def test_user_strings_never_reach_the_key(model_id):
    key = dataclasses.replace(
        KEY, namespace=KeyNamespace(model_id, "float32", 0, tenant="../" + model_id)
    )
    s = key.to_str()
    assert ".." not in s and "\\" not in s and not s.startswith("/")
    assert s.count("/") == 4


@pytest.mark.parametrize(
    "change",
    [
        {"region": "../kv"},
        {"region": "kv/../../x"},
        {"region": "mamba"},
        {"page_hash": b""},
        {"page_hash": bytes(65)},
        {"slice": GlobalSlice((0, 0), (0, 1), (0, 1))},
        {"slice": GlobalSlice((-1, 2), (0, 1), (0, 1))},
        {"slice": GlobalSlice(("..", "/x"), (0, 1), (0, 1))},  # type: ignore[arg-type]
    ],
)
def test_invalid_key_fields_are_rejected(change):
    with pytest.raises((ValueError, TypeError)):
        dataclasses.replace(KEY, **change)


def test_invalid_namespace_fields_are_rejected():
    with pytest.raises(ValueError):
        KeyNamespace("", "float32", 0)
    with pytest.raises(ValueError):
        KeyNamespace("m", "float32", -1)
    with pytest.raises(ValueError):
        KeyNamespace("m\x00", "float32", 0)
    with pytest.raises(TypeError):
        KeyNamespace("m", "float32", 0, tenant=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StorageKey(NS, "kv", "00ff", SLICE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "v1/" + "0" * 32 + "/kv/00/../../../x",
        "v1/" + "0" * 32 + "/kv/00/L0-1.H0-1.T0-1/..",
        "v1/" + "0" * 32 + "/kv/0g/L0-1.H0-1.T0-1",
        "v1/" + "0" * 32 + "/evil/00/L0-1.H0-1.T0-1",
    ],
)
def test_check_key_str_rejects_traversal(bad):
    with pytest.raises(ValueError):
        check_key_str(bad)
    assert check_key_str(KEY.to_str()) == KEY.to_str()


def test_object_format_round_trip_and_checks():
    key = KEY.to_str()
    payload = tensor_bytes(torch.arange(10, dtype=torch.float32))
    blob = encode_object(key, payload)
    assert len(blob) == HEADER_SIZE + 40
    assert bytes(decode_object(key, blob, expected_nbytes=40)) == bytes(payload)

    def kind(data: bytes, other_key: str = key, nbytes: int | None = None) -> str:
        with pytest.raises(ObjectError) as info:
            decode_object(other_key, data, nbytes)
        return info.value.kind

    flipped = bytearray(blob)
    flipped[-1] ^= 1
    assert kind(bytes(flipped)) == "checksum"
    assert kind(blob[:-1]) == "short"
    assert kind(blob[:10]) == "short"
    assert kind(b"XXXX" + blob[4:]) == "magic"
    assert kind(blob, other_key=_variants()["tenant"].to_str()) == "foreign"
    assert kind(blob, nbytes=44) == "length"


def test_tensor_bytes_is_a_writable_view_for_any_dtype():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    view = tensor_bytes(t)
    assert view.nbytes == 12
    view[:2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert t[0, 0].item() == 1.5
    with pytest.raises(ValueError):
        tensor_bytes(torch.zeros(4, 4).t())
    assert set(REGIONS) == {"kv", "kv_window", "indexer", "mamba_conv", "mamba_ssm"}
