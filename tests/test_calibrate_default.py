"""`python -m export calibrate` on the real default engines (a small run), then the calibrated verifier in use:
spork with the verifier forced on is still token-for-token plain greedy; gate mode runs and says it is lossy."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spork_trt.spec.verifier import HEAD_GLOB, head_file

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


CALIBRATE = ("-m", "export", "calibrate", "--limit", "3", "--max-new-tokens", "48")


@pytest.fixture(scope="module")
def calibrated(default_engines, tmp_path_factory):
    """A view of the session's build (links to its files), calibrated once: (folder, calibrate's JSON)."""
    d = tmp_path_factory.mktemp("calibrated") / "default"
    d.mkdir()
    for f in default_engines.iterdir():
        if f.is_file():
            (d / f.name).symlink_to(f)
    r = cli(*CALIBRATE, "--engines", str(d), "--json")
    assert r.returncode == 0, r.stderr
    return d, json.loads(r.stdout)


def test_calibrate_reports_per_depth_metrics_and_saves_the_head(calibrated):
    d, out = calibrated
    assert out["heldout"] == "humaneval" and out["per_depth"][0]["depth"] == 1
    for m in out["per_depth"]:
        assert set(m) >= {"depth", "n", "ece", "ece_floor", "auroc", "brier"} and m["n"] > 0 and 0 <= m["ece"] <= 1
        assert 0 <= m["ece_floor"] < 0.5
    head = json.loads((d / head_file("store")).read_text())  # --draft auto: the store, as generate's default
    assert head["verifier_layers"] == 8 and head["meta"]["heldout"] == "humaneval" and head["meta"]["draft"] == "store"
    assert (d / "calibration" / "reliability-store.png").stat().st_size > 1000
    assert list((d / "calibration").glob("nodes-*.npz"))  # a rerun reuses the collected nodes
    again = cli(*CALIBRATE, "--engines", str(d))
    assert again.returncode == 0 and "labelled nodes from" in again.stderr and "ECE" in again.stdout


def generate_json(engines, prompt: str, *flags: str) -> dict:
    r = cli("-m", "spork_trt", "generate", prompt, "--engines", str(engines), "--max-new-tokens", "64", "--json",
            *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("prompt", ["Write a short note about the ocean, then repeat its first sentence.",
                                    "def add(a, b):\n    return a + b\n\ndef sub(a, b):"])
def test_verifier_on_is_lossless_and_gate_mode_is_marked_lossy(calibrated, prompt):
    calibrated, _ = calibrated
    plain = generate_json(calibrated, prompt, "--mode", "plain", "--dtype", "fp32")  # the verifier's target: ONNX
    scored = generate_json(calibrated, prompt, "--verifier", "on", "--dtype", "fp32")  # the verifier reads its cache
    assert scored["token_ids"] == plain["token_ids"]
    assert scored["stats"]["scored_steps"] > 0
    gate = generate_json(calibrated, prompt, "--mode", "gate", "--tau", "0.5", "--dtype", "fp32")
    assert gate["token_ids"] and gate["stats"]["scored_steps"] > 0 and "gated_tokens" in gate["stats"]


def test_a_head_scores_only_the_drafter_it_was_fitted_on(calibrated):
    """The store drafter's head is not used for the INT8 self-draft (the drafter's own score means something else there):
    auto runs without scoring, a forced verifier says which calibration to run."""
    calibrated, _ = calibrated
    prompt = "Name three rivers."
    auto = generate_json(calibrated, prompt, "--draft", "self-int8", "--dtype", "fp32")
    assert auto["stats"]["scored_steps"] == 0
    r = cli("-m", "spork_trt", "generate", prompt, "--engines", str(calibrated), "--draft", "self-int8",
            "--verifier", "on", "--dtype", "fp32")
    assert r.returncode == 2 and "export calibrate --draft self-int8" in r.stderr and "Traceback" not in r.stderr


def test_gate_and_forced_verifier_need_a_head(default_engines):
    assert not list(default_engines.glob(HEAD_GLOB))  # `export build` writes no head; calibrate runs on a copy
    r = cli("-m", "spork_trt", "generate", "hi", "--engines", str(default_engines), "--mode", "gate", "--tau", "0.5",
            "--dtype", "fp32")
    assert r.returncode == 2 and "export calibrate" in r.stderr and "Traceback" not in r.stderr
    r = cli("-m", "spork_trt", "generate", "hi", "--engines", str(default_engines), "--mode", "gate")
    assert r.returncode == 2 and "--tau" in r.stderr


@pytest.mark.parametrize("flag", ["--limit", "--max-new-tokens", "--tree-depth"])
def test_calibrate_refuses_non_positive_sizes(default_engines, flag):
    r = cli("-m", "export", "calibrate", "--engines", str(default_engines), flag, "0")
    assert r.returncode == 2 and "must be positive" in r.stderr and "Traceback" not in r.stderr
    assert not list(default_engines.glob(HEAD_GLOB))  # nothing written
