"""Deadlines for a store client's blocking calls (a frozen server must not hang serving).

A client library such as Mooncake's blocks inside its own calls while its server is
stopped but still accepts connections: no error, no return. ``Deadline.run`` runs each
call on a daemon thread and gives up after ``timeout_s``, raising ``StoreTimeout``
(which ``GuardedStorage`` turns into degraded mode and retries later). The call that
overran keeps its thread until the client returns; until then every further call fails
at once instead of queueing behind it, so a frozen store costs one deadline, not one
per call. Daemon threads never hold up the process's exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class StoreTimeout(ConnectionError):
    """A store call did not return within its deadline (or one before it still has not)."""


class Deadline:
    """Bounded calls into one client: ``run(fn, *args)`` returns ``fn(*args)`` or raises
    ``StoreTimeout`` after ``timeout_s``. ``what`` names the store in messages.
    Thread-safe; calls run one at a time per ``Deadline``'s caller lock of the backend."""

    def __init__(self, timeout_s: float, what: str) -> None:
        if not timeout_s > 0:
            raise ValueError(f"{what}: call timeout must be > 0 s, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._what = what
        self._lock = threading.Lock()
        self._overrun: tuple[str, threading.Event] | None = None

    def run(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        with self._lock:
            if self._overrun is not None:
                late, done = self._overrun
                if not done.is_set():
                    raise StoreTimeout(
                        f"{self._what}: call {late} has not returned for more than "
                        f"{self.timeout_s:g} s; skipping {name}"
                    )
                self._overrun = None
        done = threading.Event()
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # handed to the caller below
                box["error"] = err
            finally:
                done.set()

        threading.Thread(target=call, name=f"store-call-{name}", daemon=True).start()
        if not done.wait(self.timeout_s):
            with self._lock:
                self._overrun = (name, done)
            raise StoreTimeout(f"{self._what}: {name} did not return within {self.timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]
