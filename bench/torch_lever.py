"""A lever on the forward, measured beside the engines (`bench roofline --torch bf16,fp32`, `bench fidelity --torch
bf16`): the build's checkpoint as our PyTorch reference model in another dtype, optionally compiled by torch.compile
(inductor, CPU, frozen weights). Not an engine: no KV pool and no engine core, so these rows say what the lever
could give, not what `serve` gives. The forward attends an exact-length context of `context` rows (random K/V:
timing only), the shape an engine's best case would have; logits at every new row, as a tree needs."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from spork_trt.checkpoint import manifest as mf
from spork_trt.errors import UserError
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.checkpoint.weights import load_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_dtypes(text: str, choices=DTYPES, flag: str = "--torch") -> list[str]:
    """A comma-separated list of dtypes, each one of `choices` (`flag` names the option in the error)."""
    names = [d for d in text.split(",") if d]
    bad = [d for d in names if d not in choices]
    if bad:
        raise UserError(f"{flag}: unknown dtype {', '.join(bad)} (choose from {', '.join(choices)})")
    return names


class ContextKV:
    """model.KVStore over a fixed context per layer: a layer attends its context's rows then the new ones; nothing
    is written back (every timed forward sees the same context)."""

    def __init__(self, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        self.ks, self.vs = ks, vs  # [L] x [B, Hkv, context, D]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.ks[layer], k], 2), torch.cat([self.vs[layer], v], 2)  # [B, Hkv, context + T, D]


def reference_model(build: Path, dtype: str) -> Transformer:
    """The build's own checkpoint (manifest source) as the reference model in `dtype`; RoPE frequencies stay fp32,
    as on the device engine (in bf16, positions past 256 lose their angles: top-1 vs fp32 0.84 at 512 tokens)."""
    fp32 = load_checkpoint(mf.read(build)["source"]["path"]).model
    model = copy.deepcopy(fp32).to(DTYPES[dtype]).eval()
    model.inv_freq = fp32.inv_freq
    return model


def weight_cost(model: Transformer) -> tuple[int, int]:
    """(bytes, parameters) of the model's Linear weights (the LM head once, the embedding a lookup)."""
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return params * next(model.parameters()).element_size(), params


def forward_fn(model: Transformer, compiled: bool):
    """f(input_ids [B, T], position_ids [B, T], mask [B, T, S], ks, vs) -> logits [B*T, V]."""
    def f(ids, pos, mask, ks, vs):
        return model(ids, pos, mask, kv=ContextKV(ks, vs), logit_rows=torch.arange(ids.numel())).logits
    if not compiled:
        return f
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    # every shape and dtype compiles `f` again (one code object): past dynamo's default limit of 8 it ran eagerly
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 256)
    inductor.freezing = True  # weights are constants: inductor prepacks them for its matmuls
    return torch.compile(f, dynamic=False)


def shape_inputs(model: Transformer, b: int, t: int, context: int, seed: int = 0) -> tuple:
    """Inputs of one forward of B sequences x T new tokens after `context` rows (a causal chain per sequence)."""
    cfg, g = model.cfg, torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    pos = (context + torch.arange(t)).expand(b, t).contiguous()
    mask = torch.ones(b, t, context + t, dtype=torch.bool)
    mask[:, :, context:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
    kv = [[(torch.randn(b, cfg.n_kv_heads, context, cfg.head_dim, generator=g) * 0.1).to(dtype)
           for _ in range(cfg.n_layers)] for _ in range(2)]
    return ids, pos, mask, kv[0], kv[1]


def teacher_forced(model: Transformer, ids: list[int]) -> torch.Tensor:
    """[T, V] fp32 logits over one chunk from position 0 (bench fidelity's rows)."""
    n = len(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.arange(n)[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None])
    return out.logits[0].float()
