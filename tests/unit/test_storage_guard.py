"""GuardedStorage degraded mode and the storage factory."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from mesh_hicache.layout import GlobalSlice
from mesh_hicache.storage import (
    FileStorage,
    GuardedStorage,
    KeyNamespace,
    StorageBackend,
    StorageKey,
    make_storage,
    open_storage,
)

NS = KeyNamespace("m", "float32", 0)


def key(i: int) -> StorageKey:
    return StorageKey(NS, "kv", bytes([i + 1]), GlobalSlice((0, 1), (0, 1), (0, 4)))


class Flaky(StorageBackend):
    """An in-memory backend that raises ``error`` (ConnectionError) while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.error: Exception = ConnectionError("store unreachable")
        self.calls = 0
        self.objects: dict[str, bytes] = {}
        self.buffers: list[torch.Tensor] = []

    def _hit(self) -> None:
        self.calls += 1
        if self.down:
            raise self.error

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self._hit()
        self.buffers.append(buffer)

    def exists(self, keys: Sequence[StorageKey]) -> int:
        self._hit()
        n = 0
        while n < len(keys) and keys[n].to_str() in self.objects:
            n += 1
        return n

    def get(self, keys: Sequence[StorageKey], dst: Sequence[torch.Tensor]) -> list[bool]:
        self._hit()
        out = []
        for k, d in zip(keys, dst, strict=True):
            data = self.objects.get(k.to_str())
            if data is not None:
                d.view(-1).view(torch.uint8).copy_(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8)
                )
            out.append(data is not None)
        return out

    def put(self, keys: Sequence[StorageKey], src: Sequence[torch.Tensor]) -> list[bool]:
        self._hit()
        for k, s in zip(keys, src, strict=True):
            self.objects[k.to_str()] = s.numpy().tobytes()
        return [True] * len(keys)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_failing_backend_degrades_to_misses_with_one_warning(caplog):
    inner, clock = Flaky(), Clock()
    guard = GuardedStorage(inner, retry_interval_s=10.0, clock=clock)
    x = torch.ones(4)
    with caplog.at_level(logging.INFO, logger="mesh_hicache"):
        assert guard.put([key(0), key(1)], [x, x]) == [False, False]
        assert guard.degraded
        for _ in range(5):
            assert guard.exists([key(0)]) == 0
            assert guard.get([key(0)], [x]) == [False]
            assert guard.put_one(key(0), x) is False
        clock.t = 11.0  # a retry is due: it fails again, silently
        assert guard.get_one(key(0), x) is False
        assert guard.exists([key(0)]) == 0  # and the next call is skipped again
    assert len(warnings_in(caplog)) == 1
    assert inner.calls == 2  # the first failure and the one retry; the rest skipped
    st = guard.stats
    assert st.errors == 2 and st.skipped == 16
    assert st.gets == st.get_misses == 6 and st.get_hits == 0


def test_recovery_after_retry_interval(caplog):
    inner, clock = Flaky(), Clock()
    guard = GuardedStorage(inner, retry_interval_s=5.0, clock=clock)
    x = torch.arange(4, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="mesh_hicache"):
        assert guard.put_one(key(0), x) is False
        inner.down = False
        clock.t = 4.0
        assert guard.put_one(key(0), x) is False and guard.degraded  # not yet
        clock.t = 5.5
        assert guard.put_one(key(0), x) is True and not guard.degraded
        y = torch.zeros(4)
        assert guard.get_one(key(0), y) and torch.equal(x, y)
        assert guard.exists([key(0), key(1)]) == 1
    infos = [r for r in caplog.records if r.levelno == logging.INFO and "back" in r.getMessage()]
    assert len(infos) == 1 and len(warnings_in(caplog)) == 1
    # A second outage of another kind warns again (once); one of a kind already
    # reported is only counted (a store failing the same way does not log every retry).
    inner.down = True
    inner.error = TimeoutError("store timed out")
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert guard.exists([key(0)]) == 0
    assert len(warnings_in(caplog)) == 2 and guard.degraded
    inner.down, clock.t = False, 20.0
    assert guard.exists([key(0)]) == 1 and not guard.degraded
    inner.down, inner.error = True, ConnectionError("store unreachable")
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert guard.exists([key(0)]) == 0 and guard.degraded
    assert len(warnings_in(caplog)) == 2
    assert guard.stats.errors_by_kind == {"ConnectionError": 2, "TimeoutError": 1}


def test_buffers_are_registered_when_the_backend_comes_back():
    inner, clock = Flaky(), Clock()
    guard = GuardedStorage(inner, retry_interval_s=1.0, clock=clock)
    buf = torch.zeros(64)
    guard.register_buffer(buf)  # fails: degraded, buffer remembered
    assert guard.degraded and inner.buffers == []
    inner.down = False
    clock.t = 2.0
    assert guard.exists([key(0)]) == 0 and not guard.degraded
    assert len(inner.buffers) == 1 and inner.buffers[0] is buf


def test_lazy_connect_failure_degrades(caplog):
    attempts = []

    def connect() -> StorageBackend:
        attempts.append(1)
        raise ConnectionRefusedError("no master")

    clock = Clock()
    guard = GuardedStorage(connect=connect, retry_interval_s=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert guard.exists([key(0)]) == 0 and guard.degraded
        assert guard.get_one(key(0), torch.zeros(4)) is False
    assert len(attempts) == 1 and len(warnings_in(caplog)) == 1


def test_caller_errors_are_not_outages():
    inner = Flaky()
    inner.down = False
    guard = GuardedStorage(inner)
    with pytest.raises(ValueError):
        guard.put([key(0)], [])
    assert not guard.degraded


def test_guarded_file_storage_round_trip(tmp_path):
    guard = open_storage("file", root=str(tmp_path / "l3"), max_bytes=1 << 20)
    x = torch.randn(8)
    assert guard.put_one(key(0), x)
    y = torch.empty(8)
    assert guard.get_one(key(0), y) and torch.equal(x, y)
    assert isinstance(guard.backend, FileStorage) and not guard.degraded
    assert guard.stats.puts == 1 and guard.stats.get_hits == 1
    guard.close()


def test_factory():
    with pytest.raises(ValueError, match="file"):
        make_storage("s3")
    with pytest.raises(ValueError, match="mooncake"):
        open_storage("nfs")


def test_make_file_storage(tmp_path):
    store = make_storage("file", root=tmp_path / "l3", max_bytes=1024)
    assert isinstance(store, FileStorage) and store.root == (tmp_path / "l3").resolve()


class Broken(StorageBackend):
    """A backend whose calls raise ``error`` (any exception type: a confused backend)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def exists(self, keys):
        raise self.error

    def get(self, keys, dst):
        raise self.error

    def put(self, keys, src):
        raise self.error


class Garbage(Flaky):
    """Answers with the wrong number of flags."""

    def get(self, keys, dst):
        return [True]

    def put(self, keys, src):
        return None  # type: ignore[return-value]


ANY_ERRORS = [
    ValueError("path check failed"),
    TypeError("bad type inside the backend"),
    KeyError("k"),
    AssertionError("invariant"),
    RuntimeError("closed"),
    ZeroDivisionError("division by zero"),
    OSError(5, "I/O error"),
    MemoryError(),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte"),
]


@pytest.mark.parametrize("error", ANY_ERRORS, ids=lambda e: type(e).__name__)
def test_any_backend_exception_is_a_counted_miss(error, caplog):
    clock = Clock()
    guard = GuardedStorage(Broken(error), retry_interval_s=1.0, clock=clock)
    x = torch.ones(4)
    with caplog.at_level(logging.WARNING, logger="mesh_hicache"):
        assert guard.put([key(0), key(1)], [x, x]) == [False, False]
        for _ in range(3):
            clock.t += 2.0  # each call is a real retry that fails again
            assert guard.get([key(0)], [x]) == [False]
            clock.t += 2.0
            assert guard.exists([key(0)]) == 0
            clock.t += 2.0
            assert guard.put_one(key(0), x) is False
    kind = type(error).__name__
    st = guard.stats
    assert st.errors == 10 and st.errors_by_kind == {kind: 10} and st.write_errors == 4
    assert len(warnings_in(caplog)) == 1 and kind in warnings_in(caplog)[0]
    assert "write" in warnings_in(caplog)[0]  # the first failure was a write: backups lost


def test_wrong_answers_are_misses():
    inner = Garbage()
    inner.down = False
    guard = GuardedStorage(inner)
    x = torch.ones(4)
    assert guard.get([key(0), key(1)], [x, x]) == [False, False]
    assert guard.stats.errors == 1 and guard.degraded


def test_caller_bugs_are_raised_before_the_backend_is_called():
    inner = Flaky()
    inner.down = False
    guard = GuardedStorage(inner)
    with pytest.raises(TypeError):
        guard.get(["v1/not-a-key"], [torch.ones(4)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        guard.put([key(0)], [torch.ones(4, 4).t()])
    with pytest.raises(TypeError):
        guard.exists([b"x"])  # type: ignore[list-item]
    assert inner.calls == 0 and not guard.degraded and guard.stats.errors == 0
