"""HiCache: the public facade a serving engine calls (docs/DESIGN.md section 1).

Per request, on every rank of the mesh, in the same order (each call is collective)::

    req = cache.match(tokens)               # tree + L3 lookup, agreed; locks the prefix
    cache.load(req)                         # stop the L3 prefetch, start host -> device
    for layer in model_layers:
        req.wait_layer(layer)               # layer-wise readiness of the load
        ...read req.prefix_pages / req.mamba_slot from cache.device...
    prefix = cache.finish_load(req)         # agreed; 0 if the load failed anywhere
    pages = cache.alloc_pages(req, n)       # device pages for the new tokens (may evict)
    slot = cache.alloc_slot(req)            # a device Mamba slot for a checkpoint
    ...write K/V and states into cache.device...
    cache.insert(req, tokens[:n], pages_for_those_tokens, mamba_slot=slot)
    cache.release(req)                      # also for aborted requests

Requests may overlap (several matched and not yet released); the cache never assumes
one at a time. What a request still owns at ``release`` (pages and slots the tree did
not take) is freed there, so aborted requests leak nothing.

Misuse raises before anything changes: tokens must be ints (not bools, not floats) in
``[0, 2**63)`` (validated once, in bulk, by ``RadixKey``); a call on a released request
or on a request of another cache is a ``ValueError`` (``release`` of an already released
request is a no-op); ``insert`` pages and slot must be the request's own, allocated,
distinct and in range; ``alloc_pages(n < 0)`` is a ``ValueError``. On a mesh every
check reads only replicated state (the arguments, the request, the tree, pool sizes),
so it gives the same answer on every rank: all ranks raise together and none is left
alone in a collective. ``match`` never leaves a lock behind when it raises, and
``check_integrity`` fails on a protection that no open request or backup holds.

Threads: a ``HiCache`` is not thread-safe. Calls from several threads one at a time are
fine (a server's engine thread after its main thread built the cache); a call that
arrives while another thread is inside the cache raises :class:`ConcurrentUse` before
anything changes, naming both calls. Serialize with your own lock if several threads
drive one cache. ``stats()`` and the request's read-only properties may be called from
any thread at any time (a metrics exporter does).

The facade validates and converts what callers pass, and talks to the controller only;
the tiers, the tree and the lock protocol live below it (``mesh_hicache/tiers/``). Tests
that must look further in use :func:`mesh_hicache.testing.internals`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

from mesh_hicache.config import TENANT_SEPARATOR, HiCacheConfig
from mesh_hicache.consensus import CollectiveTimeout, RanksDisagree
from mesh_hicache.controller import (
    CacheFull,
    HiCacheController,
    PrefixHit,
    RequestLease,
    ServedTokens,
)
from mesh_hicache.pools.device import DevicePools
from mesh_hicache.radix import RadixKey
from mesh_hicache.spec import StateSpec
from mesh_hicache.stats import CacheStats
from mesh_hicache.topology import MeshTopology

__all__ = [
    "CacheClosed",
    "CacheFull",
    "CollectiveTimeout",
    "ConcurrentUse",
    "RanksDisagree",
    "CachedRequest",
    "HiCache",
    "PrefixHit",
    "ServedTokens",
    "tenant_namespace",
]


def tenant_namespace(tenant: str, namespace: str = "") -> str:
    """The tree namespace of ``namespace`` under ``tenant`` (the ``RadixKey`` namespace).

    Without a tenant it is ``namespace`` itself (keys and page hashes as before tenants
    existed); with one it is ``SEP + tenant + SEP + namespace`` (``SEP`` = ``"\x1f"``,
    refused in both), so distinct (tenant, namespace) pairs never meet in one tree node,
    page hash or storage key. ``ValueError``/``TypeError`` for a bad value.
    """
    for what, value in (("tenant", tenant), ("namespace", namespace)):
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a str, got {value!r}")
        if TENANT_SEPARATOR in value:
            raise ValueError(f"{what} must not contain {TENANT_SEPARATOR!r}, got {value!r}")
    if not tenant:
        return namespace
    return f"{TENANT_SEPARATOR}{tenant}{TENANT_SEPARATOR}{namespace}"


class CachedRequest:
    """One request's hold on the cache, read-only: ``HiCache`` methods change it."""

    __slots__ = ("_lease",)

    def __init__(self, lease: RequestLease) -> None:
        self._lease = lease

    @property
    def key(self) -> RadixKey:
        """The looked-up tokens and their tree namespace (``tenant_namespace``)."""
        return self._lease.key

    @property
    def hit(self) -> PrefixHit:
        """What ``match`` found per tier (agreed)."""
        return self._lease.hit

    @property
    def prefix_len(self) -> int:
        """Tokens of the prompt served from the cache (final after ``finish_load``)."""
        return self._lease.prefix_len

    @property
    def prefix_pages(self) -> list[int]:
        """Device pages holding tokens ``[0, prefix_len)``, one per page, in order (a copy)."""
        return list(self._lease.prefix_pages)

    @property
    def mamba_slot(self) -> int | None:
        """Device Mamba slot holding the state after ``prefix_len`` tokens (hybrid models)."""
        return self._lease.mamba_slot

    @property
    def served(self) -> ServedTokens:
        """After ``finish_load``: tokens of the prefix served per tier (device, host, storage)."""
        return self._lease.served

    @property
    def held_pages(self) -> list[int]:
        """Device pages of the tree path the request holds locked (its matched prefix, or
        after ``insert`` the inserted one), root first, up to the first node not on device.
        After an insert that found pages already cached these are the tree's pages, not
        the ones the request passed (which were freed). Replicated state: equal on every
        rank."""
        chain = []
        node = self._lease.locked[-1] if self._lease.locked else None
        while node is not None and not node.is_sentinel:
            chain.append(node)
            node = node.parent
        pages: list[int] = []
        for n in reversed(chain):
            if n.device_indices is None:
                break
            pages.extend(n.device_indices)
        return pages

    @property
    def prefetch_done(self) -> bool:
        """No L3 prefetch of this request is still reading on this rank. Rank-local: a
        scheduler agrees it over the mesh before acting on it (``load`` applies the stop
        policy either way)."""
        job = self._lease.prefetch
        return job is None or job.finished.is_set()

    def wait_layer(self, layer_id: int) -> bool:
        """Block until layer ``layer_id``'s part of the load is on device (True if ok)."""
        return self._lease.wait_layer(layer_id)

    def __repr__(self) -> str:
        return (
            f"CachedRequest(tokens={len(self.key)}, hit={self.hit}, "
            f"prefix_len={self.prefix_len}, served={tuple(self.served)})"
        )


def _lease_of(req: CachedRequest) -> RequestLease:
    if not isinstance(req, CachedRequest):
        raise TypeError(f"expected a CachedRequest from HiCache.match, got {type(req).__name__}")
    return req._lease


class ConcurrentUse(RuntimeError):
    """A second thread called into a ``HiCache`` while another was inside it."""


class CacheClosed(RuntimeError):
    """A ``HiCache`` method (other than ``close`` and ``stats``) was called after ``close``."""


class _Entry:
    """Who is inside the cache now: one thread at a time (re-entry by it is allowed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._call = ""

    def enter(self, call: str) -> bool:
        """True when this call entered (False: the owner re-entered); ConcurrentUse when
        another thread is inside."""
        me = threading.get_ident()
        if self._owner == me:
            return False
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUse(
                f"HiCache.{call} was called from thread {me} while thread {self._owner} is "
                f"inside HiCache.{self._call}: a HiCache is not thread-safe; call it from "
                "one thread at a time (serialize with your own lock)"
            )
        self._owner, self._call = me, call
        return True

    def leave(self) -> None:
        self._owner, self._call = None, ""
        self._lock.release()


_LOCAL_CALLS = frozenset({"digest", "check_integrity"})
"""Methods that issue no collective (every other public method is collective)."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _exclusive(
    method: Callable[Concatenate[HiCache, _P], _R],
) -> Callable[Concatenate[HiCache, _P], _R]:
    """Run ``method`` with the cache entered (:class:`ConcurrentUse` for a second thread)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: HiCache, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        entered = self._entry.enter(name)
        try:
            if self._closed and name != "close":
                raise CacheClosed(
                    f"HiCache.{name} called after close(): the cache's threads are stopped "
                    "and its storage is closed; build a new HiCache"
                )
            agree = self._ctl.agree
            with agree.during(name):
                if entered and name not in _LOCAL_CALLS and not self._closed:
                    agree.enter(name)  # every rank is in this call, or all raise naming it
                return method(self, *args, **kwargs)
        finally:
            if entered:
                self._entry.leave()

    return wrapper


class HiCache:
    """A hierarchical prefix cache for one rank of a mesh. Construction is collective.
    Not thread-safe: a second thread calling in while one is inside gets
    :class:`ConcurrentUse` (module docstring)."""

    def __init__(self, topology: MeshTopology, spec: StateSpec, config: HiCacheConfig) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config must be a HiCacheConfig, got {type(config).__name__}")
        if not isinstance(spec, StateSpec):
            raise TypeError(f"spec must be a StateSpec, got {type(spec).__name__}")
        self.config = config
        self.spec = spec
        self._entry = _Entry()
        self._closed = False
        self._ctl = HiCacheController(topology, spec, config)

    def __enter__(self) -> HiCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """``close()`` on the way out. After a ``RanksDisagree``/``CollectiveTimeout`` the
        mesh is out of step and close's agreements would fail again: only this rank's
        threads and storage are stopped then (no collective)."""
        if isinstance(exc, RanksDisagree | CollectiveTimeout) and not self._closed:
            self._closed = True
            self._ctl.close_local()
            return
        self.close()

    @property
    def closed(self) -> bool:
        """True after ``close()``: every other call but ``stats()`` raises ``CacheClosed``."""
        return self._closed

    @property
    def device(self) -> DevicePools:
        """The L1 pools: ``k(layer)``, ``v(layer)``, ``conv(layer)``, ``ssm(layer)``."""
        return self._ctl.device

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # -- per request ------------------------------------------------------------------------

    @_exclusive
    def match(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        tenant: str | None = None,
        leave_one: bool = False,
    ) -> CachedRequest:
        """Look ``tokens`` up in every tier; lock the usable prefix; start an L3 prefetch.

        Collective. The result's ``hit`` is what was found; nothing is on device beyond
        ``hit.device_tokens`` until ``load``/``finish_load``. ``tenant``: the request's
        tenant (None: ``config.tenant``); requests of different tenants share nothing in
        any tier (see ``tenant_namespace``). On a mesh pass the same tenant on every rank.
        Bad tokens (not ints, bools, floats, outside ``[0, 2**63)``) raise before anything
        is held.

        ``leave_one=True``: look up all but the last token, so the prefix is at most
        ``len(tokens) - 1`` and at least one token is left to compute (its logits start
        decoding). A prompt lookup wants it: a whole-page prompt that is fully cached
        would otherwise leave nothing to run the model on. ``req.key`` is then the
        shortened key; ``insert`` still takes the whole prompt. ``ValueError`` for empty
        ``tokens`` with ``leave_one``.
        """
        if leave_one:
            if len(tokens) == 0:
                raise ValueError("match(tokens, leave_one=True) needs at least one token")
            tokens = tokens[:-1]
        ns = tenant_namespace(self.config.tenant if tenant is None else tenant, namespace)
        key = RadixKey(tokens, ns)  # validated once, in bulk (radix/hashing.py)
        return CachedRequest(self._ctl.match(key))

    @_exclusive
    def load(self, req: CachedRequest) -> None:
        """Finish the L3 prefetch (its stop policy) and start host -> device loading.

        Collective. Afterwards ``req.prefix_len``/``prefix_pages``/``mamba_slot`` describe
        the prefix being loaded; use ``req.wait_layer`` and then ``finish_load``.
        ``RuntimeError`` when called twice for one request (the first load's reservation
        would leak).
        """
        self._ctl.load(_lease_of(req))

    @_exclusive
    def finish_load(self, req: CachedRequest) -> int:
        """Wait for the load, agree that it succeeded everywhere, return ``prefix_len``.

        Collective. On failure anywhere the prefix is 0 on every rank (recompute).
        ``RuntimeError`` when called before ``load(req)`` or twice.
        """
        return self._ctl.finish_load(_lease_of(req))

    @_exclusive
    def alloc_pages(self, req: CachedRequest, n: int) -> list[int]:
        """``n`` device pages for ``req`` (evicting unlocked cache as needed). Collective;
        ``CacheFull`` on every rank when even eviction cannot make room. ``n``: an int
        >= 0 (``TypeError``/``ValueError`` otherwise; same answer on every rank)."""
        return self._ctl.alloc_pages(_lease_of(req), n)

    @_exclusive
    def alloc_slot(self, req: CachedRequest) -> int:
        """A device Mamba slot for a checkpoint of ``req``. Collective; may raise CacheFull."""
        return self._ctl.alloc_slot(_lease_of(req))

    @_exclusive
    def insert(
        self,
        req: CachedRequest,
        tokens: Sequence[int],
        pages: Sequence[int],
        mamba_slot: int | None = None,
    ) -> int:
        """Insert ``tokens`` (whole pages; the request's prompt, or prompt plus output).

        ``pages``: the device page of each page of ``tokens`` (prefix pages included);
        ``mamba_slot``: the device slot holding the state after exactly ``len(tokens)``
        tokens. Pages and slot the tree already had are freed if ``req`` owns them.
        Applies the write policy. Returns the pages that were already cached. Collective.

        ``ValueError``/``TypeError`` with the tree and pools unchanged when a page is out
        of range or given twice, when a page the tree would take is not allocated to
        ``req`` (``alloc_pages``) or was inserted already, when a page where the tree
        already holds one is not ``req``'s own, or when ``mamba_slot`` is not allocated to
        ``req`` (``alloc_slot``). Deterministic: the same answer on every rank.
        """
        ps = self.page_size
        if not tokens or len(tokens) % ps:
            raise ValueError(
                f"insert of {len(tokens)} tokens: must be a positive multiple of page_size={ps}"
            )
        if len(pages) != len(tokens) // ps:
            raise ValueError(f"{len(pages)} pages given for {len(tokens) // ps} whole pages")
        key = RadixKey(tokens, req.key.namespace)
        lease = _lease_of(req)
        self._ctl.requests.check_open(lease)  # a released request says so first
        if self.spec.has_mamba and mamba_slot is None and not self._ctl.has_state_at(key):
            raise ValueError(
                f"insert of {len(tokens)} tokens without mamba_slot on a spec with recurrent "
                f"state: a hit needs the state after exactly {len(tokens)} tokens; pass the "
                "alloc_slot() slot that holds it (the prefill split that captures it is "
                "in docs/engine_guide.md), or insert only up to a boundary whose state you hold"
            )
        return self._ctl.insert(lease, key, pages, mamba_slot)

    @_exclusive
    def release(self, req: CachedRequest) -> None:
        """Finish ``req`` (done or aborted): unlock, cancel what is in flight, free what it
        still owns. Collective. Idempotent; ``ValueError`` (nothing changed on either cache)
        for a request of another cache."""
        self._ctl.release(_lease_of(req))

    # -- background work, lifecycle ---------------------------------------------------------

    @_exclusive
    def step(self) -> None:
        """Consume finished backups and storage writes (agreed). Collective."""
        self._ctl.step()

    @_exclusive
    def flush(self) -> None:
        """Wait until every backup and storage write finished on every rank. Collective."""
        self._ctl.flush()

    @_exclusive
    def close(self) -> None:
        """Release open requests, flush, stop every thread the cache started (transfer
        worker, storage readers and writers) and close the storage. Collective;
        idempotent. Afterwards every call but ``stats()`` raises ``CacheClosed``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ctl.close()
        except BaseException:
            self._ctl.close_local()  # the agreements failed: still stop this rank's threads
            raise

    def stats(self) -> CacheStats:
        """A snapshot of this rank's counters (storage degraded flag included); after
        ``close()`` the final counters."""
        return self._ctl.stats_snapshot()

    @_exclusive
    def digest(self) -> str:
        """A hash of the tree and its tier state; equal on every rank (tests compare it)."""
        return self._ctl.digest()

    @_exclusive
    def check_integrity(self) -> None:
        """Tree invariants and exact pool accounting; ``RuntimeError`` on a violation."""
        self._ctl.check_integrity()
