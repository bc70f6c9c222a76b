"""`python -m export self-data` on the real default engines: Magpie prompts come from the chat template's user-turn
prefix alone, answers are the target's greedy tokens (as `generate --mode plain` gives them), the same seed gives the
same files, and a rerun with a larger count resumes instead of starting over."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spork_trt.config import GenerateConfig
from spork_trt.export.selfdata import user_turn_prefix

pytestmark = pytest.mark.slow


def self_data(out, engines, magpie: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "export", "self-data", "--engines", str(engines), "--out", str(out),
                           "--magpie", str(magpie), "--stdlib", "2", "--max-new-tokens", "24", "--slots", "4"],
                          capture_output=True, text=True, timeout=600)


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_self_data_is_the_targets_own_text_deterministic_and_resumable(default_engines, tmp_path):
    from spork_trt.runtime import Runtime

    a, b = self_data(tmp_path / "a", default_engines, 3), self_data(tmp_path / "b", default_engines, 3)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "answers: 5/5" in a.stderr
    for name in ("prompts.jsonl", "answers.jsonl"):  # same seed, same data (finishing order aside)
        key = lambda r: r["id"]  # noqa: E731
        assert sorted(lines(tmp_path / "a" / name), key=key) == sorted(lines(tmp_path / "b" / name), key=key)
    prompts = lines(tmp_path / "a" / "prompts.jsonl")
    assert sum(p["kept"] for p in prompts if p["source"] == "magpie") >= 3
    assert sum(p["source"] == "stdlib" for p in prompts) == 2
    assert all(p["prompt"].startswith("Complete the following Python function:\ndef ") for p in prompts
               if p["source"] == "stdlib")
    rt = Runtime.from_engines(default_engines, load_head=False)
    assert len(user_turn_prefix(rt.tokenizer)) > 0
    answers = lines(tmp_path / "a" / "answers.jsonl")
    for r in answers[:2]:
        prompt, answer = r["ids"][:r["n_prompt"]], r["ids"][r["n_prompt"]:]
        assert rt.generate(prompt, GenerateConfig(max_new_tokens=24)).token_ids == answer[:24]
    recipe = json.loads((tmp_path / "a" / "recipe.json").read_text())
    assert recipe["prompts"] == {"magpie": 3, "stdlib": 2} and recipe["tokens"]["answer"] > 0
    more = self_data(tmp_path / "a", default_engines, 4)  # one more prompt: only it is answered
    assert more.returncode == 0 and "answering 1 prompts (5 done before)" in more.stderr, more.stderr
    assert len(lines(tmp_path / "a" / "answers.jsonl")) == 6
