"""Two checkpoints with one config and equal file sizes, other weights, one Mooncake store.

The twins of ``tests/unit/test_identity.py`` (same ``config.json`` bytes, same file sizes,
both in a folder named ``granite_moe``) served by ``runtime.serve`` against one store: the
second model takes no token from the first one's objects, its last-prompt logits equal
its own cache-off run within the cached == recompute bar (1e-4), and once it wrote its
own objects it reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.mooncake import runtime_bodies
from tests.mooncake.services import MooncakeServices, NetnsWorker

pytest.importorskip("transformers", reason="needs transformers (test extra)")

ATOL = 1e-4
WORKLOAD = [
    "--sessions", "2", "--turns", "2", "--first-prompt-len", "64", "--append-len", "16",
    "--prefetch-threshold", "16", "--max-new-tokens", "2", "--seed", "41", "--quiet",
    "--dump-logits",
]  # fmt: skip


def _storage_tokens(run: dict[str, Any]) -> list[int]:
    return [r["cached"]["storage"] for r in run["requests"]]


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    import torch

    return max(
        float((torch.tensor(x["last_logits"]) - torch.tensor(y["last_logits"])).abs().max())
        for x, y in zip(a["requests"], b["requests"], strict=True)
    )


def test_twin_checkpoints_never_share_mooncake_objects(
    mooncake_services: MooncakeServices, tmp_path: Path
) -> None:
    from tests.checkpoint_cases import build

    one = build("granite_moe", tmp_path / "one", seed=0)
    two = build("granite_moe", tmp_path / "two", seed=1)
    assert (one / "config.json").read_bytes() == (two / "config.json").read_bytes()
    store = ["--storage", "mooncake", "--mooncake-master", mooncake_services.master_address]
    full = ["--cache", "full", *store, *WORKLOAD]
    w = NetnsWorker(mooncake_services, timeout=300)
    runs = {}
    try:
        for label, model, argv in (
            ("one", one, full),
            ("two_alone", two, ["--cache", "off", *WORKLOAD]),
            ("two", two, full),
        ):
            path = str(tmp_path / f"{label}.json")
            runs[label] = w.call(runtime_bodies.serve_cli, ["--model", str(model), *argv], path)
        # Fresh processes (cold L1/L2): each model now reads its own objects.
        for label, model in (("one_again", one), ("two_again", two)):
            path = str(tmp_path / f"{label}.json")
            runs[label] = w.call(runtime_bodies.serve_cli, ["--model", str(model), *full], path)
    finally:
        w.close()
    assert _storage_tokens(runs["one_again"])[0] > 0  # the first model's objects are there
    assert sum(_storage_tokens(runs["two"])) == 0  # ... and never served to the second
    assert _max_diff(runs["two"], runs["two_alone"]) < ATOL
    assert _storage_tokens(runs["two_again"])[0] > 0
    assert _max_diff(runs["two_again"], runs["two_alone"]) < ATOL
