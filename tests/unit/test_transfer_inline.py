"""Transfer engine hand-off: small operations copied by their submitter or a waiter,
published at once, waiting their turn behind queued work, deferred wake-ups."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mesh_hicache.transfer import (
    TransferKind,
)
from mesh_hicache.transfer import cpu as cpu_module
from tests.unit.transfer_support import (
    LAYERS,
    host_views,
    make,
    on_worker,
    randomize,
    same_bits,
    snapshot,
    tensors,
)


def test_a_waiter_copies_itself_when_the_worker_is_not_scheduled(queued):
    gen = torch.Generator().manual_seed(3)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    stalled = threading.Event()
    # A worker that never gets a core: everything must still complete on the waiters.
    eng._worker = threading.Thread(target=stalled.wait, name="stalled", daemon=True)
    threads = set()
    original = eng._layer_ready

    def observe(op, position):
        threads.add(threading.current_thread().name)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    backup = eng.backup(([2, 5, 6], [9, 0, 1]), ([1], [4]))
    load = eng.load(([0, 1, 11], [9, 0, 1]), ([3], [4]))
    assert load.wait_layer(LAYERS[2], timeout=30)  # runs the backup, then load up to layer 2
    assert backup.done and backup.ok and not load.done
    assert load.wait(timeout=30) and load.ack is not None and load.ack.ok
    assert threads == {threading.current_thread().name}
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[3], before[(name, layer)][1])
        else:
            assert same_bits(t[[0, 1, 11]], before[(name, layer)][[2, 5, 6]])
    stalled.set()
    eng.close()


@pytest.mark.parametrize("single_pass_bytes", [0, 1 << 30], ids=["layer-wise", "one-pass"])
def test_small_loads_are_published_at_once(monkeypatch, single_pass_bytes):
    monkeypatch.setattr(cpu_module, "SINGLE_PASS_BYTES", single_pass_bytes)
    gen = torch.Generator().manual_seed(4)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    assert eng.backup(([1, 2, 3], [4, 5, 6]), ([0], [1])).wait()
    published = []
    original = eng._layer_ready

    def observe(op, position):
        published.append(position)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    h = eng.load(([7, 8, 9], [4, 5, 6]), ([2], [1]))
    assert h.wait() and all(h.wait_layer(layer) for layer in LAYERS)
    assert published == ([len(LAYERS) - 1] if single_pass_bytes else list(range(len(LAYERS))))
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[2], before[(name, layer)][0])
        else:
            assert same_bits(t[[7, 8, 9]], before[(name, layer)][[1, 2, 3]])
    eng.close()


def test_small_load_on_an_idle_engine_is_copied_by_its_submitter(finished, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    dev, host, eng = make()
    randomize(dev, gen)
    before = snapshot(dev)
    threads: list[str] = []
    original = eng._layer_ready

    def observe(op, position):
        threads.append((op.handle.kind, threading.current_thread().name))
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    # A backup, however small, goes to the worker (started by it): its caller goes on.
    assert not eng._worker_started
    assert eng.backup(([2, 5, 6], [9, 0, 1]), ([1], [4])).wait()
    assert eng._worker_started
    for t in tensors(dev).values():
        t.zero_()
    threads.clear()
    # An idle engine, a small load: copied before load() returns, on this thread.
    h = eng.load(([0, 1, 11], [9, 0, 1]), ([3], [4]))
    assert h.done and h.ok
    assert set(threads) == {(TransferKind.LOAD, threading.current_thread().name)}
    for (name, layer), t in tensors(dev).items():
        if name in ("conv", "ssm"):
            assert same_bits(t[3], before[(name, layer)][1])
        else:
            assert same_bits(t[[0, 1, 11]], before[(name, layer)][[2, 5, 6]])
    # An injected failure acks at once too, and the engine goes on.
    eng.fail_next()
    bad = eng.load(([0], [0]))
    assert bad.done and not bad.ok and "InjectedFailure" in (bad.error or "")
    # Larger than inline_bytes: through the queue, same results.
    monkeypatch.setattr(eng, "inline_bytes", 1)
    threads.clear()
    big = eng.load(([4, 7], [9, 0]))
    assert big.wait() and threads
    for (name, layer), t in tensors(dev).items():
        if name not in ("conv", "ssm"):
            assert same_bits(t[[4, 7]], before[(name, layer)][[2, 5]])
    eng.close()
    assert [op for op, _, _ in finished] == [0, 1, 2, 3]


def test_small_load_behind_queued_work_waits_its_turn(finished):
    dev, host, eng = make()
    gate, reached = threading.Event(), threading.Event()
    original = eng._layer_ready

    def hold(op, position):
        original(op, position)
        if op.handle.op_id == 0 and on_worker():
            reached.set()
            gate.wait(timeout=30)

    eng._layer_ready = hold  # type: ignore[method-assign]
    first = eng.backup(([0, 1], [0, 1]))  # to the worker, held there
    assert reached.wait(timeout=30)
    second = eng.load(([2], [2]))  # small, but the engine is busy: queued behind op 0
    assert not second.done and not first.done
    gate.set()
    assert second.wait(timeout=30) and first.done
    eng.close()
    assert [op for op, _, _ in finished] == [0, 1]  # submission order


@pytest.mark.parametrize("waker", ["timer", "condition"])
def test_deferred_wake_a_waiter_copies_and_an_unwaited_backup_still_runs(monkeypatch, waker):
    from mesh_hicache.transfer import engine as engine_module
    from mesh_hicache.transfer.waker import CondWaker, TimerWaker

    kind = CondWaker if waker == "condition" else TimerWaker
    if waker == "condition":
        monkeypatch.setattr(engine_module, "make_waker", CondWaker)
    elif TimerWaker.create() is None:
        pytest.skip("no timerfd/eventfd on this platform")
    wakes = []  # the worker's returns from sleep
    sleep = kind.sleep

    def counted(self) -> None:
        sleep(self)
        wakes.append(1)

    monkeypatch.setattr(kind, "sleep", counted)
    gen = torch.Generator().manual_seed(5)
    dev, host, eng = make()
    assert eng._waker is None  # no descriptors before the worker starts
    randomize(dev, gen)
    before = snapshot(dev)
    threads: list[str] = []
    original = eng._layer_ready

    def observe(op, position):
        threads.append(threading.current_thread().name)
        original(op, position)

    eng._layer_ready = observe  # type: ignore[method-assign]
    # A long grace: the waiter claims each backup long before the worker would wake.
    monkeypatch.setattr(eng, "wake_grace", 30.0)
    assert eng.backup(([0], [5])).wait(timeout=30)  # starts the worker (either may copy)
    assert isinstance(eng._waker, kind)
    time.sleep(0.05)
    threads.clear()
    wakes.clear()
    batches = eng.num_batches
    first = eng.backup(([2, 5], [9, 0]))
    assert first.wait(timeout=30)
    assert threads == [threading.current_thread().name] and eng.num_batches == batches
    if waker == "timer":
        time.sleep(0.05)
        assert not wakes  # the worker never woke for it
    # A short grace: a backup nobody waits for completes on the worker by itself.
    monkeypatch.setattr(eng, "wake_grace", 0.002)
    threads.clear()
    second = eng.backup(([6], [1]))
    deadline = time.monotonic() + 30
    while not second.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert second.ok and threads and all(t.startswith("transfer-") for t in threads)
    for (name, layer), t in host_views(host).items():
        if name not in ("conv", "ssm"):
            assert same_bits(t[[9, 0, 1]], before[(name, layer)][[2, 5, 6]])
    eng.close()
    assert not eng._worker.is_alive()
