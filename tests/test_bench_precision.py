"""bench fidelity's comparison and bench roofline's weight accounting, on tiny graphs (no build, no timing)."""
from __future__ import annotations

import torch

from bench.fidelity import compare
from bench.roofline import weight_cost
from spork_trt.export.onnx_graph import export_onnx
from spork_trt.export.quantize import quantize
from spork_trt.checkpoint.weights import random_checkpoint
from tests.conftest import tiny_config


def test_fidelity_of_a_target_with_itself_is_perfect_and_of_another_is_not():
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 50, (20,), generator=g).tolist() for _ in range(2)]
    ref = [torch.randn(20, 50, generator=g) for _ in texts]
    top1, kl, p99, ppl, ref_ppl = compare(ref, ref, texts)
    assert top1 == 1.0 and kl < 1e-9 and p99 < 1e-9 and abs(ppl - ref_ppl) < 1e-9
    other = [r + 2 * torch.randn(r.shape, generator=g) for r in ref]
    top1, kl, p99, ppl, _ = compare(ref, other, texts)
    assert top1 < 0.9 and 0 < kl < p99


def test_roofline_counts_each_weight_matmul_once(tmp_path):
    cfg = tiny_config(vocab_size=64, n_layers=2, dim=64)
    model = random_checkpoint(cfg, seed=1).model
    fp32 = export_onnx(model, tmp_path / "t.onnx")
    params = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2
                 and not n.startswith("embed"))
    params += 0 if not cfg.tie_embeddings else model.embed.weight.numel()  # the tied LM head is a MatMul too
    nbytes, counted = weight_cost(fp32)
    assert counted == params and nbytes == 4 * params
    q_bytes, q_params = weight_cost(quantize("int4", fp32, tmp_path / "q.onnx"))
    assert q_params == params and params / 2 <= q_bytes < nbytes / 4  # 4 bits a weight and a scale per 32


class Recording:
    """model.KVStore that keeps each layer's K/V rows of one forward from position 0."""

    def __init__(self) -> None:
        self.ks, self.vs = {}, {}

    def update(self, layer, k, v):
        self.ks[layer], self.vs[layer] = k, v
        return k, v


def test_the_torch_lever_computes_the_models_own_logits_after_a_context_eager_and_compiled(tmp_path, monkeypatch):
    import pytest

    # inductor's own cache dir, not the shared /tmp/torchinductor_$USER: a process killed mid-compile leaves a
    # truncated .so there that fails every later run on this machine ("file too short")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    from bench import torch_lever
    from spork_trt.errors import UserError

    cfg = tiny_config(vocab_size=64, n_layers=2, dim=64)
    model = random_checkpoint(cfg, seed=2).model.eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    ctx, t = 8, 4
    rec = Recording()
    with torch.no_grad():
        full = model(ids, torch.arange(12)[None], torch.tril(torch.ones(12, 12, dtype=torch.bool))[None]).logits
        model(ids[:, :ctx], torch.arange(ctx)[None], torch.tril(torch.ones(ctx, ctx, dtype=torch.bool))[None], kv=rec)
        _, pos, mask, _, _ = torch_lever.shape_inputs(model, 1, t, ctx)
        args = (ids[:, ctx:], pos, mask, [rec.ks[i] for i in range(2)], [rec.vs[i] for i in range(2)])
        eager = torch_lever.forward_fn(model, compiled=False)(*args)  # [T, V]
        compiled = torch_lever.forward_fn(model, compiled=True)(*args)
    torch.testing.assert_close(eager, full[0, ctx:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    nbytes, params = torch_lever.weight_cost(model.to(torch.bfloat16))
    assert nbytes == 2 * params and params == sum(m.weight.numel() for m in model.modules()
                                                  if isinstance(m, torch.nn.Linear))
    with pytest.raises(UserError, match="fp16"):
        torch_lever.parse_dtypes("bf16,fp16")
    from spork_trt.config import CPU_TORCH_DTYPES
    assert torch_lever.parse_dtypes("int4,bf16", CPU_TORCH_DTYPES, "--cpu-torch") == ["int4", "bf16"]
    with pytest.raises(UserError, match="--cpu-torch: unknown dtype fp16"):
        torch_lever.parse_dtypes("int4,fp16", CPU_TORCH_DTYPES, "--cpu-torch")
