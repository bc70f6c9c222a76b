"""spork::int4_mm and spork::q8_mm (engines/cpu/avx512_matmul.cpp): they compute w = d q + off of the blocks they were
given (against a float64 reference), and a row's output is the same bits at any row count, row position and thread
count; the int4 engine runs them on the default checkpoint's own Q4_1 blocks and its Q8_0 LM head, and ATen's kernel
where they are not built; a killed build's lock does not hang the next."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from spork_trt.engines.cpu import kernels as int4_kernel

if int4_kernel.kernel() != "spork":
    pytest.skip("spork::int4_mm is not built here (no AVX512-BF16 or no compiler): ATen's kernel runs",
                allow_module_level=True)


def blocks(n: int, k: int, seed: int, q4_0: bool, bits: int = 4,
           fp32: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random blocks: codes [N, K] 0..15 (Q8_0: 0..255, q + 128), d and off [N, K/32] fp16 values (Q4_0: off =
    -8 d; Q8_0: -128 d), or with `fp32` fp32 values that no fp16 holds (a K-quant's d x scale, -dmin x min)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (n, k // 32)).astype(np.float32)
    d = d if fp32 else d.astype(np.float16).astype(np.float32)
    off = -(1 << (bits - 1)) * d if q4_0 or bits == 8 else rng.uniform(-0.4, 0.1, (n, k // 32)).astype(np.float32)
    return codes, d, off if fp32 or q4_0 or bits == 8 else off.astype(np.float16).astype(np.float32)


MM = {4: "int4_mm", 8: "q8_mm"}  # the op for each code width


def sixteen_bit(x: torch.Tensor) -> torch.Tensor:
    """[M, K] float64: x as the avx2 flavor multiplies it, s xq per block of 32: s = max |x| / 32767 and xq = x (32767 /
    max |x|) rounded to nearest even, in fp32."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    xq = torch.round(xf * (torch.tensor(32767.0) / amax))  # fp32 product; round: half to even
    return (xq.double() * (amax / 32767.0).double()).reshape(x.shape)


def weights(codes: np.ndarray, d: np.ndarray, off: np.ndarray) -> np.ndarray:
    """[N, K] float64: w = d q + off per block of 32."""
    return codes * np.repeat(d, 32, axis=1).astype(np.float64) + np.repeat(off, 32, axis=1)


@pytest.mark.parametrize("q4_0, bits", [(False, 4), (True, 4), (True, 8)])
@pytest.mark.parametrize("n, k", [(64, 64), (80, 96), (960, 576)])  # 80: a chunk of 4 tiles and one of 1
def test_it_computes_the_blocks_weights(n, k, q4_0, bits):
    codes, d, off = blocks(n, k, seed=n + k, q4_0=q4_0, bits=bits)
    packed, scales = int4_kernel.pack(codes, d, off, bits=bits)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = getattr(torch.ops.spork, MM[bits])(x, packed, scales)
    assert got.dtype == (torch.bfloat16 if bits == 4 else torch.float32)
    w = torch.from_numpy(weights(codes, d, off)).t()  # [K, N]
    want = x.double() @ w
    # fp32 sums: 2^-16 of the largest output; the avx2 flavor's x in 16 bits per block of 32 (a step of max |x| /
    # 32767): about 2^-15, so 2^-13 there; its integer sums are exact, so against d q times the 16-bit x and off
    # times x itself (its fp32 block sums) it is within fp32 sums
    avx2 = int4_kernel.arithmetic() == "avx2"
    wide_tolerance = 2 ** -13 if avx2 else 2 ** -16
    if avx2:
        dq = torch.from_numpy(weights(codes, d, 0 * off)).t()
        want16 = sixteen_bit(x) @ dq + x.double() @ (w - dq)
    tolerance = 2 ** -7 if bits == 4 else wide_tolerance  # bf16 output rounding; fp32 sums
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()
    if avx2 and bits == 8:
        assert (got.double() - want16).abs().max() <= 2 ** -18 * want.abs().max()
    for m in (1, 2):  # a row or two: blocks in pairs, an odd count's last alone (k = 96: 3 blocks)
        assert torch.equal(getattr(torch.ops.spork, MM[bits])(x[:m], packed, scales), got[:m])
    if bits == 4:  # `wide`: the same fp32 sums, not rounded
        wide = torch.ops.spork.int4_mm(x, packed, scales, True)
        assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), got)
        assert (wide.double() - want).abs().max() <= wide_tolerance * want.abs().max()
        if avx2:
            assert (wide.double() - want16).abs().max() <= 2 ** -18 * want.abs().max()


@pytest.mark.parametrize("bits, fp32", [(4, True), (8, False), (8, True)])
@pytest.mark.parametrize("n, k", [(80, 96), (960, 576)])
def test_int4_mm_computes_8_bit_codes_and_fp32_scales(n, k, bits, fp32):
    """The layouts of the other block types (gguf_blocks.KINDS) through int4_mm, a layer's op: 8-bit codes (Q5_0,
    Q5_1, Q5_K and Q8_0 in a layer), fp32 scales (Q4_K, Q5_K: no fp16 holds them); bf16 out and `wide` fp32 out, both
    the float64 reference's within their rounding; 8-bit `wide` is q8_mm's very sums; a row alone is its rows' bits
    in any count."""
    codes, d, off = blocks(n, k, seed=n + k + bits, q4_0=False, bits=bits, fp32=fp32)
    if fp32:
        assert not np.array_equal(d.astype(np.float16).astype(np.float32), d)  # the test means something
        with pytest.raises(ValueError, match="not fp16 values"):
            int4_kernel.pack(codes, d, off, bits=bits)
    packed, scales = int4_kernel.pack(codes, d, off, bits=bits, fp16=not fp32)
    assert scales.dtype == (torch.float32 if fp32 else torch.float16) and packed.shape == (n, k * bits // 8)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got, wide = torch.ops.spork.int4_mm(x, packed, scales), torch.ops.spork.int4_mm(x, packed, scales, True)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), got)
    want = x.double() @ torch.from_numpy(weights(codes, d, off)).t()
    wide_tolerance = 2 ** -13 if int4_kernel.arithmetic() == "avx2" else 2 ** -16
    assert (wide.double() - want).abs().max() <= wide_tolerance * want.abs().max()
    assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    if bits == 8:
        assert torch.equal(torch.ops.spork.q8_mm(x, packed, scales), wide)
    for m in (1, 2, 3, 5):
        assert torch.equal(torch.ops.spork.int4_mm(x[:m], packed, scales), got[:m])
        assert torch.equal(torch.ops.spork.int4_mm(x[m:m + 1], packed, scales), got[m:m + 1])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_the_same_bits_at_any_row_count_position_and_thread_count(bits):
    codes, d, off = blocks(960, 576, seed=3, q4_0=bits == 8, bits=bits)
    packed, scales = int4_kernel.pack(codes, d, off, bits=bits)
    mm = getattr(torch.ops.spork, MM[bits])
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([mm(x[i:i + 1], packed, scales) for i in range(37)])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            # each path (up to 8 rows, more), every register-block tail; on AMX, groups of 16, 9 + 9 (one row of
            # zeros), 11 x 3, 13 x 3 (two)
            for m in (2, 3, 4, 5, 8, 9, 16, 17, 33, 37):
                for s in (0, 37 - m):
                    assert torch.equal(mm(x[s:s + m], packed, scales), alone[s:s + m])
    finally:
        torch.set_num_threads(threads)


def test_on_a_cpu_with_amx_it_runs_amx_unless_told_not_to_and_vdpbf16ps_keeps_its_invariance_there():
    """Where the CPU has AMX-BF16, a process runs the tile unit (its bits are not vdpbf16ps's); SPORK_AMX=0 keeps
    vdpbf16ps, whose paths the tests above then check again, in a process of their own."""
    amx_cpu = "amx_bf16" in open("/proc/cpuinfo").read()
    assert int4_kernel.arithmetic() == ("amx" if amx_cpu and os.environ.get("SPORK_AMX") != "0"
                                        else int4_kernel.flavor().name)
    if int4_kernel.arithmetic() != "amx":
        pytest.skip("no AMX here: the tests above ran vdpbf16ps")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "computes_the_blocks_weights or same_bits_at_any_row_count"],
                         env={**os.environ, "SPORK_AMX": "0"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    codes, d, off = blocks(960, 576, seed=5, q4_0=False)
    packed, scales = int4_kernel.pack(codes, d, off)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    check = ("import sys, torch; from spork_trt.engines.cpu import kernels as int4_kernel; int4_kernel.kernel(); "
             "a = torch.load(sys.argv[1]); torch.save(torch.ops.spork.int4_mm(*a, True), sys.argv[1])")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.pt")
        torch.save((x, packed, scales), path)
        subprocess.run([sys.executable, "-c", check, path], env={**os.environ, "SPORK_AMX": "0"}, check=True,
                       timeout=600)
        vdp = torch.load(path)
    amx = torch.ops.spork.int4_mm(x, packed, scales, True)
    assert not torch.equal(amx, vdp)  # another arithmetic: the switch is real
    assert (amx - vdp).abs().max() <= 2 ** -16 * amx.abs().max()  # sums of the same products


def test_pack_refuses_what_it_cannot_compute():
    codes, d, off = blocks(64, 64, seed=0, q4_0=False)
    with pytest.raises(ValueError, match="multiple"):
        int4_kernel.pack(codes[:40], d[:40], off[:40])
    with pytest.raises(ValueError, match="fp16"):
        int4_kernel.pack(codes, d + 1e-9, off)


def test_the_int4_engine_runs_it_on_the_checkpoints_blocks(default_checkpoint):
    from spork_trt.engines.cpu.linears import Int4Linear, Q8Linear
    from spork_trt.engines.cpu.engine import cpu_target
    engine = cpu_target(default_checkpoint, "int4")
    int4 = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    assert int4 and all(m.scales.dtype == torch.float16 for m in int4)
    assert isinstance(engine.model.lm_head, Q8Linear)  # the Q8_0 embedding the head is tied to


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    d = int4_kernel.build_directory()
    lock = d / "lock"
    lock.touch()
    assert int4_kernel.build_directory() == d and lock.exists()  # a build running now: its lock stays
    old = time.time() - int4_kernel.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        int4_kernel.build_directory()
    assert not lock.exists()


FALLBACK = """
import torch
from spork_trt.engines.cpu import forward as cpu_forward, kernels as int4_kernel
from spork_trt.engines.cpu.linears import Int4Linear, PackedLinear
from spork_trt.engines.cpu.engine import cpu_target
from spork_trt.engines import chain_input
from spork_trt.checkpoint.weights import load_checkpoint
from spork_trt.engines.cpu.linears import onednn_bf16_available
from spork_trt.errors import UserError
assert int4_kernel.kernel() == "aten"
if not onednn_bf16_available():  # an AVX2 CPU: its head would be a bf16 matmul, which only oneDNN runs: one error
    try:
        cpu_target(load_checkpoint(), "int4")
    except UserError as e:
        assert "oneDNN" in str(e), e
        print("ok")
        raise SystemExit(0)
    raise SystemExit("no error without oneDNN's bf16 kernels")
engine = cpu_target(load_checkpoint(), "int4")
assert all(m.scales.dtype == torch.bfloat16 for m in engine.model.modules() if isinstance(m, Int4Linear))
assert isinstance(engine.model.lm_head, PackedLinear)  # q8_mm is not built either: the head stays bf16
cache = engine.make_pool(1, 64).caches[0]
logits = engine.forward_batch([chain_input(cache, [1, 2, 3, 4])])[0]
assert not engine.weights.fused and isinstance(cpu_forward.scripted(False), torch.jit.ScriptFunction)
assert torch.isfinite(logits).all()
print("ok")
"""


def test_where_it_is_not_built_the_engine_runs_atens_kernel_and_still_scripts_its_layers():
    env = {**os.environ, "SPORK_INT4_KERNEL": "aten"}
    out = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
