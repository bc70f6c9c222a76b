"""One command line, one target (issue 64): `--dtype auto` resolves from the build and the host alone, never from
--mode, --draft or --verifier. On the default build, for every kind in the drafter table and every mode and verifier
value, the spork run reports the plain run's target and gives its tokens, or is refused in one line naming the
target and the flag to add."""
from __future__ import annotations

import json

import pytest

from spork_trt.cli import main as cli
from spork_trt.draft_kinds import KINDS, LAYERS, PATH, QUANT
from spork_trt.checkpoint.weights import default_gguf_path

PROMPT = "What is the capital of Japan?"


@pytest.fixture
def loaded_once(monkeypatch):
    """Runtime.from_build loads each (build, dtype) once in this test: a runtime serves many requests (as the
    server's does); each command line still resolves its own target."""
    import functools

    from spork_trt.loop.runtime import Runtime

    monkeypatch.setattr(Runtime, "from_build", functools.cache(Runtime.from_build))


def generate(capsys, engines, *flags: str) -> tuple[int, dict | None, str]:
    code = cli.main(["generate", PROMPT, "--engines", str(engines), "--max-new-tokens", "24", "--json", *flags])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


def drafts() -> list[str]:
    """One --draft value per kind of the table (each quantized copy the default build makes)."""
    values = []
    for kind in KINDS:
        if kind.arg == QUANT:
            values += [f"{kind.name}-int8", f"{kind.name}-int4"]
        elif kind.arg == LAYERS:
            values.append(f"{kind.name}:8")
        elif kind.arg == PATH:
            values.append(f"{kind.name}:{default_gguf_path()}")
        else:
            values.append(kind.name)
    return values


@pytest.mark.slow
def test_every_drafter_mode_and_verifier_runs_the_plain_runs_target_or_is_refused(default_engines, capsys, loaded_once):
    code, plain, err = generate(capsys, default_engines, "--mode", "plain")
    assert code == 0, err
    target = plain["stats"]["target"]
    assert set(target) == {"precision", "engine", "kernels"} and f"[generate] target: " in err
    runs = [("--mode", "spork", "--draft", d) for d in drafts()]
    runs += [("--mode", "spork", "--verifier", v) for v in ("auto", "on", "off")] + [("--mode", "gate", "--tau", "0.5")]
    early = {("--mode", "spork", "--draft", "early-exit:8"), ("--mode", "spork", "--verifier", "on"),
             ("--mode", "gate", "--tau", "0.5")}  # the early-layer engine: beside the build's ONNX target only
    beside_onnx = target["engine"] == "ONNX Runtime"
    for flags in runs:
        code, out, err = generate(capsys, default_engines, *flags)
        if code == 0:
            assert out["stats"]["target"] == target, flags
            assert out["token_ids"] == plain["token_ids"], flags
            assert not (flags in early and not beside_onnx), flags
            continue
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        if flags in early and not beside_onnx:
            assert "add --dtype fp32" in err and f"the target here is {target['precision']}" in err, err
        else:  # what the build lacks (the default build has no learned draft head; model drafts run from --model)
            assert flags[-1].startswith(("eagle", "store-eagle", "model:")), err
            assert "needs a build with a draft head" in err or "has no engine for --draft model:" in err, err


@pytest.mark.slow
def test_an_explicit_fp32_target_runs_early_exit_and_names_its_target(default_engines, capsys, loaded_once):
    code, plain, err = generate(capsys, default_engines, "--mode", "plain", "--dtype", "fp32")
    assert code == 0, err
    assert plain["stats"]["target"] == {"precision": "fp32", "engine": "ONNX Runtime", "kernels": ""}
    assert "[generate] target: fp32 on the ONNX Runtime\n" in err  # --dtype given: no `auto` reason
    code, out, err = generate(capsys, default_engines, "--dtype", "fp32", "--draft", "early-exit:8")
    assert code == 0 and out["token_ids"] == plain["token_ids"] and out["stats"]["target"] == plain["stats"]["target"]
