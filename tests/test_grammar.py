"""Constrained decoding (spork_trt/spec/grammar.py, xgrammar) on the real default model and tokenizer: constrained
plain decoding is an independent masked-argmax loop over the reference model's full forward; spork gives plain's
tokens for every drafter (nodes the grammar forbids are cut before the forward); the output parses and matches its
JSON schema; sampled output matches it too; a bad schema is one clear error."""
from __future__ import annotations

import json

import pytest
import torch

from spork_trt.config import GenerateConfig, SamplingConfig, SpecConfig
from spork_trt.errors import UserError
from spork_trt.spec.grammar import Constraint, GrammarSpec, allowed, constrain

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer"},
                                           "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                         "maxItems": 3}},
          "required": ["city", "population", "landmarks"], "additionalProperties": False}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
PROMPTS = ["Describe Paris as JSON with its population and three landmarks.",
           "Give me Tokyo's facts in JSON.",
           "Write a JSON object about Cairo."]
N = 96


def reference(model, grammars, prompt_ids: list[int], n: int) -> list[int]:
    """Masked greedy decoding by hand: the whole sequence through the reference model each step, the grammar's
    mask on the last row, its argmax; stops at end of text."""
    from spork_trt.checkpoint.transformer import causal_mask

    c = grammars.constraint(SPEC)
    ids, out = list(prompt_ids), []
    for _ in range(n):
        with torch.no_grad():
            t = len(ids)
            logits = model(torch.tensor([ids]), torch.arange(t)[None], causal_mask(0, t)).logits[0, -1:]  # [1, V]
        tok = int(constrain(logits, c.next_mask()).argmax())
        out.append(tok)
        if tok in grammars.info.stop_token_ids:
            break
        c.advance([tok])
        ids.append(tok)
    return out


def test_constrained_plain_decoding_is_the_masked_argmax_loop(default_runtime, default_checkpoint):
    rt = default_runtime
    ids = rt.tokenizer.encode_prompt(PROMPTS[0])
    got = rt.generate(ids, GenerateConfig(max_new_tokens=N), mode="plain", grammar=SPEC)
    want = reference(default_checkpoint.model, rt.grammars, ids, N)
    assert got.token_ids == [t for t in want if t not in rt.tokenizer.eos_ids]
    doc = json.loads(got.text)
    import jsonschema

    jsonschema.validate(doc, SCHEMA)


PLAIN: dict[str, object] = {}  # prompt -> constrained plain decoding's result, shared by the drafters' runs


@pytest.mark.parametrize("draft", ["ngram", "self-int8", "self-int4", "early-exit:8"])
def test_spork_is_constrained_plain_for_every_drafter(default_runtime, draft):
    rt = default_runtime
    cfg = GenerateConfig(max_new_tokens=N)
    for prompt in PROMPTS:
        ids = rt.tokenizer.encode_prompt(prompt)
        if prompt not in PLAIN:
            PLAIN[prompt] = rt.generate(ids, cfg, mode="plain", grammar=SPEC)
        plain = PLAIN[prompt]
        spork = rt.generate(ids, cfg, mode="spork", spec=SpecConfig.for_draft(draft), grammar=SPEC)
        assert spork.token_ids == plain.token_ids, (draft, prompt)
        json.loads(plain.text)
        assert plain.stats.forced_tokens == 0  # jump-forward is speculation's (tests/test_logprobs.py has one)


def test_sampled_constrained_output_matches_the_schema(default_runtime):
    import jsonschema

    rt = default_runtime
    for seed in range(2):
        cfg = GenerateConfig(max_new_tokens=N, sampling=SamplingConfig(temperature=0.9, seed=seed))
        for mode in ("plain", "spork"):
            r = rt.generate(rt.tokenizer.encode_prompt(PROMPTS[1]), cfg, mode=mode,
                            spec=SpecConfig.for_draft("self-int8"), grammar=SPEC)
            if r.stop_reason == "eos":  # a whole document (else cut by max_new_tokens mid-document)
                jsonschema.validate(json.loads(r.text), SCHEMA)


def test_a_forbidden_node_is_cut_with_its_subtree_and_the_state_is_kept(default_runtime):
    from spork_trt.spec.tree import DraftTree

    rt = default_runtime
    c: Constraint = rt.grammars.constraint(GrammarSpec("regex", "(ab|ac)d"))
    enc = lambda s: rt.tokenizer.hf.convert_tokens_to_ids(s)  # noqa: E731 - one-character tokens
    a, b, cc, d, x = (enc(ch) for ch in "abcdx")
    c.advance([a])  # the root: committed
    tree = DraftTree((a, b, x, d, cc), (-1, 0, 0, 1, 0))  # a -> {b -> d, x, c}
    valid, masks = c.tree_masks(tree)
    assert valid == [True, True, False, True, True]
    assert allowed(masks[1], d) and not allowed(masks[1], b) and allowed(masks[0], cc)
    assert c.tree_masks(tree)[0] == valid  # the walk rolled the grammar back


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize("spec,needle", [(GrammarSpec("json_schema", "{not json"), "does not compile"),
                                         (GrammarSpec("regex", "(unclosed"), "does not compile"),
                                         (GrammarSpec("json_schema", json.dumps(CYCLE)), "Circular \\$ref"),
                                         (GrammarSpec("json_schema", '{"type": "strng"}'), "Unsupported type"),
                                         (GrammarSpec("json_schema", json.dumps(
                                             {"type": "object", "properties": {"not": {"type": "array", "items": {
                                                 "type": "integer"}, "uniqueItems": True}}})),
                                          "keyword 'uniqueItems' \\(at #/properties/not\\) is not supported"),
                                         (GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^[a-z]+$",
                                                                                 "maxLength": 3})),
                                          "keyword 'maxLength' beside 'pattern' \\(at #\\) is not supported")])
def test_a_grammar_that_does_not_compile_is_one_clear_error(default_runtime, spec, needle):
    with pytest.raises(UserError, match=needle) as e:
        default_runtime.request([1, 2, 3], GenerateConfig(max_new_tokens=4), grammar=spec)
    assert ".cc:" not in str(e.value) and "/project/" not in str(e.value)  # none of the engine's source paths
    with pytest.raises(UserError, match="grammar kind must be one of"):
        GrammarSpec("yaml", "x")


def test_the_grammars_forced_text_is_grafted_under_the_root_as_a_draft_chain_of_its_own_source(default_runtime):
    from spork_trt.spec.grammar import with_chain
    from spork_trt.spec.tree import DraftTree

    rt = default_runtime
    c = rt.grammars.constraint(SPEC)
    c.advance(rt.tokenizer.hf.encode('{"city": "Paris"', add_special_tokens=False))
    chain = c.chain(16)
    assert rt.tokenizer.hf.decode(chain) == ', "population":'  # the next key in its layout (the space may merge)
    tree = DraftTree((7, 11, 12), (-1, 0, 1))  # a drafter's chain under root 7
    merged = with_chain(tree, c, 16)
    n = len(chain)
    assert merged.tokens == (7, 11, 12, *chain) and merged.parents == (-1, 0, 1, 0, *range(3, 3 + n - 1))
    assert merged.source == (0, 0, 0, *(1,) * n)  # the scheduler keeps the grammar's odds apart
    assert c.chain(16) == chain  # the grammar state is left as it was
    c.advance(chain)
    assert with_chain(merged, c, 0) is merged  # no room: the tree as it was
