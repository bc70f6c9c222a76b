"""`python -m export self-data` on the real default engines: Magpie prompts come from the chat template's user-turn
prefix alone, answers are the target's greedy tokens (as `generate --mode plain` gives them), the same seed gives the
same files, and a rerun with a larger count resumes instead of starting over."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spork_trt.config import GenerateConfig
from spork_trt.learn.selfdata import user_turn_prefix

pytestmark = pytest.mark.slow


def self_data(out, engines, magpie: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "export", "self-data", "--engines", str(engines), "--out", str(out),
                           "--magpie", str(magpie), "--stdlib", "2", "--max-new-tokens", "24", "--slots", "4"],
                          capture_output=True, text=True, timeout=600)


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_self_data_is_the_targets_own_text_deterministic_and_resumable(default_engines, tmp_path):
    from spork_trt.loop.runtime import Runtime

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
    assert recipe["prompts"] == {"magpie": 3, "stdlib": 2, "openers": 0} and recipe["tokens"]["answer"] > 0
    more = self_data(tmp_path / "a", default_engines, 4)  # one more prompt: only it is answered
    assert more.returncode == 0 and "answering 1 prompts (5 done before)" in more.stderr, more.stderr
    assert len(lines(tmp_path / "a" / "answers.jsonl")) == 6


def test_self_data_from_a_checkpoint_on_torch_is_the_same_greedy_text(default_engines, tmp_path):
    """`--model` (the path `--device cuda` takes, on the torch engine here): the answers are the target's greedy
    text, as the ONNX build writes it, and the recipe names the checkpoint's sha256 and the device."""
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.loop.runtime import Runtime

    m = mf.read(default_engines)
    run = subprocess.run([sys.executable, "-m", "export", "self-data", "--model", m["source"]["path"], "--out",
                          str(tmp_path / "t"), "--magpie", "0", "--stdlib", "2", "--max-new-tokens", "16",
                          "--slots", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    recipe = json.loads((tmp_path / "t" / "recipe.json").read_text())
    assert recipe["target_sha256"] == m["source"]["sha256"] and recipe["settings"]["device"] == "cpu"
    rt = Runtime.from_engines(default_engines, load_head=False)
    for r in lines(tmp_path / "t" / "answers.jsonl"):
        prompt, answer = r["ids"][:r["n_prompt"]], r["ids"][r["n_prompt"]:]
        assert len(answer) == 16 and rt.generate(prompt, GenerateConfig(max_new_tokens=16)).token_ids == answer
    cuda = subprocess.run([sys.executable, "-m", "export", "self-data", "--device", "cuda", "--out",
                           str(tmp_path / "c"), "--magpie", "1"], capture_output=True, text=True, timeout=600)
    if not __import__("torch").cuda.is_available():  # one clear line, nothing written
        assert cuda.returncode == 2 and "--device cuda" in cuda.stderr
        assert not (tmp_path / "c" / "answers.jsonl").exists()


def test_opener_prompts_begin_with_their_verb_and_extend_a_run_in_order(default_engines, tmp_path):
    """`--openers`: each prompt begins with OPENERS[attempt % len] and is the target's own continuation; a larger
    count extends the run (only the new prompt answered, its answer appended last), recipe.json lists both runs, and
    the packed corpus' manifest reproduces them in that order."""
    from spork_trt.export.artifacts import CORPUS, MANIFEST, pack
    from spork_trt.learn.selfdata import OPENERS

    def run(openers: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "export", "self-data", "--engines", str(default_engines),
                               "--out", str(tmp_path / "o"), "--magpie", "0", "--stdlib", "1", "--openers",
                               str(openers), "--max-new-tokens", "8", "--slots", "4"],
                              capture_output=True, text=True, timeout=600)

    first = run(2)
    assert first.returncode == 0, first.stderr
    prompts = [p for p in lines(tmp_path / "o" / "prompts.jsonl") if p["source"] == "opener"]
    assert sum(p["kept"] for p in prompts) >= 2 and all(p["id"].startswith("opener:") for p in prompts)  # + those
    # in flight when the second was kept
    for p in prompts:
        assert p["prompt"].startswith(OPENERS[int(p["id"].split(":")[1]) % len(OPENERS)])
    more = run(3)
    assert more.returncode == 0 and "answering 1 prompts (3 done before)" in more.stderr, more.stderr
    answers = lines(tmp_path / "o" / "answers.jsonl")
    kept = sorted((p for p in lines(tmp_path / "o" / "prompts.jsonl") if p["source"] == "opener" and p["kept"]),
                  key=lambda p: int(p["id"].split(":")[1]))
    assert len(answers) == 4 and answers[-1]["id"] == kept[2]["id"]
    assert {a["id"] for a in answers[:3] if a["id"].startswith("opener:")} == \
        {kept[0]["id"], kept[1]["id"]}  # the first run answered its first two kept openers, no more
    recipe = json.loads((tmp_path / "o" / "recipe.json").read_text())
    assert recipe["prompts"] == {"magpie": 0, "stdlib": 1, "openers": 3}
    assert recipe["runs"] == [{"magpie": 0, "stdlib": 1, "openers": 2}, {"magpie": 0, "stdlib": 1, "openers": 3}]
    pack(tmp_path / "o", tmp_path / "packed")
    manifest = json.loads((tmp_path / "packed" / MANIFEST).read_text())
    assert (tmp_path / "packed" / CORPUS).is_file() and manifest["sequences"] == 4
    assert manifest["reproduce"] == (
        "python -m export build && python -m export self-data --magpie 0 --stdlib 1 --openers 2 --max-new-tokens 8 "
        "--seed 0 && python -m export self-data --magpie 0 --stdlib 1 --openers 3 --max-new-tokens 8 --seed 0 && "
        "python -m export pack")
