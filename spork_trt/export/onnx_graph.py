"""Export the reference model (optionally its first N layers) to ONNX with io_spec's names and axes."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from .. import io_spec
from ..model import Transformer

OPSET = 17


class ConcatKV:
    """KVStore for export: attends to past rows (graph inputs) + new rows, and records the new rows as outputs."""

    def __init__(self, past: list[torch.Tensor]) -> None:
        self.past = past  # per layer: key, value [B, P, Hkv, D]
        self.new: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v [B, Hkv, T, D]
        self.new += [k.transpose(1, 2), v.transpose(1, 2)]  # [B, T, Hkv, D]
        pk, pv = self.past[2 * layer].transpose(1, 2), self.past[2 * layer + 1].transpose(1, 2)
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # [B, Hkv, S, D]


class GraphModule(nn.Module):
    """Flat-argument wrapper: (input_ids, position_ids, attention_mask, *past) -> (logits, *new kv)."""

    def __init__(self, model: Transformer, n_layers: int) -> None:
        super().__init__()
        self.model, self.n_layers = model, n_layers

    def forward(self, input_ids, position_ids, attention_mask, *past):
        kv = ConcatKV(list(past))
        out = self.model(input_ids, position_ids, attention_mask, kv, exit_layer=self.n_layers)
        return (out.logits, *kv.new)


def example_inputs(model: Transformer, n_layers: int, past: int = 3, new: int = 2) -> tuple:
    cfg = model.cfg
    ids = torch.zeros(1, new, dtype=torch.long)
    pos = torch.arange(past, past + new)[None]
    mask = torch.ones(1, new, past + new, dtype=torch.bool)
    kv = [torch.zeros(1, past, cfg.n_kv_heads, cfg.head_dim) for _ in range(2 * n_layers)]
    return (ids, pos, mask, *kv)


def export_onnx(model: Transformer, out: Path, n_layers: int | None = None) -> Path:
    """Write `out` (.onnx) with its weights in `out`.data; returns the path."""
    import onnx

    n = model.cfg.n_layers if n_layers is None else n_layers
    ins, outs = io_spec.inputs(model.cfg, n), io_spec.outputs(model.cfg, n)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python-side shape arithmetic
        torch.onnx.export(GraphModule(model.eval(), n), example_inputs(model, n), str(tmp), dynamo=False,
                          opset_version=OPSET, input_names=[s.name for s in ins], output_names=[s.name for s in outs],
                          dynamic_axes=io_spec.dynamic_axes(ins + outs), do_constant_folding=True)
    graph = onnx.load(str(tmp))
    declare_shapes(graph, ins, outs)
    tmp.unlink()
    for f in tmp.parent.glob(tmp.name + "*"):
        f.unlink()
    data = out.name + ".data"
    if (out.parent / data).exists():
        (out.parent / data).unlink()
    onnx.save_model(graph, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    onnx.checker.check_model(str(out))
    return out


def declare_shapes(graph, ins: list[io_spec.TensorSpec], outs: list[io_spec.TensorSpec]) -> None:
    """Write io_spec's dims onto the graph's inputs and outputs (the exporter's inferred names are arbitrary)."""
    for vi, spec in zip(list(graph.graph.input) + list(graph.graph.output), ins + outs):
        assert vi.name == spec.name, (vi.name, spec.name)
        dims = vi.type.tensor_type.shape.dim
        assert len(dims) == len(spec.dims), (vi.name, len(dims), spec.dims)
        for dim, want in zip(dims, spec.dims):
            if isinstance(want, str):
                dim.dim_param = want
            else:
                dim.dim_value = want
