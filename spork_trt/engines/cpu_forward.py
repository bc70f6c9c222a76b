"""The CPU torch engine's forward: the reference model's arithmetic (model.py) over its modules, in fewer eager ops.
Each op costs a microsecond or two of dispatch, and a 30-layer forward of one token spent 5.9 of its 11.3 ms outside
the matmuls (measured with the matmuls stubbed out, docs/engines.md). So: q and k are rotated together, rotate_half
is one roll (its negation folded into sin: -x2 * s and x2 * -s are the same number), norms are plain functions, and
the pool's write indices are built once per forward (WindowKV). Every value is the one the model computes.

  forward   ids, pos [B, T]; mask [B, T, C]; kv (WindowKV) -> ModelOutput: logits [R, V] at logit_rows, hidden
            [B, T, k*C] at taps
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model import Block, ModelOutput, Transformer, mask_bias


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, T] -> cos, sin [B, 1, T, D], sin's first half negated: x * cos + roll(x, D/2) * sin is the model's
    x * cos + rotate_half(x) * sin."""
    freqs = pos.to(inv_freq.dtype)[:, :, None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]


def rms(x: torch.Tensor, norm) -> torch.Tensor:
    """model.RMSNorm's arithmetic, without the module call."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def block(blk: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor, layer: int,
          kv) -> torch.Tensor:
    """x [B, T, C] -> [B, T, C]: one layer (model.Block)."""
    b, t, _ = x.shape
    a = blk.attn
    h, hkv, d = a.n_heads, a.n_kv_heads, a.head_dim
    y = rms(x, blk.attn_norm)
    qkv = a.wqkv(y) if a.wqkv is not None else torch.cat((a.wq(y), a.wk(y), a.wv(y)), dim=-1)  # [B, T, (H+2Hkv)D]
    qk = qkv[..., :(h + hkv) * d].view(b, t, h + hkv, d).transpose(1, 2)  # [B, H+Hkv, T, D]
    qk = qk * cos + qk.roll(d // 2, -1) * sin
    v = qkv[..., (h + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    keys, values = kv.update(layer, qk[:, h:], v)  # [B, Hkv, C, D]
    c = keys.shape[2]
    keys, values = keys.reshape(b * hkv, c, d), values.reshape(b * hkv, c, d)  # views for consecutive slots
    q = qk[:, :h].reshape(b * hkv, (h // hkv) * t, d)
    scores = (torch.bmm(q, keys.transpose(1, 2)) / math.sqrt(d)).view(b, hkv, h // hkv, t, c)  # [B, Hkv, G, T, C]
    probs = torch.softmax(scores.float() + bias, dim=-1).to(q.dtype)
    out = torch.bmm(probs.view(b * hkv, (h // hkv) * t, c), values)  # [B*Hkv, G*T, D]
    x = x + a.wo(out.view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d))
    m = blk.mlp
    y = rms(x, blk.mlp_norm)
    gate, up = m.gate_up(y).chunk(2, dim=-1) if m.gate_up is not None else (m.gate(y), m.up(y))
    return x + m.down(F.silu(gate) * up)


def forward(model: Transformer, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, kv, taps: tuple[int, ...],
            logit_rows: torch.Tensor) -> ModelOutput:
    """model.Transformer.forward over every layer, in this module's ops."""
    x = model.embed(ids)  # [B, T, C]
    cos, sin = rope_tables(pos, model.inv_freq, x.dtype)
    bias = mask_bias(mask)[:, None, None]  # [B, 1, 1, T, C]
    tapped = {}
    for i, blk in enumerate(model.layers):
        x = block(blk, x, cos, sin, bias, i, kv)
        if i + 1 in taps:
            tapped[i + 1] = x
    hidden = torch.cat([tapped[t] for t in taps], dim=-1) if taps else None  # [B, T, k*C]
    x = x.reshape(-1, x.shape[-1])[logit_rows]  # [R, C]
    return ModelOutput(logits=model.lm_head(rms(x, model.norm)), hidden=hidden)
