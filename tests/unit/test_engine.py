"""The engine on one rank: cached prefill equals recompute from every tier.

docs/DESIGN.md section 10.
"""

from __future__ import annotations

from mesh_hicache.cache import HiCache
from mesh_hicache.config import HiCacheConfig
from mesh_hicache.testing import internals
from runtime.engine import Engine
from runtime.model import HybridModel
from runtime.model.config import preset
from tests.engine_cases import ATOL, PAGE, resume_scenarios


def test_resume_from_every_tier_equals_recompute(one_rank_topology, tmp_path):
    checks = resume_scenarios(one_rank_topology, root=str(tmp_path))
    for c in checks:
        assert c.cached > 0, f"{c.label}: expected a {c.tier} hit"
        assert c.max_diff < ATOL, f"{c.label}: logits differ by {c.max_diff}"
        assert c.tokens_equal, c.label
    assert {c.tier for c in checks} == {"device", "host", "storage"}


def test_prompt_longer_than_l1_is_served_uncached(one_rank_topology):
    topology = one_rank_topology
    # 4 device pages hold 64 tokens; a 100-token prompt cannot be paged, so the engine
    # serves it without the cache (agreed CacheFull) and the output still matches.
    config = preset("tiny")
    model = HybridModel(config, topology, page_size=PAGE)
    cache = HiCache(topology, config.state_spec(PAGE), HiCacheConfig(device_pages=4))
    prompt = list(range(1, 101))
    got = Engine(model, cache, max_new_tokens=4, keep_logits=True).serve(prompt)
    want = Engine(model, None, max_new_tokens=4, keep_logits=True).serve(prompt)
    assert got.output_ids == want.output_ids and got.cached == 0
    assert internals(cache).tree.num_nodes == 0  # nothing was inserted
    cache.check_integrity()
    cache.close()
