"""Fixtures of the transfer-engine tests (test_transfer*.py; helpers in transfer_support.py)."""

from __future__ import annotations

import pytest

from mesh_hicache.transfer import CpuTransferEngine, TransferHandle


@pytest.fixture
def queued(monkeypatch) -> None:
    """Every operation goes through the queue (none is copied inline by its submitter):
    for tests about the worker, waiters and close with small operations."""
    monkeypatch.setattr(CpuTransferEngine, "inline_bytes", 0)


@pytest.fixture
def finished(monkeypatch) -> list[tuple[int, bool, str | None]]:
    """Every completion of every handle, in completion order: (op id, ok, error)."""
    log: list[tuple[int, bool, str | None]] = []
    original = TransferHandle._finish

    def record(self, ok, error):
        log.append((self.op_id, ok, error))
        return original(self, ok, error)

    monkeypatch.setattr(TransferHandle, "_finish", record)
    return log
