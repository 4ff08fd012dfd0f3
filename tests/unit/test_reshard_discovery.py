"""Writer-layout discovery (tiers/discovery.py) on the file backend: append-only entries,
racing writers, and the cost of a refresh when nothing new was recorded."""

from __future__ import annotations

from mesh_hicache.choices import CpKvMode
from mesh_hicache.storage.factory import make_storage
from mesh_hicache.storage.keys import KeyNamespace
from mesh_hicache.tiers.discovery import LayoutRegistry, entry_key
from mesh_hicache.tiers.reshard import MeshLayoutId

NS = KeyNamespace(model_id="m", dtype="float32", layout_version=1)
A = MeshLayoutId(1, 1, 1, CpKvMode.REPLICATE)
B = MeshLayoutId(2, 2, 2, CpKvMode.SHARD)


def test_register_is_idempotent_and_readers_see_every_mesh(tmp_path):
    store = make_storage("file", root=str(tmp_path))
    LayoutRegistry(store, NS).register(A)
    LayoutRegistry(store, NS).register(A)  # a restart of the same mesh adds nothing
    LayoutRegistry(store, NS).register(B)
    reader = LayoutRegistry(store, NS)
    assert reader.refresh(force=True) == (A, B)
    other = LayoutRegistry(store, KeyNamespace(model_id="m2", dtype="float32", layout_version=1))
    assert other.refresh(force=True) == ()  # another namespace records nothing of these


def test_racing_writers_both_end_up_recorded(tmp_path, monkeypatch):
    store = make_storage("file", root=str(tmp_path))
    first, second = LayoutRegistry(store, NS), LayoutRegistry(store, NS)
    assert first.register(A)
    # second read the table before first wrote: it puts B at index 0 too, which the
    # store keeps as A (never rewritten); reading back, it moves on to index 1.
    monkeypatch.setattr(second, "refresh", lambda force=False: second.known)
    assert second.register(B)
    assert second.known == (A, B)
    assert LayoutRegistry(store, NS).refresh(force=True) == (A, B)


def test_refresh_costs_one_lookup_when_nothing_new_and_is_rate_limited(tmp_path):
    store = make_storage("file", root=str(tmp_path))
    LayoutRegistry(store, NS).register(A)
    reader = LayoutRegistry(store, NS, refresh_s=3600.0)
    reader.refresh(force=True)
    assert reader.lookups == 2  # entry 0, then the miss at entry 1
    reader.refresh(force=True)
    assert reader.lookups == 3  # nothing new: one lookup
    reader.refresh()
    assert reader.lookups == 3  # within refresh_s: none
    LayoutRegistry(store, NS).register(B)
    assert reader.refresh(force=True) == (A, B)


def test_corrupt_entry_reads_as_the_end_of_the_table(tmp_path):
    store = make_storage("file", root=str(tmp_path))
    LayoutRegistry(store, NS).register(A)
    path = tmp_path / entry_key(NS, 0).to_str()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert LayoutRegistry(store, NS).refresh(force=True) == ()
