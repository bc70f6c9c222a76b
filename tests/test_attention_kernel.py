"""spork::attend (engines/cpu/avx512_attention.cpp): the CPU torch engine's attention read from the pool in place. It must
compute softmax(q k^T / sqrt(D)) v over the columns each row attends (against a float64 reference), and give a row
the same bits alone, in a chain, in a batch, in a wider window, with its keys at other columns (a tree's), on one
thread or two, and whichever rows share its work item (8 rows of one sequence and KV head). On a CPU with AMX the
scores and P @ V run on the tile unit (P @ V over each row's keys by rank: a tree's row sums its chain's tiles), and
the tests run again with SPORK_AMX=0 (vdpbf16ps) in a process of their own."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from spork_trt.engines.cpu import kernels as int4_kernel

pytestmark = pytest.mark.skipif(int4_kernel.kernel() != "spork", reason="spork's CPU kernels need AVX512-BF16")


def attend(qk, heads, pk, pv, slots, mask):
    return torch.ops.spork.attend(qk.contiguous(), heads, pk, pv, torch.tensor(slots), mask.contiguous())


def reference(qk, heads, pk, pv, slots, mask) -> torch.Tensor:
    """float64, row by row: [B*T, H*D]."""
    b, _, t, d = qk.shape
    g = heads // pk.shape[1]
    c = mask.shape[2]
    out = torch.zeros(b, t, heads, d, dtype=torch.float64)
    for i in range(b):
        for h in range(heads):
            k, v = pk[slots[i], h // g, :c].double(), pv[slots[i], h // g, :c].double()
            s = (qk[i, h].double() @ k.T / math.sqrt(d)).masked_fill(~mask[i], float("-inf"))
            out[i, :, h] = torch.softmax(s, -1) @ v
    return out.reshape(b * t, heads * d)


def case(d, heads, hkv, t, c, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    pk = torch.randn(6, hkv, c + 20, d, generator=g).bfloat16()
    pv = torch.randn(6, hkv, c + 20, d, generator=g).bfloat16()
    qk = torch.randn(b, heads + hkv, t, d, generator=g).bfloat16()
    mask = torch.rand(b, t, c, generator=g) < 0.7
    mask[:, :, 0] = True
    return qk, heads, pk, pv, [4, 1, 2][:b], mask


SHAPES = [(64, 9, 3, 1, 100), (64, 9, 3, 5, 130), (16, 4, 2, 3, 40), (64, 9, 3, 40, 300), (32, 4, 1, 7, 17),
          (128, 4, 2, 2, 33)]


@pytest.mark.parametrize("shape", SHAPES)
def test_attend_computes_softmax_attention_over_the_attended_columns(shape):
    args = case(*shape)
    got, want = attend(*args).double(), reference(*args)
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()  # bf16 output: a half step at most


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_alone_equals_the_row_in_its_batch_its_chain_and_a_wider_window(shape):
    qk, heads, pk, pv, slots, mask = case(*shape)
    b, t = mask.shape[:2]
    out = attend(qk, heads, pk, pv, slots, mask).view(b, t, -1)
    for i in range(b):
        for r in range(t):
            alone = attend(qk[i:i + 1, :, r:r + 1], heads, pk, pv, slots[i:i + 1], mask[i:i + 1, r:r + 1])
            assert torch.equal(alone, out[i, r:r + 1])
    wider = torch.cat([mask, torch.zeros(b, t, 15, dtype=torch.bool)], -1)  # unattended columns after
    assert torch.equal(attend(qk, heads, pk, pv, slots, wider).view(b, t, -1), out)


def test_a_row_gives_the_same_bits_with_its_keys_at_other_columns():
    """A tree's node attends its ancestors at other columns than the same tokens in a chain, with unattended
    columns between them; it is computed alone and among 40 rows (in another work item's place)."""
    d, heads, hkv = 64, 9, 3
    g = torch.Generator().manual_seed(3)
    pk, pv = torch.randn(2, hkv, 200, d, generator=g).bfloat16(), torch.randn(2, hkv, 200, d, generator=g).bfloat16()
    qk = torch.randn(1, heads + hkv, 1, d, generator=g).bfloat16()
    chain, tree = list(range(60)), list(range(50)) + [53, 57, 61, 70, 90, 91, 100, 130, 131, 150]
    pk[1, :, tree], pv[1, :, tree] = pk[0, :, chain], pv[0, :, chain]
    m_chain = torch.zeros(1, 1, 64, dtype=torch.bool)
    m_chain[0, 0, chain] = True
    m_tree = torch.zeros(1, 1, 192, dtype=torch.bool)
    m_tree[0, 0, tree] = True
    want = attend(qk, heads, pk, pv, [0], m_chain)
    assert torch.equal(attend(qk, heads, pk, pv, [1], m_tree), want)
    many = torch.randn(1, heads + hkv, 40, d, generator=g).bfloat16()
    many[:, :, 7] = qk[:, :, 0]
    m_many = torch.zeros(1, 40, 192, dtype=torch.bool)
    m_many[0, :, :5] = True
    m_many[0, 7] = m_tree[0, 0]
    assert torch.equal(attend(many, heads, pk, pv, [1], m_many).view(40, -1)[7:8], want)


def test_a_tree_row_past_many_key_groups_equals_its_chain_row_among_dense_rows():
    """A node deep in a long context: its first gap past several groups of 32 keys (those come from the groups its
    item's rows share, the rest from its own), beside rows of the same item attending dense prefixes of other
    lengths. A value of +1024 early and -1024 late keeps the running sums large, so a sum taken in another order
    (AMX's tiles round where their terms sit) shows in the bf16 output, not only in fp32."""
    d, heads, hkv = 64, 9, 3
    g = torch.Generator().manual_seed(5)
    pk, pv = torch.randn(2, hkv, 420, d, generator=g).bfloat16(), torch.randn(2, hkv, 420, d, generator=g).bfloat16()
    pk[0, :, 295] = pk[0, :, 5]  # the same score, so the two values cancel
    pv[0, :, 5], pv[0, :, 295] = 1024.0, -1024.0
    chain = list(range(300))
    tree = list(range(290)) + [297, 305, 318, 333, 347, 352, 366, 371, 388, 399]
    pk[1, :, tree], pv[1, :, tree] = pk[0, :, chain], pv[0, :, chain]
    qk = torch.randn(1, heads + hkv, 1, d, generator=g).bfloat16()
    m_chain = torch.zeros(1, 1, 300, dtype=torch.bool)
    m_chain[0, 0, chain] = True
    want = attend(qk, heads, pk, pv, [0], m_chain)
    many = torch.randn(1, heads + hkv, 6, d, generator=g).bfloat16()
    many[:, :, 3] = qk[:, :, 0]
    m_many = torch.zeros(1, 6, 410, dtype=torch.bool)
    for r, n in enumerate([100, 290, 410, 0, 33, 7]):
        m_many[0, r, :n] = True
    m_many[0, 3, tree] = True
    assert torch.equal(attend(many, heads, pk, pv, [1], m_many).view(6, -1)[3:4], want)


def test_one_thread_or_two_give_the_same_bits():
    args = case(64, 9, 3, 20, 200)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(*args)
        torch.set_num_threads(2)
        two = attend(*args)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_attend_refuses_what_it_cannot_compute():
    qk, heads, pk, pv, slots, mask = case(64, 9, 3, 1, 50)
    with pytest.raises(RuntimeError, match="slot out of range"):
        attend(qk, heads, pk, pv, [0, 1, 9], mask)
    with pytest.raises(RuntimeError, match="bf16"):
        attend(qk.float(), heads, pk, pv, slots, mask)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        attend(qk, heads, pk, pv, slots, torch.ones(3, 1, 100, dtype=torch.bool))  # C past the pool's S
    with pytest.raises(RuntimeError, match="attends no column"):
        attend(qk, heads, pk, pv, slots, torch.zeros_like(mask))
    with pytest.raises(RuntimeError, match="head size"):
        attend(torch.zeros(3, 12, 1, 130).bfloat16(), 9, torch.zeros(6, 3, 70, 130).bfloat16(),
               torch.zeros(6, 3, 70, 130).bfloat16(), slots, torch.ones(3, 1, 50, dtype=torch.bool))


def test_on_a_cpu_with_amx_the_vdpbf16ps_scores_keep_their_invariance_too():
    """Where AMX runs the scores, the tests above ran its tiles; SPORK_AMX=0 (vdpbf16ps, the only arithmetic of a CPU
    without AMX) must pass them as well."""
    if int4_kernel.arithmetic() != "amx":
        pytest.skip("no AMX in this process: the tests above ran vdpbf16ps")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not amx"],
                         env={**os.environ, "SPORK_AMX": "0"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout, \
        run.stdout[-3000:] + run.stderr[-3000:]
