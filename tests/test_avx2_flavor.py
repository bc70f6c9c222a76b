"""spork's AVX2 kernel flavor in `make test` wherever this CPU can run it (issue 65): a process runs one flavor, the
AVX512-BF16 one on a CPU that has it, so there the kernel, attention, layer-op and block-type tests run again in a
subprocess with SPORK_KERNELS=avx2 (which builds and loads the AVX2 library). On an AVX2-only CPU every test already
runs the AVX2 flavor, and this one is skipped."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spork_trt.engines.cpu import kernels

FILES = ["tests/test_int4_kernel.py", "tests/test_attention_kernel.py", "tests/test_layer_ops.py",
         "tests/test_kquant_engine.py"]


@pytest.mark.slow
def test_the_avx2_flavor_passes_the_kernel_tests():
    if kernels.flavor() is None or kernels.flavor().name != "avx512-bf16":
        pytest.skip("this CPU runs the avx2 flavor (or none) in every test already")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES],
                         env={**os.environ, "SPORK_KERNELS": "avx2"}, cwd=root, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
    code = "from spork_trt.engines.cpu import kernels as k; print(k.arithmetic())"
    probe = subprocess.run([sys.executable, "-c", code],
                           env={**os.environ, "SPORK_KERNELS": "avx2"}, cwd=root, capture_output=True, text=True,
                           timeout=600)
    assert probe.stdout.strip().splitlines()[-1] == "avx2", probe.stdout + probe.stderr  # it ran what it says
