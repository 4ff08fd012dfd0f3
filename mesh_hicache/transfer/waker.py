"""How a transfer engine wakes its worker thread (docs/DESIGN.md section 6).

A submitted operation whose caller is about to wait for it is copied by that caller
(``TransferEngine._help``); waking the worker for it anyway costs more than the copy of a
few MiB on a busy core: the worker is scheduled, contends for the GIL the caller holds,
finds the work taken and goes back to sleep (four context switches and a GIL round trip
per operation). So a submission arms a *deferred* wake-up (``TransferEngine.wake_grace``
seconds later, a Linux ``timerfd``); the worker sleeps in ``poll`` (the GIL released),
and an operation nobody waits for starts at most ``wake_grace`` after its submission.
Immediate wake-ups (close, work a waiting copier left behind) write an ``eventfd``.

Without them (not Linux, no libc), ``CondWaker`` is a ``threading.Condition``: every
wake-up is immediate (the behaviour before).
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = 0o2000000
_TFD_NONBLOCK = 0o4000


class CondWaker:
    """Immediate wake-ups on a condition variable (the portable fallback).

    The worker's ``sleep`` must be called with ``lock`` (the engine's lock) held, like
    ``Condition.wait``; ``wake`` is called with it held too.
    """

    holds_lock = True

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock

    def wake(self, grace: float = 0.0) -> None:
        self._lock.notify()

    def sleep(self) -> None:
        self._lock.wait()

    def close(self) -> None:
        pass


class TimerWaker:
    """Deferred wake-ups on a ``timerfd``, immediate ones on an ``eventfd``.

    ``wake`` is called with the engine's lock held; ``sleep`` without it: it blocks in
    ``poll`` on both descriptors (the GIL released) until one fires. A wake-up may be
    spurious, so the worker re-checks its queue under the lock after each one. A fired
    timer or a written eventfd keeps its count until read, so a wake-up armed between the
    worker's check and its ``poll`` is not lost.

    A deferred wake-up is never cancelled: a submission only arms the timer when it is
    not armed already, so however many operations are submitted and copied by their
    waiters, the worker wakes at most once per ``grace``, finds nothing and sleeps again.
    Costs measured on the project's 2-core VM: arming ~3.5 us at >= 4 ms ahead and
    ~12-25 us at 0.2-1 ms (the timer interrupt is reprogrammed when the deadline comes
    before the next kernel tick), disarming as much again; an eventfd write ~1 us.
    """

    holds_lock = False

    def __init__(self, libc: ctypes.CDLL, tfd: int) -> None:
        self._settime = libc.timerfd_settime
        self._tfd = tfd
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(tfd, select.POLLIN)
        self._poll.register(self._efd, select.POLLIN)
        self._armed = False
        self._due = 0.0  # when the armed timer fires (monotonic seconds)
        self._specs: dict[float, _Itimerspec] = {}

    @classmethod
    def create(cls) -> TimerWaker | None:
        """A waker on a new timerfd, or None where there is none."""
        if not hasattr(os, "eventfd"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            create, settime = libc.timerfd_create, libc.timerfd_settime
        except (OSError, AttributeError):
            return None
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fd = create(_CLOCK_MONOTONIC, _TFD_CLOEXEC | _TFD_NONBLOCK)
        if fd < 0:
            return None
        return cls(libc, fd)

    def wake(self, grace: float = 0.0) -> None:
        """Wake the worker in ``grace`` seconds (at once for 0); an armed wake-up that
        comes no later is kept."""
        if self._tfd < 0:
            return  # closed: a worker started after close() checks its queue first
        if grace <= 0:
            os.eventfd_write(self._efd, 1)
            return
        due = time.monotonic() + grace
        if self._armed and self._due <= due:
            return
        spec = self._specs.get(grace)
        if spec is None:
            ns = int(grace * 1e9)
            spec = self._specs[grace] = _Itimerspec(value=_Timespec(ns // 10**9, ns % 10**9))
        if self._settime(self._tfd, 0, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed, self._due = True, due

    def sleep(self) -> None:
        """Block until a wake-up (the GIL is released meanwhile), then consume it."""
        if self._tfd < 0:
            time.sleep(1e-3)  # closed while a late worker waits for a copier to finish
            return
        self._poll.poll()
        try:
            os.read(self._tfd, 8)
            self._armed = False  # the worker re-checks its queue after this
        except BlockingIOError:
            pass
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both descriptors (idempotent); later wake-ups do nothing."""
        tfd, self._tfd = self._tfd, -1
        if tfd >= 0:
            os.close(tfd)
            os.close(self._efd)

    def __del__(self) -> None:
        self.close()


def make_waker(lock: threading.Condition) -> TimerWaker | CondWaker:
    """A ``TimerWaker`` where the platform has ``timerfd``, else a ``CondWaker``."""
    return TimerWaker.create() or CondWaker(lock)
