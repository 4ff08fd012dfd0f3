"""Chained page hashes and radix keys."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from mesh_hicache.radix import RadixKey, hashing, page_hashes


def test_chain_and_truncation() -> None:
    tokens = list(range(10))
    hs = page_hashes(tokens, 4)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs)
    # Chained: hashing the second page with the first as parent gives the same hash.
    assert page_hashes(tokens[4:8], 4, parent=hs[0]) == [hs[1]]
    # A different first page changes every later hash.
    other = page_hashes([99] + tokens[1:], 4)
    assert other[0] != hs[0] and other[1] != hs[1]
    assert page_hashes(tokens[:3], 4) == []


def test_namespace_isolates() -> None:
    tokens = [1, 2, 3, 4]
    assert page_hashes(tokens, 2, "a") != page_hashes(tokens, 2, "b")
    assert page_hashes(tokens, 2, "") != page_hashes(tokens, 2, "x")


def test_fixed_width_encoding() -> None:
    # Tokens are fixed-width: (1, 256) and (256, 1) and a page of one big id never collide.
    assert page_hashes([1, 256], 2) != page_hashes([256, 1], 2)
    assert page_hashes([2**40], 1) != page_hashes([0], 1)
    # The documented encoding: one 64-byte block (tag padded to 32 bytes, then the digest of
    # the length-prefixed namespace), the parent hash, 8-byte little-endian ints.
    h = page_hashes([7], 1)[0]
    ns = hashlib.sha256(struct.pack("<I", 0)).digest()
    raw = b"mesh_hicache.page.v2".ljust(32, b"\0") + ns + bytes(32) + struct.pack("<q", 7)
    assert h == hashlib.sha256(raw).digest()
    ns_t = hashlib.sha256(struct.pack("<I", 1) + b"t").digest()
    raw2 = b"mesh_hicache.page.v2".ljust(32, b"\0") + ns_t + h + struct.pack("<q", 9)
    assert page_hashes([9], 1, "t", parent=h) == [hashlib.sha256(raw2).digest()]


def test_stable_across_processes() -> None:
    # Load hashing.py alone (not the package, which imports torch) to keep this fast.
    code = (
        "import importlib.util as u, sys;"
        f"s = u.spec_from_file_location('h', {hashing.__file__!r});"
        "m = sys.modules['h'] = u.module_from_spec(s); s.loader.exec_module(m);"
        "print(m.page_hashes(list(range(32)), 8, 'tenant')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {page_hashes(list(range(32)), 8, "tenant")[-1].hex()}


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)
    with pytest.raises(ValueError, match="token ids"):
        page_hashes([2**64], 1)
    with pytest.raises(ValueError, match="parent"):
        page_hashes([1], 1, parent=b"short")
    with pytest.raises(TypeError, match="ints"):
        RadixKey((1, "a"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="namespace"):
        RadixKey((1,), 3)  # type: ignore[arg-type]


def test_radix_key_alignment() -> None:
    key = RadixKey([1, 2, 3, 4, 5], "ns")  # type: ignore[arg-type]
    assert key.tokens == (1, 2, 3, 4, 5) and len(key) == 5
    assert key.num_pages(2) == 2
    aligned = key.page_aligned(2)
    assert aligned == RadixKey((1, 2, 3, 4), "ns")
    assert aligned.page_aligned(2) is aligned
    assert key.page_hashes(2) == page_hashes([1, 2, 3, 4], 2, "ns")


@pytest.mark.parametrize(
    "tokens, error, shown",
    [
        ([3, True], TypeError, "True at position 1"),
        ([3, 4, 1.0], TypeError, "1.0 at position 2"),
        (["7"], TypeError, "'7' at position 0"),
        ([5, -1], ValueError, "-1 at position 1"),
        ([2**63], ValueError, str(2**63)),
        ([2**64 + 5], ValueError, str(2**64 + 5)),
    ],
)
def test_tokens_are_validated_naming_the_value(tokens, error, shown) -> None:
    with pytest.raises(error, match=shown):
        RadixKey(tokens)
    with pytest.raises(error, match=shown):
        page_hashes(tokens, 1)


def test_pack_accepts_int_sequences_of_any_kind() -> None:
    import numpy as np
    import torch

    want = hashing.pack_tokens([0, 1, 2**63 - 1, 31999])
    assert len(want) == 32 and hashing.unpack_tokens(want) == (0, 1, 2**63 - 1, 31999)
    assert hashing.pack_tokens((0, 1, 2**63 - 1, 31999)) == want
    assert hashing.pack_tokens(np.array([0, 1, 2**63 - 1, 31999], dtype=np.int64)) == want
    assert hashing.pack_tokens(t for t in [0, 1, 2**63 - 1, 31999]) == want
    assert hashing.pack_tokens(torch.tensor([3, 4])) == hashing.pack_tokens(range(3, 5))
    with pytest.raises(TypeError, match="True"):
        hashing.pack_tokens(np.array([True, False]))
    with pytest.raises(TypeError, match="bytes"):
        hashing.pack_tokens(b"\x01\x02")  # type: ignore[arg-type]
    assert hashing.pack_tokens([]) == b""


def test_keys_validate_once(monkeypatch: pytest.MonkeyPatch) -> None:
    key = RadixKey(list(range(10)), "ns")
    calls = []
    real = hashing.pack_tokens
    monkeypatch.setattr(hashing, "pack_tokens", lambda t: calls.append(1) or real(t))
    aligned = key.page_aligned(4)
    assert aligned.tokens == tuple(range(8)) and aligned.namespace == "ns"
    assert key.prefix(3).tokens == (0, 1, 2) and key.prefix(99) is key
    assert RadixKey.from_packed(key.data, "ns") == key
    assert key.page_hashes(4, start_page=1, parent=key.page_hashes(4)[0]) == key.page_hashes(4)[1:]
    assert calls == []  # slices, prefixes and hashes never look at a token again
    assert hash(key) == hash(RadixKey(range(10), "ns")) and key != RadixKey(range(10))


def test_numpy_arrays_pack_without_python_ints() -> None:
    import numpy as np

    for dtype in (np.int64, np.int32, np.uint16, np.uint64):
        arr = np.array([0, 1, 7, 31999], dtype=dtype)
        assert hashing.pack_tokens(arr) == hashing.pack_tokens([0, 1, 7, 31999])
    assert hashing.pack_tokens(np.array([], dtype=np.int64)) == b""
    with pytest.raises(ValueError, match="-3 at position 1"):
        hashing.pack_tokens(np.array([2, -3], dtype=np.int32))
    with pytest.raises(ValueError, match=str(2**63)):
        hashing.pack_tokens(np.array([5, 2**63], dtype=np.uint64))
    with pytest.raises(TypeError, match="at position 0"):
        hashing.pack_tokens(np.array([1.5, 2.0]))


def _python_chain(data: bytes, ps: int, ns: str, parent: bytes | None, start: int) -> list[bytes]:
    """The documented v2 chain, one hashlib call per page (the reference)."""
    prev, step, out = parent or bytes(32), ps * 8, []
    for at in range(start * step, len(data) - step + 1, step):
        prev = hashlib.sha256(hashing.namespace_prefix(ns) + prev + data[at : at + step]).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_both_hash_loops_give_the_documented_chain(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mesh_hicache import native as native_mod

    if native and not native_mod.available():
        pytest.skip("native page hash loop needs a C compiler (cc) and libcrypto")
    if not native:
        monkeypatch.setattr(hashing, "_native_module", None)
    rng = __import__("random").Random(5)
    for ps in (1, 3, 16, 64):
        for pages in (0, 1, 3, 4, 5, 33):
            data = hashing.pack_tokens(
                [rng.randrange(2**63) for _ in range(ps * pages + rng.randrange(ps))]
            )
            for ns, parent, start in (("", None, 0), ("t", bytes(range(32)), 1), ("", None, 2)):
                want = _python_chain(data, ps, ns, parent, start)
                got = hashing.packed_page_hashes(data, ps, ns, parent, start)
                assert got == want, (ps, pages, ns, start)


def test_native_build_folder_is_private(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from mesh_hicache import native as native_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native_mod._cache_dir() == str(tmp_path / "mesh_hicache" / "native")
    assert os.stat(tmp_path / "mesh_hicache" / "native").st_mode & 0o077 == 0
    os.chmod(tmp_path / "mesh_hicache" / "native", 0o777)  # others could plant a library
    other = native_mod._cache_dir()
    assert other != str(tmp_path / "mesh_hicache" / "native") and os.path.isdir(other)
    os.rmdir(other)


@pytest.mark.parametrize("native", [True, False], ids=["native-packer", "python-packer"])
def test_list_packing_paths_agree(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from mesh_hicache import native as native_mod

    pack = native_mod.packer()
    if native and pack is None:
        pytest.skip("native list packer needs a C compiler (cc) and Python's headers")
    if not native:
        monkeypatch.setattr(hashing, "_packer", None)
        monkeypatch.setattr(hashing, "_packer_loaded", True)
    rng = __import__("random").Random(9)
    for n in (0, 1, 7, 300):
        tokens = [rng.choice([0, 1, 2**63 - 1, rng.randrange(2**63)]) for _ in range(n)]
        want = struct.pack(f"<{n}q", *tokens)
        assert hashing.pack_tokens(tokens) == want == hashing.pack_tokens(tuple(tokens))
    if native:  # anything unusual is left to the Python path, which names it
        for bad in ([1, True], [3, -1], [2**63], [1.0], [np.int64(3)], [2, "x"]):
            assert pack(bad) is None, bad
        assert pack(range(3)) is None and pack([5, 6]) == struct.pack("<2q", 5, 6)
    with pytest.raises(TypeError, match="True at position 1"):
        hashing.pack_tokens([4, True])
    with pytest.raises(ValueError, match="-2 at position 2"):
        hashing.pack_tokens((4, 5, -2))
    assert hashing.pack_tokens([np.int64(3), 4]) == struct.pack("<2q", 3, 4)
