"""CPU transfer engine: a worker thread doing the copies in submission order.

Each copy job (one region of one layer, all pages of the operation) is cut into runs:
maximal stretches where both the source and the destination indices are consecutive.
Each run is one ``copy_`` of a ``[run, *row]`` block straight from pool to pool (a row is
a whole page of one layer, e.g. 128 KiB for 64 tokens x 8 heads x 128 dims in bf16;
never a token). Measured on CPU, ``index_select``/``index_copy_`` over the same rows were
5-10x slower than these block copies, and a staging pass would double the traffic.
Same semantics as the CUDA engine.
"""

from __future__ import annotations

from mesh_hicache.transfer.engine import CopyJob, TransferEngine, TransferKind, _Op


def index_runs(src_idx: list[int], dst_idx: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the pairs in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_idx, dst_idx, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class CpuTransferEngine(TransferEngine):
    """Thread-backed engine for pools on the CPU (tests, CPU-only runs)."""

    kind = "cpu"

    def _run_layers(
        self, kind: TransferKind, plan: list[tuple[int, list[CopyJob]]], op: _Op
    ) -> None:
        runs_of: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for pos, (layer, jobs) in enumerate(plan):
            self._check_fault(op, layer)
            for job in jobs:
                key = (id(job.src_idx), id(job.dst_idx))
                if key not in runs_of:
                    runs_of[key] = index_runs(job.src_idx.tolist(), job.dst_idx.tolist())
                for s, d, n in runs_of[key]:
                    job.dst[d : d + n].copy_(job.src[s : s + n])
            self._layer_ready(op, pos)
