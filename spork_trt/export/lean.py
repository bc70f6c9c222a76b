"""The exported decoder: model.Transformer's math, laid out for inference engines (fewer, larger ops).

At one new token a decode step of the 135M default is a few dozen small matrix products; ONNX Runtime's per-node
cost was a third of the step with the reference module's trace (about 2,200 nodes after its optimizations). Here:
- the q, k, v projections are one MatMul (weights concatenated at export), and so are gate and up;
- rotate_half is one MatMul by a constant signed permutation [D, D] (exact: one nonzero term per output), applied
  to q and k together;
- every reshape is a constant ONNX Reshape (0 = keep that dim, one -1 for the rest): no shape arithmetic;
- the attention bias is built once per forward, tiled for the G query heads that share a KV head;
- new K/V rows come out in io_spec's [B, T, Hkv, D] layout without a transpose;
- with io_spec.GQA the attention core (scores, mask, softmax, values, the KV append) is one GroupQueryAttention op,
  and the batch's tokens are packed: every other op runs on the N real tokens, the op on them gathered to [B, T].
What a family does beyond Llama (config.Architecture) is read from the reference modules, never from a family's
name: q/k/v biases ride on the fused projection, q and k norms are one norm over [H + Hkv, D] with each head's
weight, sandwich norms and the MLP's activation are the reference's own modules, the windowed layers get their own
bias (the mask limited to the window, as model.window_mask) and rope tables, the query scale is the attention's (the
GQA op's `scale`), the logits are soft-capped where the family caps them.
Same inputs, outputs and element-wise order of operations as the reference; parity is tested (test_onnx_engine,
test_families).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spork_trt.config import EVERY_FEATURE
from spork_trt.io_spec import GQA, PLAIN
from spork_trt.checkpoint.transformer import RMSNorm, Transformer, mask_bias, rope_cos_sin, window_mask


FEATURES = EVERY_FEATURE  # what the graph does beyond Llama's decoder (config.Architecture.features)


class Reshape(torch.autograd.Function):
    """x.reshape(shape) where 0 keeps x's dim: exported as one Reshape with a constant shape."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape)])

    @staticmethod
    def symbolic(g, x, shape):
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


def reshape(x: torch.Tensor, *shape: int) -> torch.Tensor:
    return Reshape.apply(x, shape)


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (their biases too, where they have them)."""
    w = torch.cat([p.weight.detach() for p in parts], dim=0)  # [sum(out), in]
    biased = parts[0].bias is not None
    out = nn.Linear(w.shape[1], w.shape[0], bias=biased)
    out.weight = nn.Parameter(w, requires_grad=False)
    if biased:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)  # [sum(out)]
    return out


def head_norm_weight(ref, n_heads: int, n_kv_heads: int) -> torch.Tensor | None:
    """The attention's q and k norms as one weight [H + Hkv, D] (each head its norm's row), or None without them."""
    if ref.q_norm is None:
        return None
    return torch.cat([ref.q_norm.weight.detach().expand(n_heads, -1), ref.k_norm.weight.detach().expand(n_kv_heads, -1)])


def scaled(scores: torch.Tensor, query_scale: float, d: int) -> torch.Tensor:
    """q @ k scaled as the reference scales it: by the family's query scale, else / sqrt(D) (Llama's bits)."""
    return scores * query_scale if query_scale else scores / math.sqrt(d)


def rotate_half_matrix(d: int) -> torch.Tensor:
    """R [D, D] with x @ R == model.rotate_half(x) == cat(-x[D/2:], x[:D/2])."""
    h = d // 2
    r = torch.zeros(d, d)
    r[torch.arange(h) + h, torch.arange(h)] = -1.0
    r[torch.arange(h), torch.arange(h) + h] = 1.0
    return r


class Gather(torch.autograd.Function):
    """data[index] along dim 0 (data [N, X], index of any shape): exported as one Gather."""

    @staticmethod
    def forward(ctx, data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return data[index]

    @staticmethod
    def symbolic(g, data, index):
        return g.op("Gather", data, index, axis_i=0)


class GroupQueryAttention(torch.autograd.Function):
    """ONNX Runtime's com.microsoft GroupQueryAttention with a shared past/present buffer, rotary applied before it
    and the tree masks as attention_bias: exported as that one op; this forward is its semantics in torch (for
    the exporter's trace and for tests). q [B, T, H*D], k, v [B, T, Hkv*D], past_k, past_v [B, Hkv, M, D];
    query_seqlens [B] (rows past n_b are padding), seqlens_k [B] (context_b + n_b - 1), total () = S; bias
    [B, 1, T, S] over absolute key positions -> out [B, T, H*D], present_k, present_v [B, Hkv, M, D] (the new rows
    written at [context_b, context_b + n_b))."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, query_seqlens, seqlens_k, total, bias, heads: int, kv_heads: int,
                scale: float = 0.0):
        b, t, _ = q.shape
        d = past_k.shape[-1]
        present_k, present_v = past_k.clone(), past_v.clone()
        n = query_seqlens.long()
        base = seqlens_k.long() + 1 - n  # [B] context lengths
        s = int(total)
        keys_pos = torch.arange(s)  # [S]
        qpos = base[:, None] + torch.arange(t)  # [B, T] absolute positions of the query rows
        for i in range(b):
            rows = slice(int(base[i]), int(base[i] + n[i]))
            present_k[i, :, rows] = k[i, :n[i]].reshape(-1, kv_heads, d).transpose(0, 1)
            present_v[i, :, rows] = v[i, :n[i]].reshape(-1, kv_heads, d).transpose(0, 1)
        g = heads // kv_heads
        keys = present_k[:, :, :s].repeat_interleave(g, dim=1)  # [B, H, S, D]
        values = present_v[:, :, :s].repeat_interleave(g, dim=1)
        qh = q.reshape(b, t, heads, d).transpose(1, 2)  # [B, H, T, D]
        scores = scaled(qh @ keys.transpose(2, 3), scale, d) + bias  # [B, H, T, S]
        causal = keys_pos[None, None, None, :] > qpos[:, None, :, None]  # [B, 1, T, S]
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return (probs @ values).transpose(1, 2).reshape(b, t, heads * d), present_k, present_v

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, query_seqlens, seqlens_k, total, bias, heads, kv_heads, scale=0.0):
        # inputs 7-9 (cos_cache, sin_cache, position_ids) and 11-15 stay empty: onnx_graph.export_onnx writes the
        # empty slots after the export (GQA_SLOTS)
        extra = {"scale_f": scale} if scale else {}  # unset: the op's 1 / sqrt(D) (Llama's graph as it was)
        outs = g.op("com.microsoft::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total, bias,
                    query_seqlens, num_heads_i=heads, kv_num_heads_i=kv_heads, causal_i=1, outputs=3, **extra)
        for out, like in zip(outs, (q, past_k, past_v)):  # the exporter infers no shapes for a custom op
            out.setType(like.type())
        return outs


# GroupQueryAttention's input slots of the inputs the symbolic passes, in order (the schema's 17 inputs)
GQA_SLOTS = (0, 1, 2, 3, 4, 5, 6, 10, 16)


class LeanAttention(nn.Module):
    def __init__(self, ref, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, self.hkv, self.d = n_heads, n_kv_heads, head_dim
        self.wqkv = fused_linear(ref.wq, ref.wk, ref.wv)
        self.wo = ref.wo
        self.query_scale = ref.query_scale  # 0: / sqrt(D)
        self.register_buffer("rot", rotate_half_matrix(head_dim), persistent=False)  # [D, D]
        norm = head_norm_weight(ref, n_heads, n_kv_heads)  # [H + Hkv, D] or None
        self.qk_norm = None if norm is None else RMSNorm(head_dim, ref.q_norm.eps)
        if norm is not None:
            self.qk_norm.weight = nn.Parameter(norm, requires_grad=False)

    def qkv(self, x, cos, sin):
        """x [B, T, C]; cos, sin [B, T, 1, D] -> q [B, T, H, D], k, v [B, T, Hkv, D] (q and k normed where the
        family norms them, then rotated)."""
        h, hkv, d = self.h, self.hkv, self.d
        y = reshape(self.wqkv(x), 0, -1, h + 2 * hkv, d)  # [B, T, H + 2 Hkv, D]
        qk, v = y[:, :, :h + hkv], y[:, :, h + hkv:]  # [B, T, H + Hkv, D], [B, T, Hkv, D]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = qk * cos + (qk @ self.rot) * sin
        return qk[:, :, :h], qk[:, :, h:], v

    def forward(self, x, cos, sin, bias, past_k, past_v):
        # x [B, T, C]; cos, sin [B, T, 1, D]; bias [B, 1, G*T, S]; past_k, past_v [B, P, Hkv, D]
        h, hkv, d = self.h, self.hkv, self.d
        q, k, v = self.qkv(x, cos, sin)  # [B, T, H, D], [B, T, Hkv, D] x2
        keys, values = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)  # [B, S, Hkv, D]
        q = reshape(q.transpose(1, 2), 0, hkv, -1, d)  # [B, Hkv, G*T, D]: query head h uses kv head h // G
        scores = scaled(q @ keys.permute(0, 2, 3, 1), self.query_scale, d)  # [B, Hkv, G*T, S]
        probs = torch.softmax(scores + bias, dim=-1)
        out = reshape(probs @ values.transpose(1, 2), 0, h, -1, d)  # [B, H, T, D]
        return self.wo(reshape(out.transpose(1, 2), 0, -1, h * d)), k, v  # [B, T, C], new rows [B, T, Hkv, D] x2

    def forward_gqa(self, x, cos, sin, bias, past_k, past_v, lens):
        # x [1, N, C] packed; cos, sin [1, N, 1, D]; bias [B, 1, T, S]; past_k, past_v [B, Hkv, M, D] (bound in
        # place); lens: query_seqlens [B], seqlens_k [B], total (), padded_rows [B, T], packed_rows [N]
        h, hkv, d = self.h, self.hkv, self.d
        *lens, padded, packed = lens
        q, k, v = (Gather.apply(reshape(t, -1, n * d), padded)  # [B, T, H*D], [B, T, Hkv*D] x2
                   for t, n in zip(self.qkv(x, cos, sin), (h, hkv, hkv)))
        out, pk, pv = GroupQueryAttention.apply(q, k, v, past_k, past_v, *lens, bias, h, hkv,
                                                self.query_scale)  # [B, T, H*D]
        out = Gather.apply(reshape(out, -1, h * d), packed)  # [N, H*D]: the real rows, packed again
        return self.wo(reshape(out, 1, -1, h * d)), pk, pv  # [1, N, C], present [B, Hkv, M, D] x2


class LeanMLP(nn.Module):
    def __init__(self, ref) -> None:
        super().__init__()
        self.f = ref.gate.out_features
        self.gate_up = fused_linear(ref.gate, ref.up)
        self.down = ref.down
        self.act = ref.act  # silu, or the family's (model.ACTIVATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x)  # [B, T, 2F]
        return self.down(self.act(y[..., :self.f]) * y[..., self.f:])


class LeanBlock(nn.Module):
    def __init__(self, ref, cfg) -> None:
        super().__init__()
        self.attn_norm: RMSNorm = ref.attn_norm
        self.attn = LeanAttention(ref.attn, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.mlp_norm: RMSNorm = ref.mlp_norm
        self.mlp = LeanMLP(ref.mlp)
        self.post_attn_norm, self.post_mlp_norm = ref.post_attn_norm, ref.post_mlp_norm  # sandwich norms, or None

    def forward(self, x, cos, sin, bias, past_k, past_v, lens=None):
        h = self.attn_norm(x)
        a, k, v = (self.attn(h, cos, sin, bias, past_k, past_v) if lens is None
                   else self.attn.forward_gqa(h, cos, sin, bias, past_k, past_v, lens))
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m)), k, v


class LeanGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, logit_rows[, query_seqlens, seqlens_k, total, padded_rows,
    packed_rows], *past) ->
    (logits [R, V], *new kv[, hidden]) over the first `n_layers` layers (io_spec's inputs and outputs for
    `attention`)."""

    def __init__(self, model: Transformer, n_layers: int, taps: tuple[int, ...] = (), attention: str = PLAIN) -> None:
        super().__init__()
        self.taps = taps  # also output the hidden states after these layers (io_spec.HIDDEN)
        self.gqa = attention == GQA
        cfg = model.cfg
        self.g, self.dim = cfg.n_heads // cfg.n_kv_heads, cfg.dim
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head
        self.layers = nn.ModuleList(LeanBlock(b, cfg) for b in model.layers[:n_layers])
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)  # [D/2]
        self.register_buffer("local_inv_freq", model.local_inv_freq, persistent=False)  # [D/2]
        self.arch, self.windowed = cfg.arch, model.windowed  # the family's extras; the windowed layers' indices

    def forward(self, input_ids, position_ids, attention_mask, logit_rows, *past):
        # input_ids, position_ids [B, T] (GQA: [1, N] packed); attention_mask [B, T, S] bool; logit_rows [R] flat
        # indices into [B, T] (GQA: into [N]); GQA: query_seqlens, seqlens_k [B] int32, total () int32,
        # padded_rows [B, T], packed_rows [N], then key, value [B, Hkv, M, D] per layer; PLAIN: key, value
        # [B, P, Hkv, D] per layer
        lens, past = (past[:5], past[5:]) if self.gqa else (None, past)
        x = self.embed(input_ids)  # [B, T, C] (GQA: [1, N, C])
        if self.arch.embed_scale:
            x = x * torch.tensor(self.dim ** 0.5, dtype=x.dtype)
        glob = self.attention_inputs(position_ids, attention_mask, self.inv_freq, 0, lens, x.dtype)
        local = (self.attention_inputs(position_ids, attention_mask, self.local_inv_freq, self.arch.sliding_window,
                                       lens, x.dtype) if self.windowed else None)
        new, tapped = [], {}
        for i, layer in enumerate(self.layers):
            cos, sin, bias = local if i in self.windowed else glob
            x, k, v = layer(x, cos, sin, bias, past[2 * i], past[2 * i + 1], lens)
            new += [k, v]
            tapped[i + 1] = x
        hidden = [torch.cat([tapped[t] for t in self.taps], dim=-1)] if self.taps else []  # [B, T, k*C] (GQA:
        # [1, N, k*C])
        x = reshape(x, -1, self.dim)[logit_rows]  # [R, C]: the LM head runs at the asked-for rows only
        logits = self.lm_head(self.norm(x))  # [R, V]
        if self.arch.final_softcap:
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return (logits, *new, *hidden)

    def attention_inputs(self, position_ids, attention_mask, inv_freq, window: int, lens, dtype):
        """cos, sin [B, T, 1, D] for `inv_freq`, and the attention bias [B, 1, T, S] (PLAIN: [B, 1, G*T, S]),
        limited to `window` positions where it is not 0 (GQA: the packed rows' positions gathered to [B, T])."""
        cos, sin = (c[:, :, None] for c in rope_cos_sin(position_ids, inv_freq, dtype))  # [B, T, 1, D]
        if window:
            pos = position_ids if lens is None else Gather.apply(reshape(position_ids, -1), lens[3])  # [B, T]
            attention_mask = window_mask(attention_mask, pos, window)
        bias = mask_bias(attention_mask)[:, None]  # [B, 1, T, S]
        if not self.gqa:
            bias = bias.repeat(1, 1, self.g, 1)  # [B, 1, G*T, S]
        return cos, sin, bias


class LeanEagle3Layer(nn.Module):
    """draft_head.Eagle3Layer in LeanBlock's ops: attention over [input_norm(emb); hidden_norm(g)] (2C wide, q/k/v
    one MatMul), g the residual, then the MLP."""

    def __init__(self, ref, cfg) -> None:
        super().__init__()
        self.input_norm, self.hidden_norm, self.mlp_norm = ref.input_norm, ref.hidden_norm, ref.mlp_norm
        self.attn = LeanAttention(ref.attn, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.mlp = LeanMLP(ref.mlp)

    def forward(self, emb, g, cos, sin, bias, past_k, past_v):
        x = torch.cat([self.input_norm(emb), self.hidden_norm(g)], dim=-1)  # [1, T, 2C]
        a, k, v = self.attn(x, cos, sin, bias, past_k, past_v)  # [1, T, C], [1, T, Hkv, D] x2
        h = g + a
        return h + self.mlp(self.mlp_norm(h)), k, v


class LeanHead(nn.Module):
    """The learned draft head's step (draft_head.DraftHead, layout eagle1 or eagle3) in LeanBlock's ops: (emb [1, T,
    C], g [1, T, C], position_ids [1, T], attention_mask [1, T, S], past_key, past_value [1, P, Hkv, D]) -> (h [1, T,
    C], logits [1, T, N], new_key, new_value [1, T, Hkv, D]); S = P + T (io_spec.PLAIN's one-layer layout)."""

    def __init__(self, head) -> None:
        super().__init__()
        cfg = head.hc.layer_config()
        self.g = cfg.n_heads // cfg.n_kv_heads
        self.norm, self.lm_head = head.norm, head.lm_head
        self.eagle3 = head.hc.layout == "eagle3"
        if self.eagle3:
            self.layer = LeanEagle3Layer(head.layer, cfg)
        else:
            self.fc, self.gnorm = head.fc, head.gnorm
            self.block = LeanBlock(head.layer, cfg)
        self.register_buffer("inv_freq", head.inv_freq, persistent=False)  # [D/2]

    def forward(self, emb, g, position_ids, attention_mask, past_k, past_v):
        cos, sin = (c[:, :, None] for c in rope_cos_sin(position_ids, self.inv_freq, g.dtype))  # [1, T, 1, D]
        bias = mask_bias(attention_mask)[:, None].repeat(1, 1, self.g, 1)  # [1, 1, G*T, S]
        if self.eagle3:
            h, k, v = self.layer(emb, g, cos, sin, bias, past_k, past_v)  # [1, T, C], [1, T, Hkv, D] x2
        else:
            g = g if self.gnorm is None else self.gnorm(g)
            x = self.fc(torch.cat([emb, g], dim=-1))  # [1, T, C]
            h, k, v = self.block(x, cos, sin, bias, past_k, past_v)  # [1, T, C], [1, T, Hkv, D] x2
        return h, self.lm_head(self.norm(h)), k, v
