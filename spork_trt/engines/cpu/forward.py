"""The CPU torch engine's forward: the reference model's arithmetic (model.py) over its modules, in fewer ops and
with no Python between them. Each op costs a microsecond or two of dispatch, and a 30-layer forward of one token
spent 5.9 of its 11.3 ms outside the matmuls (measured with the matmuls stubbed out, docs/engines.md). So: q and k
are rotated together, rotate_half is one roll (its negation folded into sin: -x2 * s and x2 * -s are the same
number), the pool's write indices are built once per forward (WindowKV), and the layer loop is one TorchScript
function (`layers`, scripted once per process): the same ATen ops in the same order, so the same bits (TorchScript
fuses nothing on a CPU: tests/test_onednn_engine.py compares with model.py), run by TorchScript's interpreter instead
of Python (a one-token int4 forward 9.3 -> 7.2 ms, docs/engines.md). Where scripting is unavailable the same
function runs in Python. Where spork's CPU kernels are built, `fused_layers` runs instead: the same model on our own
attention (the pool read in place) and one native op for each run of small ops (engines/cpu/avx512_ops.cpp), about 12
ops a layer instead of about 35 (a one-token int4 forward 6.8 -> 3.9 ms), with other arithmetic (fp32 inside each
op), so other tokens than `layers`: a process runs one or the other (fused_layers_available). On int4 weights
packed for spork::int4_mm, `fused_layers`' ops run as one native op, spork::int4_layers (engines/cpu/fused_layers.cpp:
the same calls in the same order, so the same bits, without the interpreter between them).

Rows are packed: the linear layers, norms and residual stream run on the N real rows of a forward only (`real`,
their flat indices b * T + t in the padded [B, T] layout), the attention on the padded layout (each row's q, k, v
scattered into it, its output gathered back). A 16-request batch where one request verifies a chain of 4 then costs
the int4 kernel 20 rows, not 16 x 5 (engines/__init__.py: `padded_batches`). Each row's values are the same either
way: a linear layer computes every row alone (int4) or with the same multi-row kernel (bf16, at least its row floor).

  forward   ids, pos [B, T]; mask [B, T, C]; kv (WindowKV); real [N] -> ModelOutput: logits [R, V] at logit_rows
            (indices into the N packed rows), hidden [N, k*C] at taps
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from spork_trt.checkpoint.gguf_blocks import BLOCK
from spork_trt.checkpoint.transformer import ModelOutput, Transformer, mask_bias
from spork_trt.engines.cpu import kernels as int4_kernel
from spork_trt.engines.cpu.linears import matmul

PV_CHUNK = 1024  # columns a P @ V bmm sums at once (attend)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, T] -> cos, sin [B, 1, T, D], sin's first half negated: x * cos + roll(x, D/2) * sin is the model's
    x * cos + rotate_half(x) * sin."""
    freqs = pos.to(inv_freq.dtype)[:, :, None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.RMSNorm's arithmetic, without the module call."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class LayerWeights:
    """Every layer's tensors as flat lists, in the order `layers` reads them."""
    norms: list[torch.Tensor]  # [2L]: each layer's attention then MLP norm weight [C]
    packed: list[torch.Tensor]  # per layer: the q/k/v projection's parts, wo, the gate/up parts, down
    scales: list[torch.Tensor]  # the same projections' int4 block scales, or empty (bf16: cpu_linears.matmul)
    parts: list[int]  # [2L]: each layer's q/k/v parts and gate/up parts: 1 each when fused (cpu_linears.FUSED), else
    # 3 and 2 (a layer whose parts mix code widths runs them apart: a K-quant file's layers can differ)
    dims: list[int]  # [H, Hkv, D, weights per int4 block, attend's chunk] (TorchScript reads no globals)
    eps: float
    fused: bool  # the layers on spork's CPU kernels (fused_layers), else ATen's ops (layers)
    native: bool  # fused, every projection on spork::int4_mm, q/k/v and gate/up fused: spork::int4_layers runs them


def layer_weights(model: Transformer) -> LayerWeights:
    """The packed modules' tensors (after cpu_linears.pack_linears) in `layers`' order."""
    norms, linears, parts = [], [], []
    for blk in model.layers:
        a, m = blk.attn, blk.mlp
        qkv = [a.wqkv] if a.wqkv is not None else [a.wq, a.wk, a.wv]
        gate_up = [m.gate_up] if m.gate_up is not None else [m.gate, m.up]
        norms += [blk.attn_norm.weight, blk.mlp_norm.weight]
        linears += [*qkv, a.wo, *gate_up, m.down]
        parts += [len(qkv), len(gate_up)]
    a = model.layers[0].attn
    fused = fused_layers_available(a.head_dim) and not model.cfg.arch.features()  # spork's ops: Llama's layers
    scales = [lin.scales for lin in linears]
    native = (fused and set(parts) == {1}
              and all(sc.dtype in (torch.float16, torch.float32) and sc.numel() > 0 for sc in scales))  # pack's
    return LayerWeights(norms, [lin.packed for lin in linears], scales, parts,
                        [a.n_heads, a.n_kv_heads, a.head_dim, BLOCK, PV_CHUNK], model.layers[0].attn_norm.eps, fused,
                        native)


def fused_layers_available(head_dim: int) -> bool:
    """Whether the layers run on spork's CPU kernels (fused_layers): where they are built (int4_kernel.kernel()),
    for an even head size up to 128 (a multiple of 8 on the avx2 flavor), unless SPORK_LAYERS=aten (`layers`:
    ATen's ops, other arithmetic, so other tokens)."""
    if os.environ.get("SPORK_LAYERS", "spork") == "aten" or int4_kernel.kernel() != "spork":
        return False
    return head_dim % (8 if int4_kernel.arithmetic() == "avx2" else 2) == 0 and head_dim <= 128


def project(y: torch.Tensor, packed: List[torch.Tensor], scales: List[torch.Tensor], j: int, n: int,
            group: int) -> torch.Tensor:
    """y [N, in] -> the outputs of projections j .. j+n-1 side by side [N, sum of outs] (one: no copy)."""
    if n == 1:
        return matmul(y, packed[j], scales[j], group)
    return torch.cat([matmul(y, packed[j + p], scales[j + p], group) for p in range(n)], dim=-1)


def attend(probs: torch.Tensor, values: torch.Tensor, chunk: int) -> torch.Tensor:
    """probs [N, M, C] @ values [N, C, D] -> [N, M, D], summed over C in chunks of `chunk` columns (each chunk's
    bf16 product, then their fp32 sum in order). oneDNN's bf16 bmm sums a row over C in an order that depends on C
    once C passes 1024 (a row's P @ V changed when masked columns were added past 1024; up to 1024 it never did,
    tests/test_onednn_engine.py), so a row's output would depend on the longest sequence beside it. In chunks of at
    most 1024 it does not: a window of up to `chunk` columns is the one bmm it always was."""
    c = probs.shape[2]
    if c <= chunk:
        return torch.bmm(probs, values)
    out = torch.bmm(probs[:, :, :chunk], values[:, :chunk]).float()
    for s in range(chunk, c, chunk):
        out = out + torch.bmm(probs[:, :, s:s + chunk], values[:, s:s + chunk]).float()
    return out.to(probs.dtype)


def layers(x: torch.Tensor, real: torch.Tensor, b: int, t: int, cos: torch.Tensor, sin: torch.Tensor,
           bias: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, at: List[Optional[torch.Tensor]],
           first: int, gather: torch.Tensor, c: int, norms: List[torch.Tensor], packed: List[torch.Tensor],
           scales: List[torch.Tensor], parts: List[int], dims: List[int], eps: float,
           taps: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """x [N, C], the rows `real` of a [B, T] forward, through every layer (model.Block's arithmetic, ATen's ops).
    Each layer writes its new K/V rows into the pool [L, slots, Hkv, S, D] at `at` (indices broadcast to [B, Hkv,
    T]), then attends positions [0, c) of the sequences' slots by bmms (window_attention): slots first ..
    first+B-1 (a view), or `gather`'s when first < 0 (a copy), with `bias` (the mask's -inf). Returns x and the
    hidden states [N, C] after each layer in `taps`."""
    padding = real.numel() != b * t  # else every row is real: no scatter, no gather
    h, hkv, d, group = dims[0], dims[1], dims[2], dims[3]
    tapped: List[torch.Tensor] = []
    j = 0  # layer i's first projection
    for i in range(len(norms) // 2):
        pq, pg = parts[2 * i], parts[2 * i + 1]
        per = pq + pg + 2  # projections this layer has
        qkv = project(rms(x, norms[2 * i], eps), packed, scales, j, pq, group)  # [N, (H+2Hkv)D]
        if padding:
            qkv = qkv.new_zeros(b * t, qkv.shape[1]).index_copy_(0, real, qkv)  # padding rows: zeros
        qkv = qkv.view(b, t, -1)  # [B, T, (H+2Hkv)D]
        qk = qkv[:, :, :(h + hkv) * d].view(b, t, h + hkv, d).transpose(1, 2)  # [B, H+Hkv, T, D]
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        v = qkv[:, :, (h + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        layer_k, layer_v = pool_k[i], pool_v[i]  # [slots, Hkv, S, D]
        layer_k.index_put_(at, qk[:, h:].to(layer_k.dtype))
        layer_v.index_put_(at, v.to(layer_v.dtype))
        out = window_attention(qk, layer_k, layer_v, first, gather, c, bias, dims, 0.0)  # [B*T, H*D]
        if padding:
            out = out.index_select(0, real)  # [N, H*D]
        x = x + matmul(out, packed[j + pq], scales[j + pq], group)
        gate, up = project(rms(x, norms[2 * i + 1], eps), packed, scales, j + pq + 1, pg, group).chunk(2, dim=-1)
        x = x + matmul(F.silu(gate) * up, packed[j + per - 1], scales[j + per - 1], group)
        j += per
        if i + 1 in taps:
            tapped.append(x)
    return x, tapped


def fused_layers(x: torch.Tensor, real: torch.Tensor, b: int, t: int, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                 write: torch.Tensor, norms: List[torch.Tensor], packed: List[torch.Tensor],
                 scales: List[torch.Tensor], parts: List[int], dims: List[int], eps: float,
                 taps: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """`layers` on spork's CPU kernels (fused_layers_available): the same model in fewer ops, other arithmetic (fp32
    inside each op, one bf16 rounding at its end; the residual stream x [N, C] fp32, and the output and down
    projections added to it in fp32 where they run on spork::int4_mm). A layer: its norm (with the residual add
    before it), the q/k/v projection, rope_store (q and k rotated, k and v written into the pool [L, slots, Hkv, S,
    D] at `slots` [B] and `write` [B, T]), attend (the columns `mask` [B, T, C] gives each row, read from the pool
    in place), the output projection, the MLP norm, gate/up, silu_mul, down. cos, sin [B, T, D] fp32
    (rope_tables)."""
    padding = real.numel() != b * t  # else every row is real: no scatter, no gather
    h, group = dims[0], dims[3]
    n_layers = len(norms) // 2
    tapped: List[torch.Tensor] = []
    y = torch.ops.spork.rms_norm(x, norms[0], eps)
    j = 0  # layer i's first projection
    for i in range(n_layers):
        pq, pg = parts[2 * i], parts[2 * i + 1]
        per = pq + pg + 2  # projections this layer has
        qkv = project(y, packed, scales, j, pq, group)  # [N, (H+2Hkv)D]
        if padding:
            qkv = qkv.new_zeros(b * t, qkv.shape[1]).index_copy_(0, real, qkv)  # padding rows: zeros
        qk = torch.ops.spork.rope_store(qkv, cos, sin, h, pool_k[i], pool_v[i], slots, write)  # [B, H+Hkv, T, D]
        out = torch.ops.spork.attend(qk, h, pool_k[i], pool_v[i], slots, mask)  # [B*T, H*D]
        if padding:
            out = out.index_select(0, real)  # [N, H*D]
        x, y = torch.ops.spork.add_rms_norm(x, matmul(out, packed[j + pq], scales[j + pq], group, True),
                                            norms[2 * i + 1], eps)
        gate_up = project(y, packed, scales, j + pq + 1, pg, group)  # [N, 2F]
        down = matmul(torch.ops.spork.silu_mul(gate_up), packed[j + per - 1], scales[j + per - 1], group, True)
        if i + 1 < n_layers:
            x, y = torch.ops.spork.add_rms_norm(x, down, norms[2 * i + 2], eps)
        else:
            x = x + down
        j += per
        if i + 1 in taps:
            tapped.append(x)
    return x, tapped


def window_attention(qk: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, first: int,
                     gather: torch.Tensor, c: int, bias: torch.Tensor, dims: List[int], scale: float) -> torch.Tensor:
    """qk [B, H+Hkv, T, D] (rotated) over a copy of the pool's positions [0, c) -> out [B*T, H*D], by bmms in bf16
    (where spork::attend is not built); the scores times `scale`, or divided by sqrt(D) where it is 0 (Llama's)."""
    b, t = qk.shape[0], qk.shape[2]
    h, hkv, d = dims[0], dims[1], dims[2]
    g = h // hkv
    if first >= 0:
        # [B, Hkv, C, D]; the keys copied once (a bmm against the transpose of a strided window copies it element
        # by element: 16 x 656 tokens 690 us against 150; the same bits), the values read as they lie
        keys, values = layer_k[first:first + b, :, :c].contiguous(), layer_v[first:first + b, :, :c]
    else:
        keys, values = layer_k[:, :, :c].index_select(0, gather), layer_v[:, :, :c].index_select(0, gather)
    keys, values = keys.reshape(b * hkv, c, d), values.reshape(b * hkv, c, d)
    q = qk[:, :h].reshape(b * hkv, g * t, d)
    scores = torch.bmm(q, keys.transpose(1, 2))
    scores = (scores * scale if scale != 0.0 else scores / math.sqrt(d)).view(b, hkv, g, t, c)  # [B, Hkv, G, T, C]
    probs = torch.softmax(scores.float() + bias, dim=-1).to(q.dtype)
    out = attend(probs.view(b * hkv, g * t, c), values, dims[4])  # [B*Hkv, G*T, D]
    return out.view(b, h, t, d).transpose(1, 2).reshape(b * t, h * d)


@functools.cache
def scripted(fused: bool):
    """`fused_layers` or `layers` compiled by TorchScript, once per process; the function itself where that fails
    (the same ops)."""
    int4_kernel.kernel()  # spork's op schemas, which the layers name, defined before scripting
    fn = fused_layers if fused else layers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.script
            return torch.jit.script(fn)
    except Exception as e:  # noqa: BLE001 - any scripting failure leaves the same arithmetic in Python
        warnings.warn(f"the CPU torch engine runs its layers in Python (TorchScript failed: {e})", RuntimeWarning)
        return fn


def forward(model: Transformer, weights: LayerWeights, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
            kv, taps: tuple[int, ...], logit_rows: torch.Tensor, real: torch.Tensor | None = None,
            family=None) -> ModelOutput:
    """model.Transformer.forward over every layer, in this module's ops, on the rows `real` (default: all);
    `family` (family_forward.FamilyWeights): a family beyond Llama's decoder, on family_forward's layers."""
    b, t = ids.shape
    real = torch.arange(b * t) if real is None else real  # [N]
    x = model.embed(ids.reshape(-1)[real])  # [N, C]
    if family is not None:
        from spork_trt.engines.cpu.family_forward import run_family

        x, tapped = run_family(model, weights, family, x, real, pos, mask, kv, taps)
    elif weights.fused:
        cos, sin = rope_tables(pos, model.inv_freq, torch.float32)  # [B, 1, T, D]: [B, T, D] in memory
        args = (x.float(), real, b, t, cos, sin, mask.contiguous(), kv.pool.k, kv.pool.v, kv.slots, kv.write,
                weights.norms, weights.packed, weights.scales)  # x [N, C] fp32: what both take first
        if weights.native:
            x, tapped = torch.ops.spork.int4_layers(*args, weights.dims[0], weights.eps, list(taps))
        else:
            x, tapped = scripted(True)(*args, weights.parts, weights.dims, weights.eps, list(taps))
    else:
        cos, sin = rope_tables(pos, model.inv_freq, x.dtype)
        bias = mask_bias(mask)[:, None, None]  # [B, 1, 1, T, C]
        first = kv.window.start if kv.window is not None else -1  # -1: gather kv.slots
        x, tapped = scripted(False)(x, real, b, t, cos, sin, bias, kv.pool.k, kv.pool.v, list(kv.at), first,
                                    kv.slots, kv.c, weights.norms, weights.packed, weights.scales, weights.parts,
                                    weights.dims, weights.eps, list(taps))
    after = dict(zip(sorted(set(taps)), tapped))  # layer -> hidden [N, C] (`layers` returns them in layer order)
    hidden = torch.cat([after[k] for k in taps], dim=-1) if taps else None  # [N, k*C]
    x = x[logit_rows]  # [R, C]
    normed = (torch.ops.spork.rms_norm(x, model.norm.weight, model.norm.eps) if weights.fused
              else rms(x, model.norm.weight, model.norm.eps))  # [R, C] bf16
    logits = model.lm_head(normed)
    cap = model.cfg.arch.final_softcap
    return ModelOutput(logits=torch.tanh(logits / cap) * cap if cap else logits, hidden=hidden)
