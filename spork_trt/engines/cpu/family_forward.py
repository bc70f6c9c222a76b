"""The CPU torch engine's layers for the families beyond Llama's decoder (config.Architecture: Qwen2's q/k/v biases,
Qwen3's and Gemma 3's q/k norms, Gemma 3's post-attention and post-MLP norms, GELU-tanh MLP, query scale and local
sliding-window layers with their own rope base, Mistral's sliding window), in ATen's ops: forward.layers' arithmetic
(rows packed, the pool written in place, window_attention's bmms summed in chunks), with the reference model's
(checkpoint/transformer.py) steps where a family has them. Every op computes a row alone, so a row gives the same
bits alone, in a chain or in a batch, as in `layers` (tests/test_families.py). Llama checkpoints keep `layers` (or
spork's fused ops): this function is not their arithmetic.

  family_layers  x [N, C] bf16, the rows `real` of a [B, T] forward -> x after every layer, and the hidden states
                 after each layer in `taps`
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from spork_trt.checkpoint.transformer import Transformer, mask_bias, window_mask
from spork_trt.engines.cpu.forward import matmul, project, rms, rope_tables, window_attention


@dataclass(frozen=True)
class FamilyWeights:
    """What a family's layers read beyond LayerWeights, as flat lists (empty where the family has none)."""
    qk_norms: list[torch.Tensor]  # [2L]: each layer's q norm then k norm [D]
    post_norms: list[torch.Tensor]  # [2L]: each layer's post-attention then post-MLP norm [C]
    biases: list[torch.Tensor]  # [L]: each layer's q, k and v biases side by side [(H + 2 Hkv) D]
    windowed: list[bool]  # [L]: the layer attends a sliding window with its own rope (local)
    gelu: bool  # the MLP's gate activation: GELU-tanh, else SiLU
    query_scale: float  # the scores' scale; 0: 1 / sqrt(D)
    embed_scale: bool  # embeddings times sqrt(C)


def family_weights(model: Transformer, biases: list[torch.Tensor]) -> FamilyWeights:
    """`biases`: each layer's q/k/v biases side by side, taken before pack_linears replaced the projections."""
    arch = model.cfg.arch
    qk = [w for blk in model.layers for w in (blk.attn.q_norm.weight, blk.attn.k_norm.weight)] if arch.qk_norm else []
    post = ([w for blk in model.layers for w in (blk.post_attn_norm.weight, blk.post_mlp_norm.weight)]
            if arch.sandwich_norms else [])
    windowed = [i in model.windowed for i in range(len(model.layers))]
    return FamilyWeights(qk, post, biases, windowed, arch.activation == "gelu_tanh", arch.query_scale,
                         arch.embed_scale)


def family_layers(x: torch.Tensor, real: torch.Tensor, b: int, t: int, cos: torch.Tensor, sin: torch.Tensor,
                  local_cos: torch.Tensor, local_sin: torch.Tensor, bias: torch.Tensor, local_bias: torch.Tensor,
                  pool_k: torch.Tensor, pool_v: torch.Tensor, at: List[Optional[torch.Tensor]], first: int,
                  gather: torch.Tensor, c: int, norms: List[torch.Tensor], qk_norms: List[torch.Tensor],
                  post_norms: List[torch.Tensor], biases: List[torch.Tensor], packed: List[torch.Tensor],
                  scales: List[torch.Tensor], parts: List[int], windowed: List[bool], dims: List[int], eps: float,
                  gelu: bool, query_scale: float, taps: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """forward.layers with a family's steps: cos, sin and bias [B, 1, 1, T, C] for the global layers, local_* for
    the windowed ones (their rope base, their window's mask)."""
    padding = real.numel() != b * t
    h, hkv, d, group = dims[0], dims[1], dims[2], dims[3]
    tapped: List[torch.Tensor] = []
    j = 0
    for i in range(len(norms) // 2):
        pq, pg = parts[2 * i], parts[2 * i + 1]
        per = pq + pg + 2
        qkv = project(rms(x, norms[2 * i], eps), packed, scales, j, pq, group)  # [N, (H+2Hkv)D]
        if len(biases) > 0:
            qkv = qkv + biases[i]
        if padding:
            qkv = qkv.new_zeros(b * t, qkv.shape[1]).index_copy_(0, real, qkv)
        qkv = qkv.view(b, t, -1)
        q = qkv[:, :, :h * d].view(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        k = qkv[:, :, h * d:(h + hkv) * d].view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        if len(qk_norms) > 0:
            q, k = rms(q, qk_norms[2 * i], eps), rms(k, qk_norms[2 * i + 1], eps)
        cs, sn = (local_cos, local_sin) if windowed[i] else (cos, sin)
        qk = torch.cat((q, k), dim=1)  # [B, H+Hkv, T, D]
        qk = qk * cs + qk.roll(d // 2, -1) * sn
        v = qkv[:, :, (h + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        layer_k, layer_v = pool_k[i], pool_v[i]
        layer_k.index_put_(at, qk[:, h:].to(layer_k.dtype))
        layer_v.index_put_(at, v.to(layer_v.dtype))
        out = window_attention(qk, layer_k, layer_v, first, gather, c, local_bias if windowed[i] else bias, dims,
                               query_scale)  # [B*T, H*D]
        if padding:
            out = out.index_select(0, real)
        a = matmul(out, packed[j + pq], scales[j + pq], group)  # [N, C]
        x = x + (rms(a, post_norms[2 * i], eps) if len(post_norms) > 0 else a)
        gate, up = project(rms(x, norms[2 * i + 1], eps), packed, scales, j + pq + 1, pg, group).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        m = matmul(act * up, packed[j + per - 1], scales[j + per - 1], group)
        x = x + (rms(m, post_norms[2 * i + 1], eps) if len(post_norms) > 0 else m)
        j += per
        if i + 1 in taps:
            tapped.append(x)
    return x, tapped


def run_family(model: Transformer, weights, family: FamilyWeights, x: torch.Tensor, real: torch.Tensor,
               pos: torch.Tensor, mask: torch.Tensor, kv, taps: tuple[int, ...]) -> tuple[torch.Tensor, list]:
    """forward.forward's layers for a family: x [N, C] (embedded) -> (x, tapped), with the global and the local
    layers' rope tables and masks (pos [B, T]; mask [B, T, C] over absolute positions)."""
    b, t = pos.shape
    if family.embed_scale:
        x = x * torch.tensor(model.cfg.dim ** 0.5, dtype=x.dtype)
    cos, sin = rope_tables(pos, model.inv_freq, x.dtype)  # [B, 1, T, D]
    bias = mask_bias(mask)[:, None, None]  # [B, 1, 1, T, C]
    local_cos, local_sin, local_bias = cos, sin, bias
    if any(family.windowed):
        local_cos, local_sin = rope_tables(pos, model.local_inv_freq, x.dtype)
        local_bias = mask_bias(window_mask(mask, pos, model.cfg.arch.sliding_window))[:, None, None]
    first = kv.window.start if kv.window is not None else -1  # -1: gather kv.slots
    return scripted_family()(x, real, b, t, cos, sin, local_cos, local_sin, bias, local_bias, kv.pool.k, kv.pool.v,
                             list(kv.at), first, kv.slots, kv.c, weights.norms, family.qk_norms, family.post_norms,
                             family.biases, weights.packed, weights.scales, weights.parts, family.windowed,
                             weights.dims, weights.eps, family.gelu, family.query_scale, list(taps))


@functools.cache
def scripted_family():
    """family_layers compiled by TorchScript once per process (the function itself where that fails)."""
    from spork_trt.engines.cpu import kernels as int4_kernel

    int4_kernel.kernel()  # spork's op schemas, which matmul names, defined before scripting
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(family_layers)
    except Exception as e:  # noqa: BLE001 - the same arithmetic in Python
        warnings.warn(f"the CPU torch engine runs its family layers in Python (TorchScript failed: {e})",
                      RuntimeWarning)
        return family_layers
