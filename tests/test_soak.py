"""`bench soak` for two minutes, as `make test` runs it: 12 clients against one server with 4 slots and a queue of
2, so the queue fills; greedy and seeded sampled requests over every protocol, bad inputs of every kind (tiny, huge
and NaN temperatures, ids outside the vocabulary, wrong shapes and dtypes, unknown inputs, oversized text),
cancellations and deadlines. Every valid answer equals the same request run alone; nothing is lost."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_two_minute_soak_loses_nothing(default_engines, tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, "-m", "bench", "soak", "--engines", str(default_engines), "--limit", "3",
                          "--clients", "12", "--duration", "120", "--slots", "4", "--max-queue", "2",
                          "--sample-s", "20", "--out", str(out), "--json"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    summary = json.loads((out / "soak.json").read_text())
    c = summary["counts"]
    assert all(c[k] > 0 for k in ("valid", "sampled", "deadline", "refused", "bad", "cancelled")), c
    assert c["lost"] == c["garbled"] == c["wrong"] == c["bad_unnamed"] == 0, summary["examples"]
    assert summary["slots_in_use_after"] == 0 and summary["rss_growth_after_warmup"] <= 0.10
    assert summary["stop_exit_code"] == 0  # every model unloaded within the drain, after every kind of request
