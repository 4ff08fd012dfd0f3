"""Every choice list of the library, defined once, as str-valued enums.

A member compares and hashes like its value (``WritePolicy.WRITE_BACK == "write_back"``),
and ``str()``/``format()`` give the value, so plain strings from users, argparse and JSON
keep working; :meth:`Choice.parse` turns one into a member or raises ``ValueError`` naming
the value and the valid choices. Imports nothing from the package: any layer may use it.

Values appear in storage keys (``RegionName``), configs and command lines: never rename them.
"""

from __future__ import annotations

import enum
from typing import TypeVar

_C = TypeVar("_C", bound="Choice")


class Choice(str, enum.Enum):
    """Base of the choice enums: a ``str`` whose ``str()`` is its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The valid values, in definition order (for argparse ``choices`` and messages)."""
        return tuple(str(m.value) for m in cls)

    @classmethod
    def parse(cls: type[_C], value: object, what: str) -> _C:
        """``value`` (a member or its string) as a member; ``ValueError`` naming ``what``."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what}={value!r}; choose from {cls.values()}") from None


class WritePolicy(Choice):
    """When device copies are backed up to host (docs/DESIGN.md section 7)."""

    WRITE_THROUGH = "write_through"
    """On insert."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """On a node's second hit."""
    WRITE_BACK = "write_back"
    """On eviction from device."""


class PrefetchPolicy(Choice):
    """When an L3 prefetch stops (docs/DESIGN.md section 7)."""

    BEST_EFFORT = "best_effort"
    """Take what arrived when the request is loaded."""
    WAIT_COMPLETE = "wait_complete"
    """Wait for every page."""
    TIMEOUT = "timeout"
    """Wait up to a budget that grows with the prefetch length."""


class StorageKind(Choice):
    """The L3 backend (``NONE``: no L3)."""

    NONE = "none"
    FILE = "file"
    MOONCAKE = "mooncake"

    @classmethod
    def backends(cls) -> tuple[str, ...]:
        """The values that name a real backend (everything but ``none``)."""
        return tuple(v for v in cls.values() if v != cls.NONE.value)


class CpKvMode(Choice):
    """How KV pages are placed over the cp axis (docs/DESIGN.md section 9)."""

    REPLICATE = "replicate"
    """Every cp rank keeps full pages."""
    SHARD = "shard"
    """Each cp rank keeps its tokens of every page."""


class TransferBackend(Choice):
    """The device <-> host transfer engine implementation."""

    AUTO = "auto"
    """``cuda`` when the device pools are on CUDA and cupy works, else ``cpu``."""
    CPU = "cpu"
    CUDA = "cuda"


class RegionName(Choice):
    """Names of the host-pool tensors (docs/DESIGN.md section 4); part of every storage key."""

    KV = "kv"
    KV_WINDOW = "kv_window"
    """The K/V of the sliding-window layers (``StateSpec.windows``), paged like ``kv``."""
    INDEXER = "indexer"
    MAMBA_CONV = "mamba_conv"
    MAMBA_SSM = "mamba_ssm"


class EvictionPolicyKind(Choice):
    """How the radix tree ranks eviction victims (docs/DESIGN.md section 5)."""

    LRU = "lru"
    """Least recently used first."""
    COST = "cost"
    """FLOPs a hit saves per byte, decaying exponentially with age
    (``radix.eviction.DecayCostPolicy``; opt-in, ``lru`` is the default)."""
    ADAPTIVE = "adaptive"
    """``cost`` with its horizon scaled to the victims' mean age, learnt online
    (``radix.adaptive.AdaptiveCostPolicy``; opt-in)."""
    REUSE = "reuse"
    """``adaptive``'s order, the victim inside a queue chosen by an online learnt
    probability of reuse times the value (``radix.reuse.ReusePolicy``; opt-in)."""
