"""Self-tests of the distributed harness: failures are loud and bounded."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from tests.distributed.harness import RankFailure, run_on_mesh


def _rank_and_coord(mesh):
    return dist.get_rank(), tuple(mesh.get_coordinate())


def _raise_on_rank_one(mesh):
    if dist.get_rank() == 1:
        raise KeyError("boom from rank one")
    dist.barrier()  # rank 0 would hang here without the harness


def _hang_on_rank_zero(mesh):
    if dist.get_rank() == 0:
        time.sleep(3600)


def _die_on_rank_one(mesh):
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def test_runs_every_rank():
    out = run_on_mesh((2, 2), _rank_and_coord)
    assert out == [(0, (0, 0)), (1, (0, 1)), (2, (1, 0)), (3, (1, 1))]


# The bounds below count from the ranks being up (RankFailure.after_up_s): starting them
# is bounded by start_timeout and takes tens of seconds on a loaded 2-core machine.


def test_rank_exception_fails_with_traceback_and_coords():
    with pytest.raises(RankFailure) as info:
        run_on_mesh((2,), _raise_on_rank_one, timeout=30)
    text = str(info.value)
    assert "boom from rank one" in text and "KeyError" in text
    assert "rank 1 {'tp': 1}" in text
    up_s = info.value.after_up_s
    assert up_s is not None and up_s < 20, "a raising rank must not wait for the timeout"


def test_hanging_rank_fails_by_timeout():
    with pytest.raises(RankFailure, match="timeout after 3s") as info:
        run_on_mesh((2,), _hang_on_rank_zero, timeout=3)
    up_s = info.value.after_up_s
    assert up_s is not None and 3 <= up_s < 15, up_s


def test_slow_start_has_its_own_bound():
    # No rank can be up within a millisecond: the start bound fails the call by name.
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] did not start within 0.001s"):
        run_on_mesh((2,), _rank_and_coord, start_timeout=0.001)


def test_dead_rank_fails():
    with pytest.raises(RankFailure, match=r"rank 1 died \(exit code 7\)"):
        run_on_mesh((2,), _die_on_rank_one, timeout=20)


def test_nccl_variant_runs_or_skips_with_reason():
    out = run_on_mesh((2,), _rank_and_coord, backend="nccl")
    assert [r for r, _ in out] == [0, 1]


def _return_views(mesh):
    import torch

    big = torch.arange(1_000_000, dtype=torch.float32)
    return {"view": big[dist.get_rank() : dist.get_rank() + 3], "rank": dist.get_rank()}


def test_tensor_results_cross_as_plain_copies():
    # Tensors once crossed through torch's fd-sharing pickler and raced the rank's exit;
    # now they are copied into the report, and only the view's own elements travel.
    for _ in range(3):
        out = run_on_mesh((2, 2), _return_views)
        for rank, result in enumerate(out):
            assert result["rank"] == rank
            assert result["view"].tolist() == [float(rank + i) for i in range(3)]
            assert result["view"].untyped_storage().nbytes() == 3 * 4
