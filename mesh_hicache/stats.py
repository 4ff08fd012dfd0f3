"""CacheStats: the counters a serving engine reads from ``HiCache.stats()``."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from mesh_hicache.choices import PrefetchPolicy

PREFETCH_OUTCOMES = ("completed", "partial", "aborted", "below_threshold")


@dataclass(slots=True)
class CacheStats:
    """Counters of one rank's cache since construction (bytes are this rank's shard).

    Hit tokens are per tier the prefix was served from; a hybrid hit always covers
    every family (KV and Mamba state at the same boundary), so the per-family split of
    tokens equals the per-tier one and is not repeated.
    """

    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.WAIT_COMPLETE
    requests: int = 0
    prompt_tokens: int = 0
    """Tokens looked up (the keys passed to ``match``; the runtime matches one token
    short of each prompt, so that one token is always computed)."""
    hit_tokens_device: int = 0
    """Prompt tokens reused from L1."""
    hit_tokens_host: int = 0
    """Prompt tokens loaded from L2."""
    hit_tokens_storage: int = 0
    """Prompt tokens prefetched from L3 (then loaded through L2)."""
    storage_resharded_tokens: int = 0
    """Of ``hit_tokens_storage``, the tokens assembled from L3 objects written under
    another mesh (reshard on read: KV pages from another layout, or a boundary state the
    prefix needs from one); never more than ``hit_tokens_storage``."""
    raw_kv_hit_tokens: int = 0
    """KV matched before the Mamba rule cut the hit back (shows what states would save)."""
    mamba_hits_device: int = 0
    mamba_hits_host: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_host_to_storage: int = 0
    bytes_storage_to_host: int = 0
    seconds_host_to_device: float = 0.0
    """Wall time of loads (start to agreed completion), for GB/s."""
    evicted_device_pages: int = 0
    evicted_host_pages: int = 0
    evicted_device_slots: int = 0
    evicted_host_slots: int = 0
    backup_failures: int = 0
    backup_skipped_host_full: int = 0
    load_failures: int = 0
    storage_put_objects: int = 0
    storage_put_dropped: int = 0
    storage_get_misses: int = 0
    storage_errors: int = 0
    storage_write_errors: int = 0
    """Batched L3 writes that failed with an error (in the backend, counted by the guard,
    or on the write thread itself); their objects are not stored."""
    storage_degraded: bool = False
    prefetch_skipped_host_full: int = 0
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREFETCH_OUTCOMES, 0))
    """Prefetch outcomes under ``prefetch_policy``."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_prefetch(self, policy: str, outcome: str) -> None:
        assert outcome in PREFETCH_OUTCOMES and policy == self.prefetch_policy
        with self.lock:
            self.prefetch[outcome] += 1

    # The record_* methods are the only writers of the counters; each takes ``lock``, so
    # the storage threads and the scheduler may record concurrently with a snapshot.

    def record_request(
        self,
        prompt_tokens: int,
        served: tuple[int, int, int],
        raw_kv_tokens: int,
        mamba_hit: str | None,
    ) -> None:
        """One finished lookup: ``served`` = prompt tokens reused from (device, host,
        storage); ``mamba_hit`` = the tier the state came from (``"device"``/``"host"``),
        None when no state was reused."""
        assert mamba_hit in (None, "device", "host")
        device, host, storage = served
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.hit_tokens_device += device
            self.hit_tokens_host += host
            self.hit_tokens_storage += storage
            self.raw_kv_hit_tokens += raw_kv_tokens
            if mamba_hit == "host":
                self.mamba_hits_host += 1
            elif mamba_hit == "device":
                self.mamba_hits_device += 1

    def record_eviction(
        self, device_pages: int, host_pages: int, device_slots: int, host_slots: int
    ) -> None:
        """Pages and Mamba slots freed by eviction, per tier."""
        with self.lock:
            self.evicted_device_pages += device_pages
            self.evicted_host_pages += host_pages
            self.evicted_device_slots += device_slots
            self.evicted_host_slots += host_slots

    def record_backup(self, ok: bool, num_bytes: int) -> None:
        """One device -> host copy acknowledged on every rank (``ok``) or failed somewhere."""
        with self.lock:
            if ok:
                self.bytes_device_to_host += num_bytes
            else:
                self.backup_failures += 1

    def record_skip(self, what: str) -> None:
        """A backup (``"backup"``) or prefetch (``"prefetch"``) skipped: host tier full."""
        assert what in ("backup", "prefetch")
        with self.lock:
            if what == "backup":
                self.backup_skipped_host_full += 1
            else:
                self.prefetch_skipped_host_full += 1

    def record_load(self, ok: bool, num_bytes: int, seconds: float) -> None:
        """One host -> device load: its bytes and wall time, or a failure."""
        with self.lock:
            if ok:
                self.bytes_host_to_device += num_bytes
                self.seconds_host_to_device += seconds
            else:
                self.load_failures += 1

    def record_put(self, objects: int, dropped: int, num_bytes: int) -> None:
        """One batched L3 write: objects stored, objects the backend dropped, bytes stored."""
        with self.lock:
            self.storage_put_objects += objects
            self.storage_put_dropped += dropped
            self.bytes_host_to_storage += num_bytes

    def record_write_error(self) -> None:
        """One batched L3 write that raised on the write thread."""
        with self.lock:
            self.storage_write_errors += 1

    def record_reshard(self, tokens: int) -> None:
        """Tokens served from storage to one request that were assembled from another
        mesh's objects."""
        with self.lock:
            self.storage_resharded_tokens += tokens

    def record_get(self, misses: int, num_bytes: int) -> None:
        """One batched L3 read: objects that missed, bytes that arrived."""
        with self.lock:
            self.storage_get_misses += misses
            self.bytes_storage_to_host += num_bytes

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_storage

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_gbps(self) -> float:
        """Host -> device GB/s over the measured loads (0 when none)."""
        s = self.seconds_host_to_device
        return self.bytes_host_to_device / s / 1e9 if s > 0 else 0.0

    def snapshot(self) -> CacheStats:
        """A copy safe to read while the cache keeps working."""
        with self.lock:
            copy = dataclasses.replace(self, prefetch=dict(self.prefetch), lock=threading.Lock())
        return copy

    def as_dict(self) -> dict[str, object]:
        """Plain counters (and derived rates) for JSON and exporters."""
        snap = self.snapshot()
        out = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap) if f.name != "lock"}
        out.update(hit_tokens=snap.hit_tokens, hit_rate=snap.hit_rate, load_gbps=snap.load_gbps)
        return out
