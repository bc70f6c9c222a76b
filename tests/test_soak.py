"""`bench soak --faults` for two and a half minutes, as `make test` runs it: `serve --replicas 2` behind haproxy with
the OpenAI API, 12 clients (a third through the OpenAI API), 4 slots and a queue of 2 per replica; greedy and seeded
sampled requests over every protocol, bad inputs of every kind (tiny, huge and NaN temperatures, ids outside the
vocabulary, wrong shapes and dtypes, unknown inputs, oversized text; through the OpenAI API a list as a role, lone
surrogates, a 5,000-digit integer, 50,000 nested brackets, values past int32/float32, a wrong Content-Type, a body
past the limit, a maximal body), cancellations and deadlines; meanwhile replica r0's engine is stopped with SIGSTOP
(the watchdog kills and restarts it) and replica r1 is killed. Every valid answer equals the same request run alone;
nothing is lost; a request cut by a fault is cut inside that fault's window; each fault is named in serve.log."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_soak_with_a_stopped_engine_and_a_killed_replica_loses_nothing(default_engines, tmp_path):
    out = tmp_path / "soak"
    run = subprocess.run([sys.executable, "-m", "bench", "soak", "--faults", "--engines", str(default_engines),
                          "--limit", "3", "--clients", "12", "--duration", "150", "--slots", "4", "--max-queue", "2",
                          "--pause", "15", "--stall-timeout", "6", "--sample-s", "20", "--out", str(out), "--json"],
                         capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "soak_faults.json").read_text()) if (out / "soak_faults.json").exists() else {}
    assert run.returncode == 0, (run.stderr[-3000:], {k: v for k, v in summary.items() if k != "rss_samples"})
    c = summary["counts"]
    assert all(c[k] > 0 for k in ("valid", "sampled", "deadline", "bad", "cancelled")), c
    assert c["lost"] == c["garbled"] == c["wrong"] == c["bad_unnamed"] == 0, summary["examples"]
    v = summary["verdict"]
    assert all(v["named_in_log"].values()) and v["not_ready_while_stopped"] and v["cuts_outside_fault_windows"] == 0
    assert summary["faults"]["stall"]["not_ready_after_s"] <= 6 + 3  # the watchdog's bound, then the kill
    assert summary["slots_in_use_after"] == 0 and summary["stop_exit_code"] == 0
