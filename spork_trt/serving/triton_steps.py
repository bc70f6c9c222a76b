"""The Triton python models' step functions, without Triton: preprocessing (text -> the prompt's ids, refused by
size before any work), postprocessing (ids -> incremental text), and what every model reads from its config
(parameters, the instance's device, the build's tokenizer). `serving/triton_models/*/model.py` only convert tensors."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from spork_trt.errors import UserError
from spork_trt.io_spec import TEXT_MISSING
from spork_trt.loop.stopping import cut
from spork_trt.checkpoint.tokenizer import Tokenizer, load_tokenizer, text_delta


def encode_text(tok: Tokenizer, text_input: np.ndarray | None, max_bytes: int | None = None) -> np.ndarray:
    """Preprocessing: text_input [1, 1] (bytes) -> input_ids [1, n] through the chat template (a conversation
    the template already rendered, as Triton's OpenAI frontend sends, is not templated again); a text over
    `max_bytes` (Tokenizer.max_text_bytes) is refused before any work."""
    if text_input is None:  # optional in the configs so that this message, not Triton's, answers its absence
        raise UserError(TEXT_MISSING)
    if text_input.size != 1:
        raise UserError(f"text_input must hold one string per request, got shape {list(text_input.shape)}")
    raw = text_input.reshape(-1)[0]
    size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode())
    if max_bytes is not None and size > max_bytes:
        raise UserError(f"text_input is {size} bytes: no text over {max_bytes} bytes fits the model's context; "
                        "send less text")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as e:
        raise UserError(f"text_input is not valid UTF-8 ({e.reason} at byte {e.start}): send UTF-8 text") from None
    if not text.strip():
        raise UserError("text_input is empty: send some text to generate from")
    return np.array([tok.encode_rendered(text) if tok.is_rendered(text) else tok.encode_prompt(text)], np.int32)


MAX_DECODE_IDS = 1 << 16  # ids one postprocessing call decodes (the spork step sends a window, or one unary answer)
MAX_CUTS = 64  # stop strings one call cuts at (requests carry at most a few)


def decode_chunk(tok: Tokenizer, output_ids: np.ndarray, sent_len: np.ndarray, final: np.ndarray,
                 cut_at: np.ndarray | None = None) -> np.ndarray:
    """Postprocessing: the text this response adds -> text_output [1, 1] (UTF-8 bytes), ended where the first of the
    stop strings `cut_at` [1, k] starts (the spork step sends them with the final response, and holds back until then
    the tokens that could begin one, so a stop string lies whole within the final response's text)."""
    ids = [int(i) for i in output_ids.reshape(-1)]
    vocab = tok.size
    if len(ids) > MAX_DECODE_IDS or any(not 0 <= i < vocab for i in ids):
        raise UserError(f"output_ids must be at most {MAX_DECODE_IDS} token ids in [0, {vocab})")
    sent = int(sent_len.reshape(-1)[0])
    if not 0 <= sent <= len(ids):
        raise UserError(f"sent_len must be in [0, {len(ids)}] (the ids earlier responses carried), got {sent}")
    if cut_at is not None and cut_at.size > MAX_CUTS:
        raise UserError(f"cut_at must hold at most {MAX_CUTS} stop strings, got {cut_at.size}")
    delta = text_delta(tok, ids, sent, bool(final.reshape(-1)[0]))
    try:
        stops = () if cut_at is None else tuple(s.decode("utf-8") for s in cut_at.reshape(-1))
    except (UnicodeDecodeError, AttributeError):
        raise UserError("cut_at must be UTF-8 stop strings") from None
    return np.array([[cut(delta, stops).encode("utf-8")]], np.object_)


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """A Triton python model's `initialize` args -> its config parameters, with `engines` resolved to a path
    (a relative one is relative to the repository root)."""
    import json

    params = {k: v.get("string_value", "")  # an empty string is left out of the config's JSON
              for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
    p = Path(params["engines"])
    params["engines"] = str(p if p.is_absolute() else (Path(args["model_repository"]).parent / p).resolve())
    return params


def instance_device(device: str, args: Mapping[str, str]) -> str | None:
    """The device engine's device for a Triton model instance: the config's `device` ("": the build's ONNX Runtime
    engines), with cuda made this instance's GPU (a KIND_GPU group places one instance per listed GPU)."""
    if device == "cuda" and args.get("model_instance_kind") == "GPU":
        return f"cuda:{args.get('model_instance_device_id', 0)}"
    return device or None


def model_tokenizer(args: Mapping[str, str]) -> Tokenizer:
    """The tokenizer of the engines a Triton python model's config names."""
    from spork_trt.checkpoint import manifest as mf

    engines = Path(model_parameters(args)["engines"])
    cfg = mf.spec_config(mf.read(engines)["model"])
    return load_tokenizer(engines, "hf", cfg.eos_token_ids)


def model_text_limit(args: Mapping[str, str], tok: Tokenizer) -> int:
    """Tokenizer.max_text_bytes for the model window of the engines a Triton python model's config names."""
    from spork_trt.checkpoint import manifest as mf

    return tok.max_text_bytes(mf.spec_config(mf.read(Path(model_parameters(args)["engines"]))["model"]).max_seq_len)
