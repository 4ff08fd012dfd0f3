"""Workloads are deterministic and shaped as documented; HiCacheConfig rejects bad knobs."""

from __future__ import annotations

import pytest

from mesh_hicache.config import HiCacheConfig
from runtime.workloads.generate import make_workload


def test_multiturn_is_deterministic_and_interleaved():
    a = make_workload("multiturn", sessions=3, turns=2, vocab=100, seed=7)
    b = make_workload("multiturn", sessions=3, turns=2, vocab=100, seed=7)
    c = make_workload("multiturn", sessions=3, turns=2, vocab=100, seed=8)
    assert a == b and a != c
    assert [(t.session, t.turn) for t in a] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert all(len(t.user_tokens) == 512 for t in a[:3]) and len(a[3].user_tokens) == 64
    assert a[0].user_tokens[:32] == a[1].user_tokens[:32]  # shared instruction
    assert [t.request_id for t in a] == list(range(6))


def test_shared_prefix_and_agent():
    shared = make_workload("shared-prefix", sessions=2, turns=2, vocab=50, first_prompt_len=64)
    assert len(shared) == 4 and all(
        t.user_tokens[:64] == shared[0].user_tokens[:64] for t in shared
    )
    assert len({t.user_tokens for t in shared}) == 4
    agent = make_workload(
        "agent", sessions=1, turns=5, vocab=50, first_prompt_len=64, append_len=16
    )
    assert len(agent[0].user_tokens) == 128 and all(len(t.user_tokens) == 4 for t in agent[1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="chat"), "unknown workload"),
        (dict(sessions=0), "sessions"),
        (dict(first_prompt_len=10), "first_prompt_len"),
    ],
)
def test_workload_errors(kwargs, message):
    args = dict(name="multiturn", sessions=1, turns=1, vocab=10) | kwargs
    with pytest.raises(ValueError, match=message):
        make_workload(args.pop("name"), **args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device_pages=0), "device_pages"),
        (dict(write_policy="lazy"), "write_policy"),
        (dict(storage="s3"), "storage"),
        (dict(storage="file", enable_host=False), "needs the host tier"),
        (dict(cp_kv="stripe"), "cp_kv"),
        (dict(prefetch_policy="never"), "prefetch_policy"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(**(dict(device_pages=8) | kwargs))


def test_config_defaults():
    cfg = HiCacheConfig(device_pages=64)
    assert cfg.num_host_pages() == 256 and cfg.mamba_device_slots() == 16
    assert cfg.mamba_host_slots() == 64
