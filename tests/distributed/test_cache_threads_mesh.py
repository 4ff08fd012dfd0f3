"""The thread contract of ``HiCache`` on a two-rank mesh: while the owner thread is inside
a (collective) call, every call from other threads is refused with ``ConcurrentUse`` on
both ranks, before anything changes and without a collective (so the peer rank is never
left waiting in one); afterwards the owner finishes its call on both ranks and the cache
stays usable and consistent (``check_integrity()``, equal ``digest()`` on both ranks).
The one-rank version and the wording of the contract: tests/unit/test_cache_threads.py."""

from __future__ import annotations

import threading
from typing import Any

from mesh_hicache import ConcurrentUse, HiCache
from mesh_hicache.testing import internals
from mesh_hicache.topology import MeshTopology
from tests.distributed.harness import run_on_mesh
from tests.unit.cache_support import PS, make_config, make_spec, serve

HAMMERS, ROUNDS = 4, 40


def _hammer_body(mesh: Any, root: str) -> dict[str, Any]:
    cache = HiCache(MeshTopology.from_mesh(mesh), make_spec(), make_config(root))
    tokens = list(range(3 * PS))
    cold = serve(cache, tokens).prefix
    open_req = cache.match(tokens + [7] * PS)  # an open request the hammers aim at too
    inside, leave = threading.Event(), threading.Event()
    real_step = cache._ctl.step

    def slow_step() -> None:  # the owner is inside step(), past its entry agreement
        inside.set()
        assert leave.wait(60)
        real_step()

    cache._ctl.step = slow_step  # type: ignore[method-assign]
    owner = threading.Thread(target=cache.step)
    owner.start()
    assert inside.wait(60)
    calls = [
        lambda: cache.match(tokens),
        lambda: cache.match(tokens, leave_one=True),
        lambda: cache.load(open_req),
        lambda: cache.alloc_pages(open_req, 1),
        lambda: cache.alloc_slot(open_req),
        lambda: cache.insert(open_req, tokens[:PS], [0]),
        lambda: cache.release(open_req),
        cache.step,
        cache.flush,
        cache.digest,
        cache.check_integrity,
        cache.close,
    ]
    refused, other, snapshots = [0] * HAMMERS, [[] for _ in range(HAMMERS)], [0] * HAMMERS
    start = threading.Barrier(HAMMERS)

    def hammer(t: int) -> None:
        start.wait(60)
        for i in range(ROUNDS):
            try:
                calls[(i + t) % len(calls)]()
                other[t].append("returned")
            except ConcurrentUse as e:
                if "HiCache.step" in str(e):
                    refused[t] += 1
                else:
                    other[t].append(str(e))
            except BaseException as e:  # anything else breaks the contract
                other[t].append(repr(e))
            if cache.stats().requests >= 1:  # a snapshot is fine from any thread
                snapshots[t] += 1

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(HAMMERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    hung = sum(th.is_alive() for th in threads)
    num_open = internals(cache).num_open  # the open request only: no refused match held
    leave.set()
    owner.join(60)
    del cache._ctl.step
    # The owner's step finished on both ranks; the cache works on, in step on both ranks.
    cache.release(open_req)
    cache.check_integrity()
    warm = serve(cache, tokens).prefix
    cache.step()
    cache.check_integrity()
    digest = cache.digest()
    cache.close()
    return {
        "refused": sum(refused),
        "other": [x for errs in other for x in errs],
        "snapshots": sum(snapshots),
        "hung": hung + owner.is_alive(),
        "num_open": num_open,
        "cold": cold,
        "warm": warm,
        "digest": digest,
    }


def test_other_threads_are_refused_on_both_ranks_and_the_cache_stays_consistent(tmp_path):
    results = run_on_mesh((2,), _hammer_body, str(tmp_path), timeout=120)
    for r in results:
        assert r["hung"] == 0
        assert r["other"] == [], r["other"][:5]
        assert r["refused"] == HAMMERS * ROUNDS  # every call of every hammer, on each rank
        assert r["snapshots"] == HAMMERS * ROUNDS
        assert r["num_open"] == 1
        assert (r["cold"], r["warm"]) == (0, 3 * PS)
    assert results[0]["digest"] == results[1]["digest"]
