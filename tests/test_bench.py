"""Benchmark plumbing: arm names, the summary's token accounting and lossless check on hand-made records, and the
speedup ceiling a draft's cost sets."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.arms import parse_arm
from bench.costs import ceiling
from bench.run import summarize
from spork_trt.errors import UserError


def test_arm_names():
    assert parse_arm("plain").mode == "plain"
    a = parse_arm("spork/self-int8/2x5x10")
    assert (a.mode, a.spec.draft, a.spec.tree_width, a.spec.tree_depth, a.spec.tree_budget) == (
        "spork", "self-int8", 2, 5, 10) and a.spec.adaptive
    assert not parse_arm("spork/ngram/fixed").spec.adaptive and parse_arm("spork/ngram/fixed").spec.tree_budget == 12
    assert parse_arm("peer/hf-prompt-lookup").peer == "hf-prompt-lookup"
    assert parse_arm("peer/llama-cpp-prompt-lookup").peer == "llama-cpp-prompt-lookup"
    assert parse_arm("peer/ort-genai").mode == "peer"
    for bad in ("spork", "spork/ngram/3x6", "peer/vllm", "greedy"):
        with pytest.raises(UserError):
            parse_arm(bad)


def test_peer_stop_rule_and_missing_packages():
    from bench.peers import need, until_eos

    assert until_eos(iter([5, 6, 2, 7]), 8, frozenset({2})) == [5, 6]  # EOS excluded, nothing after it
    assert until_eos(iter([5, 6, 7, 8]), 3, frozenset({2})) == [5, 6, 7]  # max new tokens
    assert until_eos(iter([]), 3, frozenset({2})) == []
    with pytest.raises(UserError, match="make bench-peers"):
        need("no_such_peer_package", "llama-cpp")


def test_serve_peers_without_llama_server_says_what_builds_it_and_starts_nothing(tmp_path):
    missing = tmp_path / "llama-server"
    r = subprocess.run([sys.executable, "-m", "bench", "serve-peers", "--llama-server", str(missing), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{missing} not found: `make bench-peers` builds" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_llama_cpp_peers_at_each_precision_are_named_and_cached(tmp_path):
    from bench.peers import PEERS, llama_quantized

    assert {"llama-cpp", "llama-cpp-q8_0", "llama-cpp-q4_0", "llama-cpp-q8_0-prompt-lookup",
            "llama-cpp-q4_0-prompt-lookup"} <= set(PEERS)
    made = tmp_path / "m.llama-q8_0.gguf"
    made.write_bytes(b"x")  # already made once: not quantized again (llama.cpp is not even needed)
    assert llama_quantized(None, tmp_path / "m.gguf", "q8_0", tmp_path) == made


def test_llama_cpp_prompt_lookup_answers_past_512_tokens(tmp_path):
    """llama-cpp-python 0.3.36 kept n_batch (512) rows of logits with a draft model: a longer prompt and answer
    crashed the arm (`could not broadcast`) on full MT-bench. Runs where `make bench-peers` installed it."""
    pytest.importorskip("llama_cpp")
    from bench.peers import llama_runner
    from spork_trt.checkpoint.weights import load_checkpoint

    run = llama_runner("", 10, False, load_checkpoint(), tmp_path)
    assert len(run(list(range(1000, 1560)), 64, frozenset())) == 64


def test_llama_cpp_peer_wants_a_gguf(tmp_path):
    from bench.peers import PEERS
    from spork_trt.checkpoint.weights import Checkpoint

    with pytest.raises(UserError, match="GGUF"):
        PEERS["llama-cpp"].load(Checkpoint(None, tmp_path, "hf"), tmp_path)


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


def test_gate_and_verifier_arm_names():
    g = parse_arm("gate/ngram/0.5")
    assert (g.mode, g.spec.draft, g.spec.gate_tau) == ("gate", "ngram", 0.5)
    v = parse_arm("spork/ngram/fixed/verifier")
    assert v.spec.verifier == "on" and not v.spec.adaptive
    assert parse_arm("spork/ngram/noverifier").spec.verifier == "off"
    assert parse_arm("spork/ngram").spec.verifier == "auto"
    for bad in ("gate/ngram", "gate/ngram/0", "gate/ngram/x", "spork/ngram/verifier/3x6x12x"):
        with pytest.raises(UserError):
            parse_arm(bad)


def test_agreement_metrics():
    from bench.run import agreement, rouge_l

    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0 and rouge_l([1, 2], [3, 4]) == 0.0
    assert rouge_l([1, 9, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.75)  # LCS 3 of 4 and 4
    a = agreement([([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 9, 9], [1, 2, 3, 4])])
    assert a == {"exact_match_rate": 0.5, "token_agreement": 0.75, "rouge_l": 0.75}


def test_gate_arms_are_lossy_and_report_renders(tmp_path):
    from bench.gate import sweep_points
    from bench.report import BEGIN, END, build, splice

    rows = [record("plain", 1, 4, 1.0, [1, 2, 3, 4]), record("gate/ngram/0.5", 1, 4, 0.5, [1, 2, 9, 9], gated_tokens=2),
            record("spork/ngram", 1, 4, 0.8, [1, 2, 3, 4], steps=2, draft_tokens=4, accepted_tokens=2,
                   accepted_length_histogram={"0": 1, "2": 1})]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "mt_bench.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = summarize([run_dir / "mt_bench.jsonl"])
    arms = {a["name"]: a for a in summary["arms"]}
    assert arms["gate/ngram/0.5"]["lossless_mismatches"] is None and arms["gate/ngram/0.5"]["differs_from_plain"] == 1
    pts = sweep_points(summary)["mt_bench"]
    assert pts == [{"tau": 0.5, "tokens_per_second": 8.0, "speedup_vs_plain": 2.0, "exact_match_rate": 0.0,
                    "token_agreement": 0.5, "rouge_l": 0.5, "gated_fraction": 0.5}]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    text = build([run_dir], None, None, tmp_path / "out")
    assert "| mt_bench | onnx | spork/ngram | 5.00 | 1.25x |" in text and "CPU cores" in text
    assert (tmp_path / "out" / "speedup_per_category_0.png").stat().st_size > 1000
    assert (tmp_path / "out" / "accepted_length_0.png").stat().st_size > 1000
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    splice(readme, "new figures")
    assert readme.read_text() == f"intro\n{BEGIN}\nnew figures\n{END}\noutro\n"
    readme.write_text("no markers")
    with pytest.raises(UserError, match="generated block"):
        splice(readme, "x")


def test_draft_cost_ceiling():
    """(M + 1) target(1) / (M draft(1) + target(M + 1)), best over the measured chain lengths; never above
    target(1) / draft(1), and a free draft is limited by the target's own cost growth."""
    target = {1: 27.0, 4: 31.0, 8: 36.0}
    assert ceiling(target, 16.8) == (round(8 * 27.0 / (7 * 16.8 + 36.0), 2), 7)
    for d1 in (16.8, 13.3, 5.0, 1.0):
        assert ceiling(target, d1)[0] < 27.0 / d1
    assert ceiling(target, 0.0) == (round(8 * 27.0 / 36.0, 2), 7)


def test_serve_repeats_pair_each_repeat_and_report_the_median(tmp_path):
    """bench serve --repeats: each repeat's spork / plain ratio (the modes alternate order between repeats), their
    median per (server, concurrency), rendered in the table; the plot takes the median row per concurrency."""
    from bench.report import latency_plot
    from bench.serve import paired_ratios, table

    def row(server, mode, conc, rep, tps):
        return {"server": server, "mode": mode, "concurrency": conc, "repeat": rep, "requests_per_second": 1.0,
                "output_tokens_per_second": tps, "ttft_p50_s": 0.1, "itl_mean_s": 0.02, "e2e_p50_s": 3.0,
                "e2e_p90_s": 3.5, "e2e_p99_s": 4.0, "acceptance_rate": 0.4, "mean_batch_size": conc}
    levels = [row("b", "spork", 1, 0, 48.0), row("b", "plain", 1, 0, 40.0),
              row("b", "plain", 1, 1, 50.0), row("b", "spork", 1, 1, 55.0),
              row("b", "spork", 1, 2, 36.0), row("b", "plain", 1, 2, 40.0),
              row("b", "spork", 4, 0, 100.0), row("b", "plain", 4, 0, 100.0),
              row("r", "spork", 1, 0, 30.0)]  # a level without its pair: no ratio
    ratios = paired_ratios(levels, ["spork", "plain"])
    assert ratios == [{"server": "b", "concurrency": 1, "ratios": [1.2, 1.1, 0.9], "median": 1.1},
                      {"server": "b", "concurrency": 4, "ratios": [1.0], "median": 1.0}]
    assert paired_ratios(levels, ["spork"]) == []
    s = {"levels": levels, "ratios": ratios, "repeats": 3, "overhead": {},
         "server_rss_mb": {"b": {"after_warmup": 1.0, "after_sweep": 1.0, "growth": 0.0}}}
    text = table(s)
    assert "b: spork / plain output tokens/s, median of 3 paired repeat(s)" in text
    assert "1 clients 1.10x (1.20, 1.10, 0.90); 4 clients 1.00x (1.00)" in text
    assert "| b | plain | 1 | 2 | 1.0 |" in text  # the repeat column counts from 1
    assert latency_plot(s, tmp_path / "serve.png").is_file()
    # the steady rate pairs the same way, levels without one (a client sent a single request) left out
    for r, steady in zip(levels, (60.0, 50.0, None, None, 45.0, 50.0, 110.0, 100.0, None)):
        r["steady_output_tokens_per_second"] = steady
    s["steady_ratios"] = paired_ratios(levels, ["spork", "plain"], "steady_output_tokens_per_second")
    assert s["steady_ratios"] == [{"server": "b", "concurrency": 1, "ratios": [1.2, 0.9], "median": 1.05},
                                  {"server": "b", "concurrency": 4, "ratios": [1.1], "median": 1.1}]
    text = table(s)
    assert "b: spork / plain steady tokens/s, median of 3 paired repeat(s)" in text and "| 50.0 | 0.10 |" in text
    assert "| 30.0 | - | 0.10 |" in text  # no steady rate: a dash


def test_serve_counts_prompts_whose_spork_text_differs_from_plain():
    """bench serve's lossless check: each spork level against plain's at the same server, concurrency and repeat,
    prompt by prompt; a level without its plain pair is not counted; the table says the count."""
    from bench.serve import mismatches_vs_plain, table

    def row(mode, conc, rep, texts):
        return {"server": "b", "mode": mode, "concurrency": conc, "repeat": rep, "texts": texts}
    levels = [row("spork", 1, 0, ["a", "b", "c"]), row("plain", 1, 0, ["a", "b", "c"]),
              row("plain", 4, 0, ["a", "b", "c", "a"]), row("spork", 4, 0, ["a", "x", "c", "z"]),
              row("spork", 4, 1, ["y", "y", "y"])]  # no plain at repeat 1: not counted
    assert mismatches_vs_plain(levels, 3) == {"spork": 1}  # prompt 2 at 4 clients; the 4th request is past n
    assert mismatches_vs_plain(levels[:2], 3) == {"spork": 0}
    s = {"levels": [], "overhead": {}, "mismatches_vs_plain": {"spork": 1},
         "server_rss_mb": {"b": {"after_warmup": 1.0, "after_sweep": 1.0, "growth": 0.0}}}
    assert "spork: 1 prompt text(s) differ from plain's at the same level and repeat (lossless: 0)" in table(s)


def test_steady_rate_counts_the_tokens_streamed_while_every_client_was_busy():
    """Two clients of two requests each; client 1's last request ends at 7 s (client 2's at 9 s): the window is
    [0, 7], and a request's tokens are those its streamed stats reported by then."""
    from bench.serve import steady_level

    def req(client, start, e2e, progress):
        return {"client": client, "start": start, "e2e_s": e2e, "progress": progress}
    rows = [req(1, 0.0, 3.0, [(1.0, 10), (3.0, 30)]), req(1, 3.0, 4.0, [(2.0, 20), (4.0, 40)]),
            req(2, 0.0, 5.0, [(2.5, 25), (5.0, 50)]), req(2, 5.0, 4.0, [(1.5, 15), (3.0, 30), (4.0, 40)])]
    assert steady_level(rows, 0.0) == round((30 + 40 + 50 + 15) / 7.0, 2)  # 2nd of client 2: 15 by 6.5 s, 30 at 8 s
    assert steady_level(rows[:3], 0.0) is None  # client 2 sent one request: no steady window


def test_core_bench_prices_both_modes_with_one_fitted_cost_table():
    """Forwards made by hand from a known table (decode 30 ms at 4 sequences, a tree's jump 4 ms and 1 ms a node,
    prefill 10 ms + 0.5 ms a token) are priced back exactly; a run's price is the same whatever its wall time, so
    a machine running 20% slower during one mode's run leaves the priced ratio alone."""
    import dataclasses

    from bench.core import CostTable, Forward, Run, level_summary

    def step(b, nodes, slow=1.0):
        return Forward(b, b + nodes, False, slow * (0.020 + 0.0025 * b + (0.004 + 0.001 * nodes if nodes else 0)))

    def prefill(tokens, slow=1.0):
        return Forward(1, tokens, True, slow * (0.010 + 0.0005 * tokens))

    spork = [prefill(40), prefill(60), *(step(4, k) for k in (0, 3, 5, 0, 2)), step(2, 1), step(2, 0)]
    plain = [prefill(40), prefill(60), *(step(4, 0) for _ in range(8)), step(2, 0), step(3, 0)]
    table = CostTable.fit(spork + plain)
    assert abs(table.decode[4] - 0.030) < 1e-9 and abs(table.jump[4] - 0.004) < 1e-9
    assert abs(table.node - 0.001) < 1e-9 and abs(table.prefill[1] - 0.0005) < 1e-9
    slow_plain = [Forward(f.seqs, f.tokens, f.prefill, f.seconds * 1.2) for f in plain]
    runs = [Run(4, mode, 0, 40, sum(f.seconds for f in fw) + 0.01, fw, 3.5, 10, 5, [[1, 2]])
            for mode, fw in (("spork", spork), ("plain", slow_plain))]
    s = level_summary(4, runs, ["spork", "plain"], table)
    work = {m: sum(table.price(f) for f in fw) + 0.01 for m, fw in (("spork", spork), ("plain", plain))}
    assert s["priced_ratio_median"] == round(work["plain"] / work["spork"], 3)
    assert s["wall_ratio_median"] > 1.15 * s["priced_ratio_median"]  # the drift shows in wall time only
    assert s["mismatches"] == 0
    runs[0] = dataclasses.replace(runs[0], texts=[[1, 3]])
    assert level_summary(4, runs, ["spork", "plain"], table)["mismatches"] == 1


def test_importing_the_bench_cli_runs_nothing():
    """`python -m bench` runs the CLI; importing bench.__main__ (tools, a test) must not parse pytest's argv."""
    import importlib

    assert callable(importlib.import_module("bench.__main__").main)


def test_core_bench_names_its_target_and_refuses_an_unknown_dtype():
    """`bench core --dtype int4` runs the build's checkpoint on the CPU torch engine (as run and serve do): its
    summary names the target; fp32 summaries (and older ones, without the field) read as before. An unknown dtype
    is refused by the parser (exit 2), before any engine loads."""
    from bench.core import markdown

    meta = {"git_sha": "abc", "draft": "store", "prompts": "mt_bench", "limit": 2, "max_new_tokens": 8, "rounds": 1}
    assert markdown(meta | {"dtype": "int4"}, []).startswith("engine core in process, git sha abc, target int4, ")
    assert markdown(meta | {"dtype": "fp32"}, []).startswith("engine core in process, git sha abc, draft store")
    assert markdown(meta, []).startswith("engine core in process, git sha abc, draft store")
    r = subprocess.run([sys.executable, "-m", "bench", "core", "--dtype", "int3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "invalid choice: 'int3'" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_bench_run_takes_its_worker_with_it():
    """`bench run` starts each arm's worker with `die_with_parent`: killing the run (here SIGKILL, as pkill -9) ends
    the worker too, so none is left writing the records a rerun writes (it happened: a spoiled plain file)."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from bench.run import die_with_parent\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=die_with_parent)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    with parent.stdout:
        worker = int(parent.stdout.readline())
    try:
        assert state(worker) not in ("gone", "Z")  # running
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while state(worker) not in ("gone", "Z") and time.time() < deadline:
            time.sleep(0.05)
        assert state(worker) in ("gone", "Z")  # ended (a zombie until whoever adopted it reaps it)
    finally:
        parent.kill()
        if state(worker) not in ("gone", "Z"):
            os.kill(worker, signal.SIGKILL)


def state(pid: int) -> str:
    """A process's state letter from /proc (R, S, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_summary_pairs_each_round_and_keeps_the_arms_peak(tmp_path):
    """Records carry their round: the speedup per round is the arm's tokens/s over plain's in that round (plain
    slow in round 1, so round 1's ratio is the higher), and the arm's peak RSS is the largest of its workers'."""
    rows = [record("plain", 1, 4, 1.0, [1], round=0), record("plain", 2, 4, 2.0, [2], round=1),
            record("spork/ngram", 1, 4, 0.5, [1], round=0), record("spork/ngram", 2, 4, 0.5, [2], round=1)]
    files = []
    for k, peak in ((0, 800.0), (1, 900.0)):
        f = tmp_path / f"r{k}.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows if r["round"] == k) +
                     json.dumps({"prompts": "mt_bench", "arm": "spork/ngram", "peak_rss_mb": peak}) + "\n")
        files.append(f)
    arms = {a["name"]: a for a in summarize(files)["arms"]}
    s = arms["spork/ngram"]
    assert s["speedup_by_round"] == [2.0, 4.0] and s["speedup_vs_plain"] == 3.0 and s["peak_rss_mb"] == 900.0
    assert "3.00x (2.00-4.00)" in __import__("bench.run", fromlist=["table"]).table({"arms": [s]})


@pytest.mark.slow
def test_bench_run_interleaves_rounds_on_the_real_engines(default_engines, tmp_path):
    """`bench run --rounds 2` on the default build: each round runs every arm (order rotated) before the next, each
    worker its round's prompts (0 and 2, then 1), an earlier run's other-round records are removed, and spork is
    lossless against plain."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "mt_bench__plain.jsonl").write_text("stale\n")  # a one-round run's records: not this run's
    r = subprocess.run([sys.executable, "-m", "bench", "run", "--engines", str(default_engines), "--prompts",
                        "mt_bench", "--limit", "3", "--max-new-tokens", "8", "--arms", "plain", "spork/ngram",
                        "--rounds", "2", "--out", str(out), "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    order = [line for line in r.stderr.splitlines() if line.startswith("[bench] mt_bench /")]
    assert order == ["[bench] mt_bench / plain (round 1 of 2)", "[bench] mt_bench / spork/ngram (round 1 of 2)",
                     "[bench] mt_bench / spork/ngram (round 2 of 2)", "[bench] mt_bench / plain (round 2 of 2)"]
    assert sorted(f.name for f in out.glob("*.jsonl")) == ["mt_bench__plain.r0.jsonl", "mt_bench__plain.r1.jsonl",
                                                           "mt_bench__spork_ngram.r0.jsonl",
                                                           "mt_bench__spork_ngram.r1.jsonl"]
    ids = [[json.loads(x)["prompt_id"] for x in (out / f"mt_bench__plain.r{k}.jsonl").read_text().splitlines()
            if "prompt_id" in x] for k in (0, 1)]
    from spork_trt.prompts import load_prompts

    rows = load_prompts("mt_bench", 3)
    assert ids == [[rows[0]["id"], rows[2]["id"]], [rows[1]["id"]]]
    arms = {a["name"]: a for a in json.loads(r.stdout)["arms"]}
    assert arms["spork/ngram"]["lossless_mismatches"] == 0 and len(arms["spork/ngram"]["speedup_by_round"]) == 2
    assert arms["plain"]["n_prompts"] == 3
    bad = subprocess.run([sys.executable, "-m", "bench", "run", "--rounds", "0", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--rounds" in bad.stderr and not (tmp_path / "x").exists()


def test_bench_chat_pairs_reuse_on_with_off_and_spork_with_plain_and_counts_differing_turns():
    from bench.chat import mismatches, ratios, table

    def row(reuse, mode, conc, ttft2, tps, texts):
        turn = {"ttft_p50_s": ttft2, "ttft_p90_s": ttft2, "prompt_tokens": 100, "cached_tokens": 80 if reuse else 0}
        return {"reuse": reuse, "mode": mode, "concurrency": conc, "repeat": 0, "output_tokens_per_second": tps,
                "turn1": turn, "turn2": turn, "texts": texts}

    rows = [row(True, "spork", 1, 0.1, 60.0, [["a", "b"]]), row(True, "plain", 1, 0.1, 40.0, [["a", "b"]]),
            row(False, "spork", 1, 0.4, 50.0, [["a", "b"]]), row(False, "plain", 1, 0.4, 40.0, [["a", "y"]]),
            row(True, "spork", 4, 0.2, 120.0, [["a", "b"], ["c", "x"]]),
            row(True, "plain", 4, 0.2, 100.0, [["a", "b"], ["c", "x"]]),
            row(False, "spork", 4, 0.3, 100.0, [["a", "b"], ["c", "d"]]),
            row(False, "plain", 4, 0.3, 90.0, [["a", "b"], ["c", "d"]])]
    assert mismatches(rows, "reuse") == 3  # spork at 4 clients (1), plain at 1 (1) and at 4 (1)
    assert mismatches(rows, "mode") == 1  # reuse off at 1 client
    assert ratios(rows) == [{"concurrency": 1, "mode": "spork", "turn2_ttft_p50_on_over_off": 0.25,
                             "tokens_per_second_on_over_off": 1.2, "tokens_per_second_spork_over_plain": 1.5},
                            {"concurrency": 4, "mode": "spork", "turn2_ttft_p50_on_over_off": 0.667,
                             "tokens_per_second_on_over_off": 1.2, "tokens_per_second_spork_over_plain": 1.2}]
    text = table({"git_sha": "abc", "conversations": 2, "max_new_tokens": 8, "slots": 4, "levels": rows,
                  "ratios": ratios(rows), "mismatches": {"reuse": 3, "mode": 1}})
    assert "| on | spork | 1 | 0.100 / 0.100 | 0.100 / 0.100 | 80% | 60.0 |" in text and "on / off 0.25x" in text
    assert "spork / plain (reuse on) 1.5x" in text and "between spork and plain: 1" in text
    spork_only = [r for r in rows if r["mode"] == "spork"]  # --modes spork: no spork / plain ratio to print
    text = table({"git_sha": "abc", "conversations": 2, "max_new_tokens": 8, "slots": 4, "target": "int4 target",
                  "levels": spork_only, "ratios": ratios(spork_only), "mismatches": {"reuse": 1, "mode": 0}})
    assert "spork / plain" not in text and "None" not in text and "served: int4 target" in text


def test_bench_run_constrained_arms_are_lossless_and_report_the_grammar_time(default_engines, tmp_path):
    """`bench run --prompts json_extract --response-format json_schema`: plain and spork both decode under each
    prompt's schema, spork gives plain's tokens, its jump-forward commits forced tokens, the grammar's time per token
    is reported; a peer arm is refused with the flag, naming it."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "bench", "run", "--engines", str(default_engines), "--prompts",
                        "json_extract", "--limit", "2", "--max-new-tokens", "48", "--arms", "plain", "spork/ngram",
                        "--response-format", "json_schema", "--rounds", "1", "--out", str(out), "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    arms = {a["name"]: a for a in json.loads(r.stdout)["arms"]}
    assert arms["spork/ngram"]["lossless_mismatches"] == 0 and arms["spork/ngram"]["forced_tokens"] > 0
    assert all(a["response_format"] == "json_schema" and a["grammar_ms_per_token"] > 0 for a in arms.values())
    first = json.loads((out / "json_extract__plain.jsonl").read_text().splitlines()[0])
    assert first["response_format"] == "json_schema" and first["grammar_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "bench", "worker", "--arm", "peer/hf-greedy", "--engines",
                          str(default_engines), "--prompts", "json_extract", "--limit", "1", "--response-format",
                          "json_schema", "--out", str(tmp_path / "p.jsonl")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--response-format" in bad.stderr and "Traceback" not in bad.stderr
