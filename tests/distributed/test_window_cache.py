"""Sliding-window pages in L3 on a mesh: every rank agrees on the same hit when one rank
lacks a windowed object, what each rank reads is bit-exact, and the trees stay identical
(the pages a prefetch marks missing come from agreed values only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from mesh_hicache.cache import HiCache
from mesh_hicache.layout import RegionName
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.unit.cache_support import hashes_of, make_config, serve
from tests.unit.test_window_tiers import A, B, window_spec

LOSER = 3  # pp stage 1, tp rank 1: its own slice of page 9's windowed object goes missing


def _body(mesh: Any, root: str) -> dict[str, Any]:
    topo = MeshTopology.from_mesh(mesh)
    config = make_config(root, device_pages=24, host_pages=48, window_checkpoint_tokens=16)
    writer = HiCache(topo, window_spec(), config)
    serve(writer, A)
    writer.flush()
    tag = internals(writer).layout.region(RegionName.KV_WINDOW).global_slice.tag()
    writer.close()
    if dist.get_rank() == LOSER:
        lost = hashes_of(A)[9].hex()  # A's end (40 tokens) needs pages 8 and 9
        next(Path(root).glob(f"v1/*/kv_window/{lost}/{tag}")).unlink()
    dist.barrier()

    reader = HiCache(topo, window_spec(), config)
    a = serve(reader, A)  # the loser's deepest is 36 (pages 7, 8): every rank takes 36
    # B shares 28 tokens of A, but A's pages came from L3 with pages 0, 1, 4, 5 missing
    # (kept: 36's pages 7, 8 and the checkpoints' 2, 3 and 6, 7): 28, 24 and 20 need page
    # 4 or 5, L3 lacks them too, so B resumes at the checkpoint 16 from L1.
    b = serve(reader, B)
    reader.flush()
    reader.check_integrity()
    out = {
        "a": (a.hit.storage_tokens, tuple(a.served), a.mismatches),
        "b": (tuple(b.served), b.mismatches),
        "digest": reader.digest(),
    }
    reader.close()
    return out


def test_a_rank_missing_a_windowed_object_shortens_every_rank_alike(tmp_path):
    out = run_on_mesh((2, 1, 2), _body, str(tmp_path / "l3"), timeout=120)
    assert all(o["digest"] == out[0]["digest"] for o in out)
    for o in out:
        assert o["a"] == (36, (0, 0, 36), 0)
        assert o["b"] == ((16, 0, 0), 0)
