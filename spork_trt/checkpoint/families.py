"""The supported families as data: a checkpoint's config (a Hugging Face `config.json`, or GGUF metadata) -> the
config.Architecture that every engine reads. One reader per format, one row per family; nothing else in the project
branches on a family's name.

Sources of the conventions: transformers' modeling files (the Hugging Face names and what each field means) and
llama.cpp's converter and loader (the GGUF names, which families' Q/K rows are permuted, what GGUF leaves implicit:
Gemma 3's local rope base and its one global layer in six).
"""
from __future__ import annotations

from pathlib import Path

from spork_trt.config import Architecture
from spork_trt.errors import UserError

# Hugging Face model_type -> the Architecture fields that do not depend on the config's values
HF_FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3_text": {"qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": True},
    "phi3": {},
}
HF_FAMILY_NAMES = {"gemma3_text": "gemma3"}  # model_type -> our family name where they differ
GGUF_FAMILIES = {  # general.architecture -> the same
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma3": {"qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": True},
    "phi3": {},
}
GGUF_PERMUTED_QK = {"llama"}  # llama.cpp's converter permutes these families' Q/K rows (the rest are NEOX-style)
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's gemma3 loader: layers 6, 12, ... (1-based) attend globally, the rest locally
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's gemma3 loader: the local layers' rope base where the file has none
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def supported(table: dict) -> str:
    return ", ".join(sorted(table))


def hf_architecture(raw: dict, where: Path) -> Architecture:
    """The Architecture of a Hugging Face config.json."""
    model_type = raw.get("model_type")
    if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):
        raise UserError(f"{where}: a multimodal Gemma 3 config: pass the text model (model_type gemma3_text)")
    if model_type not in HF_FAMILIES:
        raise UserError(f"{where}: model_type {model_type!r} is not supported (supported: "
                        f"{supported(HF_FAMILIES)})")
    if raw.get("mlp_bias") or (raw.get("attention_bias") and model_type != "qwen2"):
        raise UserError(f"{where}: MLP or output-projection biases are not supported ({model_type})")
    if raw.get("attn_logit_softcapping"):
        raise UserError(f"{where}: attention logit soft-capping is not supported")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{where}: a partial rotary embedding is not supported")
    fields = dict(HF_FAMILIES[model_type])
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in HF_ACTIVATIONS or HF_ACTIVATIONS[act] != fields.get("activation", "silu"):
        raise UserError(f"{where}: activation {act!r} is not supported for {model_type}")
    n = raw["num_hidden_layers"]
    kinds = raw.get("layer_types") or (["sliding_attention"] * n if raw.get("sliding_window") and
                                       model_type in ("mistral",) else ["full_attention"] * n)
    windowed = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    window = int(raw.get("sliding_window") or 0) if windowed else 0
    rope = raw.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    local_theta = float(raw.get("rope_local_base_freq") or (local or {}).get("rope_theta") or 0.0)
    scalar = raw.get("query_pre_attn_scalar")
    return Architecture(
        family=HF_FAMILY_NAMES.get(model_type, model_type), sliding_window=window,
        windowed=windowed if window else (), local_rope_theta=local_theta if windowed else 0.0,
        query_scale=float(scalar) ** -0.5 if scalar else 0.0,
        final_softcap=float(raw.get("final_logit_softcapping") or 0.0), **fields)


def hf_rope(raw: dict) -> dict:
    """The global layers' rope parameters (rope_theta, rope_type, ...) of a config.json: transformers 5 nests them
    per layer kind for families with local layers."""
    rope = raw.get("rope_parameters") or {}
    return rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope


def gguf_architecture(arch: str, meta: dict, n_layers: int, head_dim: int, path: Path) -> Architecture:
    """The Architecture of a GGUF file (its general.architecture and metadata)."""
    if arch not in GGUF_FAMILIES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                        f"{supported(GGUF_FAMILIES)})")
    fields = dict(GGUF_FAMILIES[arch])
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")  # per layer, where the converter wrote one
    if isinstance(pattern, list):
        windowed = tuple(i for i, local in enumerate(pattern) if local)
    elif arch == "gemma3":
        windowed = tuple(i for i in range(n_layers) if (i + 1) % GEMMA3_GLOBAL_EVERY)
    else:
        windowed = tuple(range(n_layers)) if window else ()
    if arch == "gemma3":  # llama.cpp scales Gemma 3's queries by 1 / sqrt(D) (all but the 27B's)
        fields.update(local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA),
                      query_scale=head_dim ** -0.5)
    softcap = float(meta.get(f"{arch}.final_logit_softcapping") or 0.0)
    if meta.get(f"{arch}.attn_logit_softcapping"):
        raise UserError(f"{path}: attention logit soft-capping is not supported")
    return Architecture(family=arch, sliding_window=window if windowed else 0, windowed=windowed if window else (),
                        final_softcap=softcap, **fields)


def gguf_features(path: Path) -> tuple[str, ...]:
    """What a GGUF file's family needs beyond Llama's decoder (Architecture.features), from its metadata alone."""
    from spork_trt.checkpoint.weights import gguf_reader

    fields = gguf_reader(path).fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    meta = {k: f.contents() for k, f in fields.items() if k.startswith(f"{arch}.")}
    n_layers = int(meta.get(f"{arch}.block_count") or 1)
    return gguf_architecture(arch, meta, n_layers, 2, path).features()
