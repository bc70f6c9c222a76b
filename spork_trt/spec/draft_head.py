"""The learned draft head (EAGLE family): one decoder layer over the target's own hidden states.

At position p it reads a feature g_p and the embedding of the next token x_{p+1}, and predicts x_{p+2} over a
truncated draft vocabulary (the N most frequent tokens of the target's own text; `d2t` maps draft ids back to target
ids). g_p is the target's hidden states at p after the tapped layers, fused by a linear map (one tap: EAGLE-1's
last hidden state; several: EAGLE-3's feature fusion), or, deeper in a draft, the head's own output at p - 1.

    g = fuse(features [k*C])  or  own output h [C]
    h = Block(fc([embedding(x_{p+1}); g]))     one Llama decoder layer, causal over the head's own KV
    logits = lm_head(norm(h))                  [N], N << V

The head holds no embedding table: the caller passes the target's embeddings (the target's own weights), so the
shipped head stays a few MB.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from spork_trt import atomic
from spork_trt.config import ModelConfig
from spork_trt.errors import UserError
from spork_trt.checkpoint.transformer import (
    MLP,
    Attention,
    Block,
    KVStore,
    RMSNorm,
    mask_bias,
    rope_cos_sin,
    rope_inv_freq,
)

HEAD_FILE = "head.safetensors"
HEAD_GRAPH = "head.onnx"  # a build's export of the head's step (ONNX Runtime drafts with it)
LAYOUTS = ("eagle1", "eagle3")
EMBEDDINGS = "head_embeddings.npy"  # a build's copy of the target's token embeddings [V, C] fp16, for the head


def target_to_draft(d2t: torch.Tensor, v: int) -> torch.Tensor:
    """[V] target id -> draft id, -100 (ignored by the loss) outside the draft vocabulary; `d2t` [N]."""
    t2d = torch.full((v,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


@dataclass(frozen=True)
class HeadConfig:
    dim: int  # the target's hidden size C
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    taps: tuple[int, ...]  # target layers (counted from 1) whose outputs are the features
    vocab: int  # draft vocabulary size N
    target_vocab: int  # V
    # eagle1: fc([emb; g]) -> a Llama decoder layer (what train-draft trains); eagle3: EAGLE-3's layer, attention
    # over [input_norm(emb); hidden_norm(g)] with g as the residual (published heads, `export convert-head`)
    layout: str = "eagle1"
    # eagle1: g passes an RMSNorm before fc (initialised to the target's final norm for a last-layer tap: EAGLE-1's
    # post-norm features). The raw residual stream has outlier channels ~100x its median that drown the token's
    # embedding in fc; heads saved before this field existed have none.
    feature_norm: bool = False

    @classmethod
    def for_target(cls, cfg: ModelConfig, taps: tuple[int, ...], vocab: int,
                   feature_norm: bool = True) -> HeadConfig:
        if not taps or any(not 1 <= t <= cfg.n_layers for t in taps):
            raise UserError(f"--taps must name target layers in 1..{cfg.n_layers}, got {taps}")
        if not 1 <= vocab <= cfg.vocab_size:
            raise UserError(f"--vocab must be in 1..{cfg.vocab_size} (the target's vocabulary), got {vocab}")
        return cls(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.norm_eps, cfg.rope_theta,
                   tuple(taps), vocab, cfg.vocab_size, feature_norm=feature_norm)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab, dim=self.dim, n_layers=1, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, ffn_dim=self.ffn_dim, head_dim=self.head_dim,
                           norm_eps=self.norm_eps, rope_theta=self.rope_theta)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads [input_norm(emb); hidden_norm(g)] (2C wide), g is the residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        c, hd = cfg.dim, cfg.head_dim
        self.input_norm, self.hidden_norm = RMSNorm(c, cfg.norm_eps), RMSNorm(c, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.attn.wq = nn.Linear(2 * c, cfg.n_heads * hd, bias=False)
        self.attn.wk = nn.Linear(2 * c, cfg.n_kv_heads * hd, bias=False)
        self.attn.wv = nn.Linear(2 * c, cfg.n_kv_heads * hd, bias=False)
        self.mlp_norm = RMSNorm(c, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, g, cos, sin, bias, kv):
        x = torch.cat([self.input_norm(emb), self.hidden_norm(g)], dim=-1)  # [B, T, 2C]
        h = g + self.attn(x, cos, sin, bias, 0, kv)
        return h + self.mlp(self.mlp_norm(h))


class DraftHead(nn.Module):
    def __init__(self, hc: HeadConfig) -> None:
        super().__init__()
        if hc.layout not in LAYOUTS:
            raise UserError(f"unknown draft head layout {hc.layout!r}: {', '.join(LAYOUTS)}")
        self.hc = hc
        c = hc.dim
        self.fuse = nn.Linear(len(hc.taps) * c, c, bias=False)
        self.gnorm = None
        if hc.layout == "eagle3":
            self.layer = Eagle3Layer(hc.layer_config())
        else:
            self.fc = nn.Linear(2 * c, c, bias=False)
            self.layer = Block(hc.layer_config())
            self.gnorm = RMSNorm(c, hc.norm_eps) if hc.feature_norm else None
        self.norm = RMSNorm(c, hc.norm_eps)
        self.lm_head = nn.Linear(c, hc.vocab, bias=False)
        self.register_buffer("d2t", torch.arange(hc.vocab, dtype=torch.long))  # [N] draft id -> target id
        self.register_buffer("inv_freq", rope_inv_freq(hc.layer_config()), persistent=False)  # [D/2]

    def init_from_target(self, target, d2t: torch.Tensor) -> None:
        """LM head rows copied from the target's (for the draft vocabulary), its final norm, `d2t` [N]."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.lm_head.weight.copy_(target.lm_head.weight[d2t])
            self.norm.weight.copy_(target.norm.weight)
            if getattr(self, "gnorm", None) is not None and self.hc.taps == (target.cfg.n_layers,):
                self.gnorm.weight.copy_(target.norm.weight)  # g = the target's post-norm last hidden state

    def forward(self, emb: torch.Tensor, g: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                kv: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """emb [B, T, C] embeddings of x_{p+1}; g [B, T, C] fused features (or own outputs); position_ids [B, T];
        mask [B, T, S] -> (h [B, T, C], logits [B, T, N])."""
        cos, sin = (t[:, None] for t in rope_cos_sin(position_ids, self.inv_freq, g.dtype))  # [B, 1, T, D]
        bias = mask_bias(mask)[:, None, None]  # [B, 1, 1, T, S]
        if self.hc.layout == "eagle3":
            h = self.layer(emb, g, cos, sin, bias, kv)  # [B, T, C]
        else:
            g = g if self.gnorm is None else self.gnorm(g)
            h = self.layer(self.fc(torch.cat([emb, g], dim=-1)), cos, sin, bias, 0, kv)  # [B, T, C]
        return h, self.lm_head(self.norm(h))

    def save(self, d: Path, meta: dict) -> Path:
        """head.safetensors (fp16 weights, d2t, the config and `meta` in its metadata)."""
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        with atomic.path(d / HEAD_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"config": json.dumps(asdict(self.hc)), "meta": json.dumps(meta)})
        return d / HEAD_FILE


def load_head(path: Path) -> tuple[DraftHead, dict]:
    """A head saved by DraftHead.save (safetensors: no pickle), in fp32; (head, its meta)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        raw = json.loads(md["config"])
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"{path} is not a draft head saved by `python -m export train-draft` ({e})") from None
    hc = HeadConfig(**{**raw, "taps": tuple(raw["taps"])})
    head = DraftHead(hc)
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    return head.eval(), json.loads(md.get("meta", "{}"))
