"""An operation's index pairs: converted once, checked, packed into one block.

A pair ``(device indices, host indices)`` of lists/tuples of ints goes into one
``array('q')`` (device indices, then host indices) whose address the native copy loop
reads; numpy views of it serve the other paths. Anything else (numpy arrays, torch
tensors) is converted by numpy into one block the same way.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch

from mesh_hicache.transfer.segments import IndexArray

IndexList = Sequence[int] | torch.Tensor | np.ndarray
IndexPair = tuple[IndexList, IndexList]

#: No indices (read-only): the arrays of an empty pair.
NO_INDICES: IndexArray = np.zeros(0, dtype=np.int64)
NO_INDICES.flags.writeable = False
#: Up to this many indices, bounds are checked on the Python ints (two C loops over a short
#: list cost less than two numpy reductions).
_SHORT = 32
_SEQ = (list, tuple)


def _index_array(values: IndexList) -> IndexArray:
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu").numpy()
    elif not len(values):
        return NO_INDICES
    return np.array(values, dtype=np.int64, copy=True).reshape(-1)


def _index_block(pair: IndexPair) -> tuple[IndexArray, IndexArray, int] | None:
    """(device, host, address) of two equal-length lists/tuples of ints packed into one
    ``array('q')`` (device indices, then host indices; the views keep it alive), or None
    for anything else (the numpy path then converts and names the problem)."""
    d, h = pair
    if type(d) not in _SEQ or type(h) not in _SEQ or len(d) != len(h):
        return None
    try:
        block = array("q", d)
        block.extend(h)
    except (TypeError, OverflowError):
        return None
    n = len(d)
    view = np.frombuffer(block, dtype=np.int64)
    return view[:n], view[n:], block.buffer_info()[0]


def check_indices(
    what: str, pair: IndexPair, dev_count: int, host_count: int
) -> tuple[IndexArray, IndexArray, int]:
    """(device, host, address of the block holding both) of an operation's index pair,
    checked against the pools' sizes: ``ValueError`` naming the bad value otherwise."""
    if len(pair) != 2:
        raise ValueError(f"{what} must be a pair (device indices, host indices)")
    d0, h0 = pair
    if type(d0) in _SEQ and type(h0) in _SEQ and not d0 and not h0:  # nothing (default)
        return NO_INDICES, NO_INDICES, 0
    packed = _index_block(pair)
    if packed is not None:
        d, h, addr = packed
    else:
        d, h = _index_array(pair[0]), _index_array(pair[1])
        addr = 0
    n = d.shape[0]
    if n != h.shape[0]:
        raise ValueError(f"{what}: {n} device vs {h.shape[0]} host indices")
    if not n:
        return d, h, 0
    if packed is None:  # one block: device then host indices
        block = np.concatenate((d, h))
        d, h, addr = block[:n], block[n:], block.ctypes.data
    for name, idx, count, given in (
        ("device", d, dev_count, pair[0]),
        ("host", h, host_count, pair[1]),
    ):
        if packed is not None:  # the caller's list of ints
            lo, hi = min(given), max(given)  # type: ignore[type-var]
        elif n <= _SHORT:
            ints = idx.tolist()
            lo, hi = min(ints), max(ints)
        else:
            lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= count:
            raise ValueError(f"{what}: {name} index out of range [0, {count}): {idx.tolist()}")
    return d, h, addr
