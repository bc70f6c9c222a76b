"""The target that runs when none is named (engines/default_target.py): int4 on the CPU torch engine for a GGUF
checkpoint with 4-bit blocks on a CPU with oneDNN's bf16 kernels, or with spork's CPU kernels (AVX2 too) where they
run all of its matrices, else the build's ONNX target; and `generate` saying which in one line."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from spork_trt.engines import default_target
from spork_trt.engines.cpu import kernels as int4_kernel, engine as onednn_engine
from spork_trt.engines.default_target import ONNX, choose
from spork_trt.checkpoint.weights import default_gguf_path

from .test_weights import hf_tiny, write_gguf


def test_the_default_model_has_4_bit_blocks_and_an_f32_gguf_has_none(tmp_path):
    assert default_target.has_block_weights(default_gguf_path())
    hf, _ = hf_tiny(tmp_path)
    write_gguf(tmp_path / "f32.gguf", hf)
    write_gguf(tmp_path / "q4.gguf", hf, gguf.GGMLQuantizationType.Q4_1)
    assert not default_target.has_block_weights(tmp_path / "f32.gguf")
    assert default_target.has_block_weights(tmp_path / "q4.gguf")
    assert choose("fp32", tmp_path / "f32.gguf").device == ONNX


def int4_here() -> bool:
    """Whether this host runs the default model's int4 CPU engine: oneDNN's bf16 kernels, or spork's (AVX2 too: the
    model's matrices are Q4_1 blocks and a Q8_0 embedding, all on spork's kernels)."""
    return onednn_engine.onednn_bf16_available() or int4_kernel.kernel() == "spork"


def test_only_the_default_models_matrices_are_all_on_spork_kernels(tmp_path):
    assert default_target.only_kernel_blocks(default_gguf_path())
    hf, _ = hf_tiny(tmp_path)
    write_gguf(tmp_path / "f32.gguf", hf)
    assert not default_target.only_kernel_blocks(tmp_path / "f32.gguf")


def test_the_rule(monkeypatch, tmp_path):
    ck = default_gguf_path()
    fast = int4_here()
    t = choose("fp32", ck)
    assert (t.device, t.dtype) == (("cpu", "int4") if fast else (ONNX, "fp32"))
    assert (choose("int8", ck).device, choose("int8", ck).dtype) == (ONNX, "int8")  # the precision asked for
    assert choose("fp32", None).device == ONNX  # the checkpoint is not on this machine
    (tmp_path / "hf").mkdir()
    assert choose("fp32", tmp_path / "hf").device == ONNX  # a safetensors folder: no blocks
    monkeypatch.setattr(onednn_engine, "onednn_bf16_available", lambda: False)
    t = choose("fp32", ck)
    assert (t.device, t.dtype) == (("cpu", "int4") if int4_kernel.kernel() == "spork" else (ONNX, "fp32"))
    monkeypatch.setattr(int4_kernel, "kernel", lambda: "aten")  # and no spork kernels either: an older CPU
    t = choose("fp32", ck)
    assert (t.device, t.dtype) == (ONNX, "fp32") and "oneDNN" in t.why


@pytest.mark.slow
def test_generate_names_the_target_it_chose(default_engines):
    """`generate` with no --dtype runs the default target and says so in one line; --dtype fp32 the ONNX target."""
    import subprocess
    import sys

    fast = int4_here()
    run = lambda *a: subprocess.run([sys.executable, "-m", "spork_trt", "generate", "What is 2+2?",  # noqa: E731
                                     "--max-new-tokens", "8", "--engines", str(default_engines), *a],
                                    capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    auto, onnx = run(), run("--dtype", "fp32")
    assert auto.returncode == 0 and onnx.returncode == 0, auto.stderr + onnx.stderr
    lines = [line for line in auto.stderr.splitlines() if line.startswith("[generate] target: ")]
    assert len(lines) == 1
    assert ("int4 on the CPU torch engine" in lines[0]) == fast and auto.stderr.startswith(
        "[spork/torch-cpu-int4]" if fast else "[spork/onnx]")
    assert onnx.stderr.startswith("[spork/onnx]")  # --dtype given: the target named, without auto's reason
    assert [line for line in onnx.stderr.splitlines() if line.startswith("[generate] target: ")] == [
        "[generate] target: fp32 on the ONNX Runtime"]
