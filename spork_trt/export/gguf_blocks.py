"""A target that computes a block-quantized checkpoint's own weights: its GGUF blocks kept, not requantized.

The default checkpoint is GGUF Q4_1 (and its tied embedding / LM head Q8_0): our fp32 graph holds those blocks
dequantized. Requantizing that fp32 graph (quantize.quantize_nbits, symmetric) changes the weights; this keeps
them. Every weight MatMul of the fp32 graph whose columns are rows of Q4_0, Q4_1 or Q8_0 tensors (found by their
dequantized values, so fusions like wqkv and gate_up and the rope row order need no bookkeeping) becomes
ONNX Runtime's MatMulNBits over the same blocks (block size 32, accuracy level 4: int8 activations):

  Q4_0  w = d (q - 8)         4 bits, the default zero point 8
  Q8_0  w = d q               8 bits, codes + 128 and the default zero point 128
  Q4_1  w = d (q - 8) + m'    4 bits, the default zero point 8, plus m' = m + 8 d (exact in fp32) times each
                              block's sum of x: y = MatMulNBits(x) + ReduceSum(x per block of 32) @ M'
                              M' [K/32, N]. The codes stay centred, so the kernel's int8 activations err on
                              (q - 8), as they do on any symmetric weight; with zero point 0 they would err on
                              q in 0..15 and bias every block (top-1 agreement with fp32 0.94 instead of ...)

Weight MatMuls from other tensor types are left for quantize.quantize_nbits. Checked on build: every replaced
weight, dequantized from the kept blocks, equals the fp32 graph's weight bit for bit.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from spork_trt.checkpoint.gguf_blocks import BLOCK, Blocks, read_blocks, rope_heads

ONNX_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the block types MatMulNBits takes as they are (its zero points 8 and 128)
BLOCKS_LAYOUT = "blocks-1"  # in the build's inputs: a change rebuilds int4 graphs made from a GGUF's blocks


def row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def find_rows(w: np.ndarray, index: dict[bytes, tuple[str, int]], blocks: dict[str, Blocks]) -> Blocks | None:
    """The kept blocks of weight w [K, N] (MatMul's layout: column n is output n), gathered from the tensors whose
    rows its columns are; None if any column is no kept row, or the columns mix kinds."""
    found = [index.get(row_key(col)) for col in w.T]
    if any(f is None for f in found) or len({blocks[name].kind for name, _ in found}) != 1:
        return None
    parts = [blocks[name] for name, _ in found]
    rows = [r for _, r in found]
    gather = lambda a: np.stack([p[r] for p, r in zip(a, rows)])  # noqa: E731
    kept = Blocks(parts[0].kind, gather([p.codes for p in parts]), gather([p.d for p in parts]),
                  None if parts[0].m is None else gather([p.m for p in parts]))
    return kept if np.array_equal(kept.dequantized(), w.T) else None


def keep_blocks(src: Path, out: Path, gguf_path: Path, rope: dict[str, int]) -> tuple[Path, int, int]:
    """src (fp32 .onnx) -> out with every weight MatMul that the checkpoint's blocks hold as MatMulNBits over them;
    returns (out, MatMuls replaced, weight MatMuls left)."""
    import onnx
    from onnx import numpy_helper

    from spork_trt.export.quantize import save_external

    blocks = read_blocks(gguf_path, rope, ONNX_KINDS)
    index = {row_key(row): (name, r) for name, b in blocks.items() for r, row in enumerate(b.dequantized())}
    model = onnx.load(str(src))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    shapes = onnx.shape_inference.infer_shapes(onnx.load(str(src), load_external_data=False)).graph
    rank = {v.name: len(v.type.tensor_type.shape.dim) for v in [*shapes.value_info, *shapes.input, *shapes.output]}
    nodes, replaced, left, used = [], 0, 0, set()
    for node in g.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            nodes.append(node)
            continue
        kept = find_rows(numpy_helper.to_array(inits[node.input[1]]), index, blocks)
        if kept is None:
            nodes.append(node)
            left += 1
            continue
        new, tensors = matmul_nbits(node, kept, rank.get(node.input[0], 3))
        nodes += new
        g.initializer.extend(tensors)
        used.add(node.input[1])
        replaced += 1
    del g.node[:]
    g.node.extend(nodes)
    still = {i for n in g.node for i in n.input}
    keep = [i for i in g.initializer if i.name not in used or i.name in still]
    del g.initializer[:]
    g.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return save_external(model, out), replaced, left


def matmul_nbits(node, kept: Blocks, rank: int) -> tuple[list, list]:
    """MatMul(x, W) -> MatMulNBits over `kept` (+ the Q4_1 offsets' term; x of `rank` dims); returns (nodes,
    initializers)."""
    from onnx import helper, numpy_helper

    n, k = kept.codes.shape
    nb, name, x = k // BLOCK, node.name or node.output[0], node.input[0]
    bits = 8 if kept.kind == "Q8_0" else 4
    c = kept.codes.reshape(n, nb, BLOCK)
    packed = c if bits == 8 else (c[..., 0::2] | (c[..., 1::2] << 4))  # [N, nb, 32 * bits / 8]
    tensors = [numpy_helper.from_array(np.ascontiguousarray(packed, dtype=np.uint8), f"{name}_B"),
               numpy_helper.from_array(kept.d.reshape(-1), f"{name}_scales")]
    inputs = [x, f"{name}_B", f"{name}_scales"]  # the default zero point: 8 (4 bits), 128 (8 bits)
    y = node.output[0]
    out = f"{name}_dq" if kept.m is not None else y
    nodes = [helper.make_node("MatMulNBits", inputs, [out], name=f"{name}_nbits", domain="com.microsoft", K=k, N=n,
                              bits=bits, block_size=BLOCK, accuracy_level=4)]
    if kept.m is not None:
        tensors += [numpy_helper.from_array(np.array([0] * (rank - 1) + [nb, BLOCK], np.int64), f"{name}_blocks"),
                    numpy_helper.from_array(np.array([-1], np.int64), f"{name}_last"),
                    numpy_helper.from_array(np.ascontiguousarray((kept.m + 8 * kept.d).T), f"{name}_m")]  # [nb, N]
        nodes += [helper.make_node("Reshape", [x, f"{name}_blocks"], [f"{name}_xb"], name=f"{name}_xb"),  # [..,nb,32]
                  helper.make_node("ReduceSum", [f"{name}_xb", f"{name}_last"], [f"{name}_xs"], keepdims=0,
                                   name=f"{name}_xs"),  # [..., nb]
                  helper.make_node("MatMul", [f"{name}_xs", f"{name}_m"], [f"{name}_off"], name=f"{name}_off"),
                  helper.make_node("Add", [out, f"{name}_off"], [y], name=f"{name}_add")]
    return nodes, tensors


def int4_from_blocks(fp32: Path, out: Path, ck) -> Path:
    """The int4 graph of a GGUF checkpoint `ck`: its Q4_0 / Q4_1 / Q8_0 blocks kept; any other weight MatMul
    (an F16 or K-quant tensor) requantized as quantize.quantize_nbits does."""
    from spork_trt.export.quantize import quantize_nbits, quiet

    path, replaced, left = keep_blocks(fp32, out, ck.path, rope_heads(ck.cfg))
    if left:
        with quiet():
            quantize_nbits(path, out, bits=4, exclude=offset_matmuls(path))
    return out


def offset_matmuls(path: Path) -> list[str]:
    """The Q4_1 offsets' MatMuls (x's block sums @ M'): float on purpose, never to be quantized."""
    import onnx

    return [n.name for n in onnx.load(str(path), load_external_data=False).graph.node if n.name.endswith("_off")]
