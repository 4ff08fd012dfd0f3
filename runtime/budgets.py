"""Cache budgets sized from the machine when no size flag is given.

Without ``--device-pages`` / ``--device-bytes``, L1 (per rank) is a byte arena of

- on a GPU: :data:`L1_GPU_SHARE` of the device memory free once the model is loaded
  (like vLLM's ``gpu_memory_utilization``; the rest is left to activations);
- on CPU: :data:`L1_CPU_BYTES`, at most :data:`L1_CPU_MAX_SHARE` of the available host
  memory of each local rank (vLLM's CPU build reserves a fixed KV space the same way).

Without ``--host-pages`` / ``--host-bytes``, L2 is :data:`L2_HOST_SHARE` of the host
memory available to each local rank (``MemAvailable`` / local ranks), at most
:data:`L2_MAX_OVER_L1` times L1. The ranks of a mesh agree on the smallest budgets.
An explicit byte budget larger than the machine is an error.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

L1_GPU_SHARE = 0.8
L1_CPU_BYTES = 1 << 30
L1_CPU_MAX_SHARE = 0.125
L2_HOST_SHARE = 0.25
L2_MAX_OVER_L1 = 2
GIB = float(1 << 30)


def host_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (else free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclass(frozen=True, slots=True)
class Machine:
    """What one rank may use: its device's free / total memory (a GPU; 0 on CPU) and
    its share of the host's available memory."""

    gpu: bool
    device_free: int
    device_total: int
    host_available: int
    local_ranks: int

    @classmethod
    def detect(cls, gpu: bool | None = None) -> Machine:
        gpu = torch.cuda.is_available() if gpu is None else gpu
        free = total = 0
        if gpu:
            free, total = torch.cuda.mem_get_info()
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return cls(gpu, int(free), int(total), host_available_bytes(), local)

    @property
    def host_per_rank(self) -> int:
        return self.host_available // self.local_ranks

    def default_device_bytes(self) -> int:
        if self.gpu:
            return int(L1_GPU_SHARE * self.device_free)
        return min(L1_CPU_BYTES, int(L1_CPU_MAX_SHARE * self.host_per_rank))

    def default_host_bytes(self, device_bytes: int) -> int:
        return min(int(L2_HOST_SHARE * self.host_per_rank), L2_MAX_OVER_L1 * device_bytes)


def auto_device(args: argparse.Namespace) -> bool:
    """L1 is sized from the machine (no ``--device-pages`` / ``--device-bytes``)."""
    return getattr(args, "device_pages", 64) is None and not args.device_bytes


def auto_host(args: argparse.Namespace) -> bool:
    """L2 is sized from the machine (no ``--host-pages`` / ``--host-bytes``, L1 sized
    from the machine too)."""
    return auto_device(args) and not args.host_pages and not args.host_bytes


def check_budgets(args: argparse.Namespace, machine: Machine) -> None:
    """``ValueError`` (one line) when an explicit byte budget exceeds the machine."""
    if args.device_bytes:
        have = machine.device_total if machine.gpu else machine.host_per_rank
        where = "device memory" if machine.gpu else "available host memory"
        if args.device_bytes > have:
            raise ValueError(
                f"--device-bytes {args.device_bytes} is more than this machine has: "
                f"{have} bytes ({have / GIB:.1f} GiB) of {where} per rank"
            )
    host = args.host_bytes + (0 if machine.gpu else args.device_bytes)
    if args.host_bytes and host > machine.host_per_rank:
        raise ValueError(
            f"--host-bytes {args.host_bytes} is more than this machine has: "
            f"{machine.host_per_rank} bytes ({machine.host_per_rank / GIB:.1f} GiB) of "
            f"available host memory per rank ({machine.local_ranks} local ranks)"
        )


def size_from_machine(args: argparse.Namespace, machine: Machine) -> str:
    """Fill ``args.device_bytes`` / ``args.host_bytes`` where no flag sized them; returns
    how each budget was chosen (for the startup line)."""
    sources = []
    if auto_device(args):
        host_too = auto_host(args)
        args.device_bytes = machine.default_device_bytes()
        if machine.gpu:
            sources.append(f"L1 {L1_GPU_SHARE:.0%} of free device memory")
        else:
            sources.append(f"L1 the CPU default {L1_CPU_BYTES / GIB:g} GiB")
        if host_too:
            args.host_bytes = machine.default_host_bytes(args.device_bytes)
            sources.append(
                f"L2 {L2_HOST_SHARE:.0%} of available host memory per rank, "
                f"at most {L2_MAX_OVER_L1}x L1"
            )
    if getattr(args, "device_pages", 0) is None:
        args.device_pages = 0
    return "; ".join(sources) if sources else "the size flags"


def apply_budgets(args: argparse.Namespace, topology: object) -> str:
    """:func:`size_from_machine` on every rank of ``topology`` (a ``MeshTopology``), then
    the smallest budgets of all ranks (collective: a rank's free memory may differ)."""
    from mesh_hicache.consensus import Consensus
    from mesh_hicache.topology import MeshTopology

    assert isinstance(topology, MeshTopology)
    sized = auto_device(args)
    source = size_from_machine(args, Machine.detect(topology.device_type == "cuda"))
    if sized:  # every rank takes the same branch: the flags are the same on all
        agree = Consensus.over(topology, "pp", "cp", "tp", background=True)
        args.device_bytes, args.host_bytes = agree.min_list([args.device_bytes, args.host_bytes])
    return source


def budget_line(cache: object, page_size: int, source: str) -> str:
    """The startup line: each tier's budget per rank in bytes and tokens."""
    from mesh_hicache.cache import HiCache

    assert isinstance(cache, HiCache)
    parts = []
    for tier, pools in (("L1", cache.device), ("L2", cache._ctl.host)):
        if pools is None:
            parts.append(f"{tier} off")
            continue
        size, tokens = pools.nbytes, pools.max_pages * page_size
        parts.append(f"{tier} {size} bytes ({size / GIB:.2f} GiB, {tokens} tokens)")
    return f"cache budgets per rank: {', '.join(parts)}; sized by {source}"
