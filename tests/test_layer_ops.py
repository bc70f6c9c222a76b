"""spork's small layer ops (engines/cpu/avx512_ops.cpp): each against a float64 reference, and each row the same bits
alone and among many rows (row-invariant by construction)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spork_trt.engines.cpu import forward as cpu_forward, kernels as int4_kernel

pytestmark = pytest.mark.skipif(int4_kernel.kernel() != "spork", reason="spork's CPU kernels need AVX512-BF16")
ops = torch.ops.spork


def rand(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def close(got, want):
    """bf16 output: within one rounding (2^-8 relative) of the float64 value, plus a little for fp32 sums."""
    return bool(((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all())


@pytest.mark.parametrize("c", [576, 64, 40])
@pytest.mark.parametrize("wide", [False, True])  # the residual stream and what is added to it: bf16 or fp32
def test_rms_norm_and_its_residual_add(c, wide):
    x, d, w = rand(37, c).float(), rand(37, c, seed=1), rand(c, seed=2)
    x = x + rand(37, c, seed=3).float() * 2 ** -9  # fp32 values past bf16's precision
    d = d.float() + rand(37, c, seed=4).float() * 2 ** -9 if wide else d
    ref = lambda s: w.double() * s.double() / (s.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    for xs in (x, x.bfloat16()):
        got = ops.rms_norm(xs, w, 1e-5)
        assert got.dtype == torch.bfloat16 and close(got, ref(xs))
    s, y = ops.add_rms_norm(x, d, w, 1e-5)
    assert s.dtype == torch.float32 and torch.equal(s, x + d.float())  # fp32 addition, the residual kept fp32
    assert y.dtype == torch.bfloat16 and close(y, ref(s))
    for n in (1, 5):
        assert torch.equal(ops.rms_norm(x[n:n + 1], w, 1e-5), ops.rms_norm(x, w, 1e-5)[n:n + 1])
        assert torch.equal(ops.add_rms_norm(x[n:n + 1], d[n:n + 1], w, 1e-5)[1], y[n:n + 1])
    with pytest.raises(RuntimeError, match="fp32"):
        ops.add_rms_norm(x.bfloat16(), d, w, 1e-5)  # the residual stream is fp32


@pytest.mark.parametrize("f", [1536, 24])
def test_silu_mul(f):
    gu = rand(21, 2 * f, scale=4.0)
    g, u = gu.double().chunk(2, dim=-1)
    assert close(ops.silu_mul(gu), F.silu(g) * u)
    assert torch.equal(ops.silu_mul(gu[3:4]), ops.silu_mul(gu)[3:4])


@pytest.mark.parametrize("d", [64, 16])
def test_rope_store_rotates_q_and_k_and_writes_k_and_v_into_the_pool(d):
    b, t, h, hkv = 2, 3, 4, 2
    qkv = rand(b * t, (h + 2 * hkv) * d)
    pos = torch.tensor([[5, 6, 7], [0, 1, 1]])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = cpu_forward.rope_tables(pos, inv_freq, torch.float32)
    pool_k, pool_v = torch.zeros(4, hkv, 10, d).bfloat16(), torch.zeros(4, hkv, 10, d).bfloat16()
    slots, write = torch.tensor([3, 1]), torch.tensor([[5, 6, 7], [0, 1, 9]])
    qk = ops.rope_store(qkv, cos, sin, h, pool_k, pool_v, slots, write)  # [B, H+Hkv, T, D]
    x = qkv.double().view(b, t, h + 2 * hkv, d).transpose(1, 2)  # [B, heads, T, D]
    c, s = cos.double(), sin.double()  # [B, 1, T, D]
    want = x[:, :h + hkv] * c + x[:, :h + hkv].roll(d // 2, -1) * s
    assert qk.shape == (b, h + hkv, t, d) and close(qk, want)
    for i in range(b):
        for r in range(t):
            assert torch.equal(pool_k[slots[i], :, write[i, r]], qk[i, h:, r])
            assert torch.equal(pool_v[slots[i], :, write[i, r]], qkv.view(b, t, -1, d)[i, r, h + hkv:])
    one = ops.rope_store(qkv[4:5], cos[1:2, :, 1:2].contiguous(), sin[1:2, :, 1:2].contiguous(), h, pool_k, pool_v,
                         slots[1:2], write[1:2, 1:2].contiguous())
    assert torch.equal(one[0, :, 0], qk[1, :, 1])
    with pytest.raises(RuntimeError, match="write position out of range"):
        ops.rope_store(qkv, cos, sin, h, pool_k, pool_v, slots, write + 5)
