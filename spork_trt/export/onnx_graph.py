"""Export the reference model (optionally its first N layers) to ONNX with io_spec's names and axes, through
lean.LeanGraph (the same math in fewer, larger ops); the learned draft head's step through lean.LeanHead."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from spork_trt import io_spec
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.export.lean import FEATURES, GQA_SLOTS, LeanGraph, LeanHead

OPSET = 17
GRAPH_LAYOUT = "lean-5"  # a build input: bump it when the exported graph changes, so older engines are rebuilt


def example_inputs(model: Transformer, n_layers: int, attention: str, past: int = 3, new: int = 2) -> tuple:
    cfg = model.cfg
    ids = torch.zeros(1, new, dtype=torch.long)
    pos = torch.arange(past, past + new)[None]
    mask = torch.ones(1, new, past + new, dtype=torch.bool)
    rows = torch.arange(new)  # [R]
    if attention == io_spec.GQA:
        lens = [torch.from_numpy(a) for a in io_spec.gqa_feeds([new], [past], past + new).values()]
        kv = [torch.zeros(1, cfg.n_kv_heads, past + new + 1, cfg.head_dim) for _ in range(2 * n_layers)]
        return (ids, pos, mask, rows, *lens, *kv)
    kv = [torch.zeros(1, past, cfg.n_kv_heads, cfg.head_dim) for _ in range(2 * n_layers)]
    return (ids, pos, mask, rows, *kv)


REFERENCE_FIX = "run it on the PyTorch reference engine (`python -m spork_trt generate --model PATH --dtype fp32`)"


def export_onnx(model: Transformer, out: Path, n_layers: int | None = None, taps: tuple[int, ...] = (),
                attention: str = io_spec.GQA) -> Path:
    """Write `out` (.onnx) with its weights in `out`.data; returns the path. `taps`: also output the hidden states
    after these layers (io_spec.HIDDEN: the learned draft head's features). `attention`: io_spec.GQA (ONNX Runtime
    CPU) or io_spec.PLAIN (standard ops only: TensorRT, ONNX Runtime's GPU providers)."""
    model.cfg.arch.require(FEATURES, "the ONNX export (export build)", REFERENCE_FIX)
    n = model.cfg.n_layers if n_layers is None else n_layers
    ins, outs = io_spec.inputs(model.cfg, n, attention), io_spec.outputs(model.cfg, n, taps, attention)
    return write_graph(LeanGraph(model.eval(), n, taps, attention).eval(), example_inputs(model, n, attention),
                       ins, outs, out)


def export_head_onnx(head, out: Path) -> Path:
    """Write the learned draft head's step (draft_head.DraftHead, either layout) as `out` (.onnx + .data):
    io_spec.head_inputs -> head_outputs, through lean.LeanHead."""
    cfg = head.hc.layer_config()
    past, new = 3, 2
    kv = torch.zeros(1, past, cfg.n_kv_heads, cfg.head_dim)
    example = (torch.zeros(1, new, cfg.dim), torch.zeros(1, new, cfg.dim), torch.arange(past, past + new)[None],
               torch.ones(1, new, past + new, dtype=torch.bool), kv, kv.clone())
    return write_graph(LeanHead(head.eval()).eval(), example, io_spec.head_inputs(cfg),
                       io_spec.head_outputs(cfg, head.hc.vocab), out)


def write_graph(module: torch.nn.Module, example: tuple, ins: list[io_spec.TensorSpec],
                outs: list[io_spec.TensorSpec], out: Path) -> Path:
    """Export `module` traced on `example` with io_spec's names and dims; weights in `out`.data; checked."""
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python-side shape arithmetic
        torch.onnx.export(module, example, str(tmp), dynamo=False, opset_version=OPSET,
                          input_names=[s.name for s in ins], output_names=[s.name for s in outs],
                          dynamic_axes=io_spec.dynamic_axes(ins + outs), do_constant_folding=True,
                          custom_opsets={"com.microsoft": 1})
    graph = onnx.load(str(tmp))
    place_gqa_inputs(graph)
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


def place_gqa_inputs(graph) -> None:
    """Move each GroupQueryAttention node's inputs to their schema slots (lean.GQA_SLOTS), the others empty."""
    for node in graph.graph.node:
        if node.op_type == "GroupQueryAttention":
            slots = [""] * (GQA_SLOTS[-1] + 1)
            for slot, name in zip(GQA_SLOTS, node.input, strict=True):
                slots[slot] = name
            del node.input[:]
            node.input.extend(slots)


def attention_of(path: Path) -> str:
    """The attention layout (io_spec.GQA or PLAIN) of an exported graph, read from its inputs."""
    import onnx

    return io_spec.attention_of(i.name for i in onnx.load(str(path), load_external_data=False).graph.input)


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
