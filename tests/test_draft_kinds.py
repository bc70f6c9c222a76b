"""The table of drafter kinds and the --draft parser: every spelling users type parses to its row and back, bad
ones are refused naming the choices, and the drafters' declared capabilities match their rows."""
import pytest

from spork_trt.config import SamplingConfig, SpecConfig
from spork_trt.draft_kinds import (
    AUTO,
    DRAFT_HELP,
    EAGLE,
    EARLY_EXIT,
    ENGINE,
    HYBRID,
    KINDS,
    MODEL,
    NGRAM,
    QUANTS,
    SELF,
    STORE,
    STORE_EAGLE,
    DraftSpec,
    default_shape,
    named,
    parse_draft,
)
from spork_trt.spec.drafters import StoreDrafter
from spork_trt.spec.eagle import EagleDrafter, StoreHeadDrafter
from spork_trt.engines.torch_engine import TorchEngine
from spork_trt.errors import UserError
from spork_trt.checkpoint.quant_copies import int4_copy, int8_copy
from spork_trt.loop.runtime import Runtime
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config


@pytest.mark.parametrize("text, kind, arg", [
    ("auto", AUTO, ""), ("ngram", NGRAM, ""), ("store", STORE, ""), ("eagle", EAGLE, ""),
    ("store-eagle", STORE_EAGLE, ""), ("hybrid", HYBRID, ""), ("self-int8", SELF, "int8"),
    ("self-int8-dynamic", SELF, "int8-dynamic"), ("early-exit:8", EARLY_EXIT, "8"), ("model:/a/b:c", MODEL, "/a/b:c"),
])
def test_every_spelling_parses_to_its_row_and_back(text, kind, arg):
    d = parse_draft(text, n_layers=30)
    assert (d.kind, d.arg, str(d)) == (kind, arg, text)
    assert parse_draft(d) == d and SpecConfig.for_draft(text).tree_depth == d.shape[1]


@pytest.mark.parametrize("text", ["bogus", "self", "int8", "self-int3", "self-int8:x", "ngram:3", "model", "model:",
                                  "auto:x", ""])
def test_a_bad_draft_is_refused_naming_every_choice(text):
    with pytest.raises(UserError, match=f"unknown --draft {text!r}: use auto | ngram | store | eagle") as e:
        parse_draft(text)
    assert str(e.value).endswith(DRAFT_HELP)
    assert all(f"self-{q}" in DRAFT_HELP for q in QUANTS) and "early-exit:N | model:PATH" in DRAFT_HELP


@pytest.mark.parametrize("text", ["early-exit", "early-exit:0", "early-exit:30", "early-exit:x"])
def test_early_exit_needs_fewer_layers_than_the_target(text):
    with pytest.raises(UserError, match=r"needs N in 1\.\.29 \(the target has 30 layers\)"):
        parse_draft(text, n_layers=30)
    assert parse_draft("early-exit:29", n_layers=30).arg == "29"


def test_default_shapes_come_from_the_table():
    assert SpecConfig().draft == NGRAM.name and (SpecConfig().tree_width, SpecConfig().tree_depth) == NGRAM.shape[:2]
    assert default_shape("self-int8") == (1, 5, 5) and default_shape("self-int4") == (1, 3, 3)
    assert default_shape("early-exit") == default_shape("early-exit:8") == EARLY_EXIT.shape
    assert default_shape("bogus") == default_shape("auto") == NGRAM.shape  # unchecked here; parse_draft refuses it
    assert named(["target", "verifier", "store", "self-int8", "self-fp8", "head"], SELF) == ["self-int8", "self-fp8"]


def test_combined_kinds_are_made_of_rows_and_engines_are_needed_by_model_drafts_only():
    assert [str(p) for p in STORE_EAGLE.parts] == ["store", "eagle"]
    assert [str(p) for p in HYBRID.parts] == ["ngram", "self-int8"]
    assert {k for k in KINDS if ENGINE in k.needs} == {SELF, EARLY_EXIT, MODEL}
    assert len({k.name for k in KINDS}) == len(KINDS)


def tiny_runtime() -> Runtime:
    """A runtime over a tiny random target: its quantized copies and first layer draft (no datastore, no head)."""
    model = random_checkpoint(tiny_config(), seed=5).model
    copies = {"int8": int8_copy, "int4": int4_copy}

    def draft_engine(d: DraftSpec):
        return TorchEngine(model, exit_layer=int(d.arg)) if d.kind is EARLY_EXIT else TorchEngine(copies[d.arg](model))

    return Runtime(model.cfg, None, TorchEngine(model), draft_engine)


def test_drafters_declare_the_capabilities_of_their_rows():
    """The engine core reads `batched` and `wants_hidden` off the drafter; they agree with the kinds table."""
    rt = tiny_runtime()
    for text in ("ngram", "auto", "hybrid", "self-int8", "early-exit:1"):
        d = rt.drafter(text, SamplingConfig())
        kind = parse_draft(rt.resolve_draft(text)).kind
        assert (d.batched, d.wants_hidden) == (kind.batched, kind.wants_hidden), text
    assert (StoreDrafter.batched, StoreDrafter.wants_hidden, EagleDrafter.batched) == (False, False, False)
    assert (EagleDrafter.wants_hidden, StoreHeadDrafter.wants_hidden) == (EAGLE.wants_hidden, STORE_EAGLE.wants_hidden)
    assert rt.drafter("self-int8", SamplingConfig()).share_prompt and rt.drafter(DraftSpec(NGRAM), SamplingConfig())
    for text, error in (("store", "--draft store needs a build with a datastore"),
                        ("store-eagle", "--draft store needs a build with a datastore"),
                        ("eagle", "--draft eagle needs a build with a draft head"),
                        ("early-exit:2", r"needs N in 1\.\.1 \(the target has 2 layers\)"),
                        ("bogus", "unknown --draft 'bogus': use auto")):
        with pytest.raises(UserError, match=error):
            rt.drafter(text, SamplingConfig())
    with pytest.raises(UserError, match="--draft ngram drafts without an engine of its own"):
        rt.draft_engine("ngram")


def test_a_steps_tree_room_counts_what_a_combined_drafter_grafts_past_the_budget():
    """store-eagle grafts the head's tree (eagle's budget) onto the store's: its slots keep room for both."""
    for text in ("ngram", "auto", "self-int8", "early-exit:8", "eagle"):
        spec = SpecConfig.for_draft(text)
        assert spec.tree_room == spec.tree_budget + spec.tree_depth + 1, text
    spec = SpecConfig.for_draft("store-eagle", 2, 3, 4)
    assert spec.tree_room == 4 + SpecConfig.for_draft("eagle").tree_budget + 3 + 1
