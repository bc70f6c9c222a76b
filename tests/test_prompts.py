"""Prompt sets: the long-document set is long (about 700 to 1,500 tokens of the default model, as the serving mix
needs), its text is not in the shipped datastore's corpus (no learned artifact saw it), and the mix puts one long
prompt in every three."""
from __future__ import annotations

from pathlib import Path

import pytest

from spork_trt.checkpoint import manifest as mf
from spork_trt.errors import UserError
from spork_trt.export.artifacts import load_corpus, shipped
from spork_trt.prompts import load_prompts

GRAM = 12  # tokens: a run this long shared with the corpus would be copied text, not common phrasing


def grams(ids, n: int = GRAM) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def test_long_documents_are_long_and_not_in_the_shipped_corpus(default_tokenizer, default_checkpoint):
    rows = load_prompts("long_docs")
    ids = [default_tokenizer.encode_prompt(r["prompt"]) for r in rows]
    assert len(rows) >= 64 and len({r["id"] for r in rows}) == len(rows)
    assert 650 <= min(map(len, ids)) and max(map(len, ids)) <= 1500, sorted(map(len, ids))[::16]
    corpus = load_corpus(shipped(mf.sha256(default_checkpoint.path)))
    seen = grams(corpus.tolist())
    docs = set().union(*(grams(default_tokenizer.encode_prompt(r["prompt"], raw=True)) for r in rows))
    assert len(docs & seen) / len(docs) < 0.001  # a few boilerplate runs at most


def test_the_rag_mix_is_one_long_prompt_in_three():
    mix, long = load_prompts("rag_mix", 30), load_prompts("long_docs")
    assert [r["category"] == "long" for r in mix] == [k % 3 == 2 for k in range(30)]
    assert [r["prompt"] for r in mix[2::3]] == [r["prompt"] for r in long[:10]]
    assert [r["prompt"] for r in mix if r["category"] != "long"] == [r["prompt"] for r in load_prompts("mt_bench", 20)]


def test_the_prompt_sets_ship_in_the_checkout_with_their_licenses():
    """Nothing is read from beside the checkout: a clone alone runs the benchmarks and the tests."""
    from spork_trt.prompts import DATA, load_prompts

    root = Path(__file__).resolve().parents[1]
    assert DATA.is_relative_to(root)
    assert len(load_prompts("mt_bench")) == 80 and len(load_prompts("humaneval")) == 164
    assert "Apache License" in (DATA / "mt_bench" / "LICENSE").read_text()
    assert "MIT" in (DATA / "humaneval" / "LICENSE").read_text()


def test_a_missing_prompt_file_is_one_line_naming_how_to_get_it(monkeypatch, tmp_path):
    from spork_trt import prompts

    monkeypatch.setattr(prompts, "DATA", tmp_path)
    with pytest.raises(UserError, match=r"prompt data .*question.jsonl is missing: .*git checkout -- spork_trt/data"):
        prompts.load_prompts("mt_bench")


def test_the_json_extraction_set_asks_for_humaneval_fields_under_a_schema_the_grammar_engine_takes():
    import json

    import jsonschema

    from bench.worker import grammars
    from spork_trt.spec.grammar import GrammarSpec
    from spork_trt.spec.schema_check import check_schema

    rows, code = load_prompts("json_extract", 5), load_prompts("humaneval", 5)
    assert [r["category"] for r in rows] == ["json_extract"] * 5 and len({r["id"] for r in rows}) == 5
    assert all(r["prompt"].endswith(c["prompt"].split("\n", 1)[1]) for r, c in zip(rows, code))
    schema = json.loads(rows[0]["schema"])
    check_schema(rows[0]["schema"])  # no keyword the grammar engine would ignore
    jsonschema.validate({"name": "f", "parameters": ["x"], "returns": "an int",
                         "examples": [{"call": "f(1)", "result": "2"}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "parameters": [], "returns": "", "examples": [], "extra": 1}, schema)
    assert grammars("json_schema", rows) == [GrammarSpec("json_schema", r["schema"]) for r in rows]
    assert grammars(None, rows) == [None] * 5 and grammars("json", rows[:1]) == [GrammarSpec("json")]
    with pytest.raises(UserError, match="json_extract"):
        grammars("json_schema", load_prompts("mt_bench", 2))  # no schema of its own: one clear line
