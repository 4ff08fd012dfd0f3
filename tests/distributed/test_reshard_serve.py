"""runtime.serve on a storage root filled by another mesh: outputs equal ``--cache off``,
L3 tokens are served and the summary / ``--json`` count the resharded ones."""

from __future__ import annotations

from tests.unit.test_serve import _serve


def test_serve_reads_l3_written_by_one_rank_under_tp2(tmp_path):
    off, _ = _serve(tmp_path, "off", "--cache", "off")
    one, _ = _serve(tmp_path, "one", "--cache", "full")
    assert one["summary"]["storage_resharded_tokens"] == 0
    tp2, stdout = _serve(tmp_path, "tp2", "--cache", "full", "--tp", "2", nproc=2)
    assert [r["output_ids"] for r in tp2["requests"]] == [r["output_ids"] for r in off["requests"]]
    summary = tp2["summary"]
    assert summary["cached_storage"] > 0
    # Only tokens served from L3 count, and here all of them come from the 1-rank objects.
    assert summary["storage_resharded_tokens"] == summary["cached_storage"]
    assert tp2["cache_stats"]["storage_resharded_tokens"] == summary["storage_resharded_tokens"]
    assert "served from L3, resharded" in stdout
