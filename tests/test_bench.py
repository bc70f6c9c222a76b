"""Benchmark plumbing: arm names, and the summary's token accounting and lossless check on hand-made records."""
from __future__ import annotations

import json

import pytest

from bench.arms import parse_arm
from bench.run import summarize
from spork_trt.errors import UserError


def test_arm_names():
    assert parse_arm("plain").mode == "plain"
    a = parse_arm("spork/self-int8/2x5x10")
    assert (a.mode, a.spec.draft, a.spec.tree_width, a.spec.tree_depth, a.spec.tree_budget) == (
        "spork", "self-int8", 2, 5, 10) and a.spec.adaptive
    assert not parse_arm("spork/ngram/fixed").spec.adaptive and parse_arm("spork/ngram/fixed").spec.tree_budget == 12
    assert parse_arm("peer/hf-prompt-lookup").peer == "hf-prompt-lookup"
    for bad in ("spork", "spork/ngram/3x6", "peer/vllm", "greedy"):
        with pytest.raises(UserError):
            parse_arm(bad)


def record(arm, pid, tokens, time_s, ids, **over):
    r = {"prompts": "mt_bench", "arm": arm, "prompt_id": pid, "category": "writing", "tokens": tokens,
         "time_s": time_s, "steps": tokens, "draft_tokens": 0, "accepted_tokens": 0, "committed_tokens": tokens,
         "temperature": 0.0, "backend": "onnx", "git_sha": "x", "machine": "m", "max_new_tokens": 8, "token_ids": ids}
    r.update(over)
    return r


def test_summary_counts_lossless_mismatches_for_spork_arms_only(tmp_path):
    rows = [record("plain", 1, 4, 1.0, [1, 2, 3, 4]), record("plain", 2, 4, 1.0, [5, 6, 7, 8]),
            record("spork/ngram", 1, 4, 0.5, [1, 2, 3, 4], steps=2, draft_tokens=4, accepted_tokens=2),
            record("spork/ngram", 2, 4, 0.5, [5, 6, 7, 9], steps=2, draft_tokens=4, accepted_tokens=2),
            record("peer/hf-greedy", 1, 4, 2.0, [1, 2, 3, 0]), record("peer/hf-greedy", 2, 4, 2.0, [5, 6, 7, 8])]
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"prompts": "mt_bench", "arm": "plain",
                                                                            "peak_rss_mb": 900.0}) + "\n")
    arms = {a["name"]: a for a in summarize([f])["arms"]}
    assert arms["plain"]["tokens_per_second"] == 4.0 and arms["plain"]["peak_rss_mb"] == 900.0
    s = arms["spork/ngram"]
    assert s["speedup_vs_plain"] == 2.0 and s["lossless_mismatches"] == 1 and s["acceptance_rate"] == 0.5
    assert s["mean_accepted_length"] == 2.0
    p = arms["peer/hf-greedy"]
    assert p["lossless_mismatches"] is None and p["differs_from_plain"] == 1 and p["speedup_vs_plain"] == 0.5
