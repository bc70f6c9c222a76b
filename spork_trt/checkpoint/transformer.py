"""Reference decoder in PyTorch: the export source and the test oracle. Llama's decoder, and what other families do
beyond it as data (`cfg.arch`: config.Architecture): q/k/v biases, q/k norms, post-attention and post-MLP norms, a
GELU-tanh MLP, scaled embeddings, a query scale, sliding-window layers with their own rope base, a logit soft-cap.

Dims used in shape comments across the project:
  B batch, T new tokens this call, P past (cached) positions, S = P + T attended positions,
  H query heads, Hkv key/value heads, G = H // Hkv, D head dim, C hidden size, F ffn size, V vocab, L layers.

The attention mask is an explicit input (`mask [B, T, S]`, True = may attend), so the same forward serves causal
prefill, one-token decode and arbitrary token trees.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from spork_trt.config import ModelConfig, RopeScaling


class KVStore(Protocol):
    """Where attention keys/values live. `update` stores this call's rows and returns all rows to attend to."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hkv, T, D] -> keys, values: [B, Hkv, S, D]."""
        ...


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V], or [R, V] at `logit_rows`
    hidden: torch.Tensor | None  # [B, T, k*C]: the hidden states after each of the k `taps` layers, when asked for


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies [D/2], with linear or llama3 scaling applied (`local`: the windowed layers' own
    base, unscaled, where the family has one)."""
    d = cfg.head_dim
    theta = cfg.arch.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    sc: RopeScaling | None = None if local else cfg.rope_scaling
    if sc is None:
        return inv.float()
    if sc.kind == "linear":
        return (inv / sc.factor).float()
    if sc.kind == "factors":
        return (inv / torch.tensor(sc.factors, dtype=torch.float64, device="cpu")).float()
    assert sc.kind == "llama3", sc.kind
    old = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T], inv_freq [D/2] -> cos, sin [B, T, D] (the two halves repeat, as rotate_half expects)."""
    freqs = position_ids.to(inv_freq.dtype)[:, :, None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, T, S] bool (True = may attend) -> additive attention bias [B, T, S]: 0 or the float32 minimum."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
        ~mask, torch.finfo(torch.float32).min)


def window_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """mask [B, T, S] limited to keys fewer than `window` positions before each query (position_ids [B, T]). A key's
    slot is its position for committed rows; a tree's own rows sit at or after their positions, within any window
    longer than the tree is deep."""
    s = torch.arange(mask.shape[-1], device=mask.device)  # [S]
    return mask & (position_ids[:, :, None] - s[None, None, :] < window)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [C]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.arch.qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.wqkv: nn.Module | None = None  # an engine's fused q, k, v projection (engines/cpu/linears.py)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.arch.qk_norm else None  # [D]
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.arch.qk_norm else None  # [D]
        self.query_scale = cfg.arch.query_scale  # 0: scores / sqrt(D), Llama's arithmetic as it always was

    def forward(self, x, cos, sin, bias, layer: int, kv: KVStore | None):
        # x [B, T, C]; cos, sin [B, 1, T, D]; bias [B, 1, 1, T, S] (0 or a large negative)
        b, t, _ = x.shape
        hkv, g, d = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
        if self.wqkv is None:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        else:
            q, k, v = self.wqkv(x).split((self.n_heads * d, hkv * d, hkv * d), dim=-1)
        q = q.view(b, t, self.n_heads, d).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = kv.update(layer, k, v)  # [B, Hkv, S, D]
        q = q.reshape(b, hkv, g * t, d)  # query head h uses kv head h // G; 4-D matmuls never copy the cache
        qk = q @ k.transpose(-1, -2)
        qk = qk * self.query_scale if self.query_scale else qk / math.sqrt(d)
        scores = qk.view(b, hkv, g, t, -1)  # [B, Hkv, G, T, S]
        probs = torch.softmax(scores.float() + bias, dim=-1).to(q.dtype)
        out = probs.view(b, hkv, g * t, -1) @ v  # [B, Hkv, G*T, D]
        return self.wo(out.view(b, self.n_heads, t, d).transpose(1, 2).reshape(b, t, self.n_heads * d))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.gate_up: nn.Module | None = None  # an engine's fused gate and up projection (engines/cpu/linears.py)
        self.act = ACTIVATIONS[cfg.arch.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.act(self.gate(x)) * self.up(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        sandwich = cfg.arch.sandwich_norms  # Gemma: the outputs of attention and of the MLP are normed too
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None
        self.post_mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None

    def forward(self, x, cos, sin, bias, layer: int, kv: KVStore | None):
        a = self.attn(self.attn_norm(x), cos, sin, bias, layer, kv)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # [D/2]
        local = cfg.arch.local_rope_theta != 0.0
        self.register_buffer("local_inv_freq", rope_inv_freq(cfg, local=local), persistent=False)  # [D/2]
        self.windowed = frozenset(cfg.arch.windowed if cfg.arch.sliding_window else ())

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        position_ids: torch.Tensor,  # [B, T]
        mask: torch.Tensor,  # [B, T, S] bool, True = may attend
        kv: KVStore | None = None,
        exit_layer: int | None = None,  # run only the first `exit_layer` layers, then norm + LM head
        taps: tuple[int, ...] = (),  # also return the hidden states after these many layers (the draft head's features)
        logit_rows: torch.Tensor | None = None,  # [R] flat indices b * T + t: logits [R, V] at those rows only
    ) -> ModelOutput:
        n = self.cfg.n_layers if exit_layer is None else exit_layer
        assert 0 < n <= self.cfg.n_layers, f"exit_layer must be in 1..{self.cfg.n_layers}"
        arch = self.cfg.arch
        x = self.embed(input_ids)  # [B, T, C]
        if arch.embed_scale:
            x = x * torch.tensor(self.cfg.dim ** 0.5, dtype=x.dtype)
        rope = rope_cos_sin(position_ids, self.inv_freq, x.dtype)
        cos, sin = (c[:, None] for c in rope)  # [B, 1, T, D]
        bias = mask_bias(mask)[:, None, None]  # [B, 1, 1, T, S]
        if self.windowed:  # the local layers: their own keys and rope
            local_bias = mask_bias(window_mask(mask, position_ids, arch.sliding_window))[:, None, None]
            local_rope = rope if not arch.local_rope_theta else rope_cos_sin(position_ids, self.local_inv_freq,
                                                                           x.dtype)
            local_cos, local_sin = (c[:, None] for c in local_rope)
        tapped = {}
        for i, layer in enumerate(self.layers[:n]):
            if i in self.windowed:
                x = layer(x, local_cos, local_sin, local_bias, i, kv)
            else:
                x = layer(x, cos, sin, bias, i, kv)
            if i + 1 in taps:
                tapped[i + 1] = x
        hidden = torch.cat([tapped[t] for t in taps], dim=-1) if taps else None  # [B, T, k*C]
        if logit_rows is not None:
            x = x.reshape(-1, x.shape[-1])[logit_rows]  # [R, C]
        logits = self.lm_head(self.norm(x))
        if arch.final_softcap:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return ModelOutput(logits=logits, hidden=hidden)


def causal_mask(past: int, new: int, batch: int = 1) -> torch.Tensor:
    """Causal mask [B, T, S] for `new` tokens after `past` cached ones."""
    s = past + new
    rows = torch.arange(past, s)[:, None]  # [T, 1]
    return (torch.arange(s)[None, :] <= rows).expand(batch, new, s)
