"""`python -m export convert-head`: a published EAGLE-3 head (a folder with config.json and *.safetensors, the layout
of the EAGLE repository's Eagle3 checkpoints for Llama targets) -> this project's head.safetensors (layout eagle3),
which `python -m export build --head DIR` takes.

  fc.weight [C, 3C]                      -> fuse.weight (the fused features of the three tapped layers)
  midlayer.self_attn.{q,k,v,o}_proj      -> layer.attn.{wq,wk,wv,wo} (q, k, v read 2C:
                                            [input_norm(emb); hidden_norm(g)])
  midlayer.mlp.{gate,up,down}_proj       -> layer.mlp.{gate,up,down}
  midlayer.{input_layernorm, hidden_norm, post_attention_layernorm} -> layer.{input_norm, hidden_norm, mlp_norm}
  norm.weight, lm_head.weight [N, C]     -> norm.weight, lm_head.weight
  d2t [N] (offsets: target id = i + d2t[i]) -> d2t (the target ids themselves)
The head's embed_tokens, if present, is dropped (the target's embeddings are used). Only safetensors are read: a
pickle (pytorch_model.bin) is refused, never loaded.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from spork_trt.spec.draft_head import DraftHead, HeadConfig
from spork_trt.errors import UserError

KEYS = {"fc.weight": "fuse.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
        **{f"midlayer.self_attn.{a}_proj.weight": f"layer.attn.w{a}.weight" for a in "qkvo"},
        **{f"midlayer.mlp.{m}_proj.weight": f"layer.mlp.{m}.weight" for m in ("gate", "up", "down")},
        "midlayer.input_layernorm.weight": "layer.input_norm.weight",
        "midlayer.hidden_norm.weight": "layer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight": "layer.mlp_norm.weight"}


def default_taps(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's features for a Llama target: the hidden states after layers 2, L/2 and L-3."""
    return 2, n_layers // 2, n_layers - 3


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in src.glob("*.bin")] + [p.name for p in src.glob("*.pt")]
        raise UserError(f"{src} has no .safetensors file" + (f" ({', '.join(pickled)} are pickles, which are never "
                        "loaded: convert them to safetensors where they come from)" if pickled else ""))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out |= load_file(str(f))
    return out


def convert(src: Path, out: Path, taps: tuple[int, ...]) -> Path:
    """Write out/head.safetensors from the EAGLE-3 checkpoint folder `src`; returns its path."""
    if not (src / "config.json").is_file():
        raise UserError(f"{src} has no config.json: pass the folder of an EAGLE-3 checkpoint")
    cfg = json.loads((src / "config.json").read_text())
    tensors = read_tensors(src)
    missing = sorted((set(KEYS) | {"d2t"}) - set(tensors))
    if missing:
        raise UserError(f"{src} is not an EAGLE-3 head: it lacks {', '.join(missing)}")
    c, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n = tensors["lm_head.weight"].shape[0]
    if len(taps) * c != tensors["fc.weight"].shape[1]:
        raise UserError(f"--taps {','.join(map(str, taps))}: its fc reads {tensors['fc.weight'].shape[1] // c} "
                        "tapped layers")
    hc = HeadConfig(dim=c, n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads", heads),
                    head_dim=cfg.get("head_dim") or c // heads, ffn_dim=cfg["intermediate_size"],
                    norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta", 10000.0),
                    taps=tuple(taps), vocab=n, target_vocab=cfg["vocab_size"], layout="eagle3")
    head = DraftHead(hc)
    state = {KEYS[k]: v.float() for k, v in tensors.items() if k in KEYS}
    state["d2t"] = torch.arange(n) + tensors["d2t"].long()  # offsets -> target ids
    if state["d2t"].min() < 0 or state["d2t"].max() >= hc.target_vocab:
        raise UserError(f"{src}: its d2t maps outside the target vocabulary of {hc.target_vocab}")
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise UserError(f"{src}: its tensors do not fit its config.json ({str(e).splitlines()[0]})") from None
    path = head.save(out, {"converted_from": str(src), "format": "eagle3", "taps": list(taps)})
    print(f"[convert-head] {path}: EAGLE-3 head, {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, "
          f"draft vocabulary {n}, features after layers {list(taps)}", file=sys.stderr)
    return path
