"""Fixtures: loopback-only Mooncake services and workers inside their network namespace.

Every test here needs the Mooncake package and a private network namespace (root);
without them the tests skip, naming what is missing (see ``services.unavailable_reason``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mooncake.services import (
    NO_EVICTION,
    MooncakeServices,
    NetnsWorker,
    unavailable_reason,
)

_REASON: list[str | None] = []


def _skip_unless_available() -> None:
    if not _REASON:
        _REASON.append(unavailable_reason())
    if _REASON[0] is not None:
        pytest.skip(_REASON[0])


@pytest.fixture
def mooncake_available() -> None:
    """Skips unless the services could run here (for tests that start their own)."""
    _skip_unless_available()


@pytest.fixture(scope="session")
def mooncake_services() -> Iterator[MooncakeServices]:
    """A master + one 64 MiB client shared by the tests that do not break them."""
    _skip_unless_available()
    services = MooncakeServices(segment_bytes=64 << 20).start()
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="session")
def worker(mooncake_services: MooncakeServices) -> Iterator[NetnsWorker]:
    """One process in the services' namespace with an open MooncakeStorage."""
    from tests.mooncake import bodies

    w = NetnsWorker(mooncake_services, timeout=60)
    try:
        w.call(bodies.open_storage, mooncake_services.master_address)
        yield w
    finally:
        w.close()


@pytest.fixture
def private_services() -> Iterator[MooncakeServices]:
    """Services of one test (16 MiB store, the smallest a client takes): to fill or kill.

    Eviction is off, so a filled store stays full (see ``NO_EVICTION``).
    """
    _skip_unless_available()
    services = MooncakeServices(segment_bytes=16 << 20, master_flags=NO_EVICTION).start()
    try:
        yield services
    finally:
        services.stop()
