"""Peers timed like our arms: greedy, on the same prompt token ids, with the same stop rule (EOS or max tokens).

- `hf-greedy`, `hf-prompt-lookup`: transformers `generate` from the same checkpoint (`prompt_lookup_num_tokens=10`);
- `llama-cpp`, `llama-cpp-prompt-lookup`: llama.cpp through llama-cpp-python on the same GGUF file, in its own
  precision (the default's Q4_1), all cores, its extra buffer types off (no_extra_buffer_types); the second with
  its prompt lookup drafter (10 tokens); each also `-repack`: its weight repacking on (its fastest CPU path: the
  extra buffer types); `llama-cpp-q8_0`, `llama-cpp-q4_0` (each also `-prompt-lookup`, `-repack`): the same
  file quantized by llama.cpp itself (`llama_model_quantize`, its standard recipe for that type, requantizing the
  checkpoint's blocks; cached under `ENGINES/peers/`);
- `ort-genai`: onnxruntime-genai on an fp32 CPU model its builder makes from the same checkpoint (cached under
  `ENGINES/peers/`).

A peer whose package is missing says what installs it (`make bench-peers`)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from spork_trt.errors import UserError
from spork_trt.checkpoint.weights import Checkpoint

Run = Callable[[list[int], int, frozenset[int]], list[int]]  # (prompt ids, max new, EOS ids) -> ids, EOS excluded
LOOKUP = 10  # draft tokens per prompt lookup step, both peers


@dataclass(frozen=True)
class Peer:
    backend: str
    load: Callable[[Checkpoint, Path], Run]  # (checkpoint, cache folder) -> run


def until_eos(tokens, max_new: int, eos_ids: frozenset[int]) -> list[int]:
    out = []
    for t in tokens:
        if int(t) in eos_ids:
            break
        out.append(int(t))
        if len(out) >= max_new:
            break
    return out


def need(module: str, peer: str):
    try:
        return __import__(module)
    except ImportError:
        raise UserError(f"peer/{peer} needs the {module} package: run `make bench-peers`") from None


# -- transformers ---------------------------------------------------------------------------------------------------
def load_hf(ck: Checkpoint):
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if ck.kind == "gguf":
        return LlamaForCausalLM.from_pretrained(str(ck.path.parent), gguf_file=ck.path.name,
                                                dtype=torch.float32).eval()
    return LlamaForCausalLM.from_pretrained(str(ck.path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate(hf, prompt_ids: list[int], max_new: int, eos_ids: frozenset[int], lookup: int = 0,
                min_new: int = 0) -> list[int]:
    """Generated ids, EOS excluded."""
    eos = sorted(eos_ids)
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                      eos_token_id=eos, pad_token_id=eos[0], **extra)[0, len(prompt_ids):].tolist()
    return until_eos(out, max_new, eos_ids)


def hf_runner(lookup: int, ck: Checkpoint, cache: Path) -> Run:
    hf = load_hf(ck)
    return lambda ids, max_new, eos: hf_generate(hf, ids, max_new, eos, lookup)


# -- llama.cpp ------------------------------------------------------------------------------------------------------
LLAMA_TYPES = ("q8_0", "q4_0")  # the precisions llama.cpp is also measured at, beside the checkpoint's own


def llama_peer_name(ftype: str, lookup: int, repack: bool = False) -> str:
    return ("llama-cpp" + (f"-{ftype}" if ftype else "") + ("-prompt-lookup" if lookup else "")
            + ("-repack" if repack else ""))


def llama_quantized(llama_cpp, src: Path, ftype: str, cache: Path) -> Path:
    """`src` quantized to `ftype` by llama.cpp (its default recipe for that type), made once under `cache`."""
    out = cache / f"{src.stem}.llama-{ftype}.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = True  # the checkpoint is block-quantized already: dequantized, then quantized
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".part")
    print(f"[bench] llama.cpp quantizing {src.name} to {ftype} in {out} (once)", file=sys.stderr)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise UserError(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.replace(out)
    return out


def llama_runner(ftype: str, lookup: int, repack: bool, ck: Checkpoint, cache: Path) -> Run:
    """`repack`: llama.cpp's extra buffer types on (its CPU weight repacking, e.g. Q4_0 / Q4_K into 8x8
    interleaved blocks, and AMX where the CPU has it): its fastest CPU path, off by default only because it crashed
    on an AMX host (no_extra_buffer_types)."""
    peer = llama_peer_name(ftype, lookup, repack)
    if ck.kind != "gguf":
        raise UserError(f"peer/{peer} runs GGUF files: this checkpoint is {ck.path} ({ck.kind})")
    llama_cpp = need("llama_cpp", peer)
    path = llama_quantized(llama_cpp, ck.path, ftype, cache) if ftype else ck.path
    draft = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # logits_all: llama-cpp-python 0.3.36 sizes its logits store by the constructor's logits_all (n_batch rows
        # without it) although a draft model turns logits_all on: a prompt and answer past 512 tokens overflowed it
        draft = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=lookup), "logits_all": True}
    cores = os.cpu_count() or 1
    with no_extra_buffer_types(llama_cpp) if not repack else contextlib.nullcontext():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, n_threads=cores, n_threads_batch=cores,
                              verbose=False, **draft)

    def run(ids: list[int], max_new: int, eos: frozenset[int]) -> list[int]:
        llm.reset()  # no KV reuse from the previous prompt: every arm prefills every prompt in full
        return until_eos(llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                      reset=True), max_new, eos)
    return run


@contextlib.contextmanager
def no_extra_buffer_types(llama_cpp):
    """Load with llama.cpp's extra buffer types off (`use_extra_bufts`: the AMX and CPU weight-repacking buffers):
    with them, llama-cpp-python 0.3.36 segfaults in the first eval of the default Q4_1 GGUF on an AMX host (a Xeon
    with AMX_INT8). Its plain CPU kernels (AVX-512 here) still run every matmul."""
    module = sys.modules[llama_cpp.Llama.__module__].llama_cpp  # the ctypes bindings llama.py calls
    default = module.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


# -- onnxruntime-genai ----------------------------------------------------------------------------------------------
def save_hf_dir(hf, out: Path) -> None:
    """config.json + model.safetensors in fp32 (transformers will not save a model it loaded from a quantized GGUF)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [type(hf).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})


def genai_model_dir(ck: Checkpoint, cache: Path) -> Path:
    """The onnxruntime-genai fp32 CPU model of `ck`, built once by its builder from a Hugging Face export."""
    out = cache / f"ort-genai-fp32-{ck.path.stem}"
    if (out / "genai_config.json").is_file():
        return out
    from transformers import AutoTokenizer

    work = cache / f".ort-genai-work-{ck.path.stem}"
    shutil.rmtree(work, ignore_errors=True)
    hf_dir = work / "hf"
    print(f"[bench] building the onnxruntime-genai model in {out} (once)", file=sys.stderr)
    save_hf_dir(load_hf(ck), hf_dir)
    tok_kw = {"gguf_file": ck.path.name} if ck.kind == "gguf" else {}
    AutoTokenizer.from_pretrained(str(ck.path.parent if ck.kind == "gguf" else ck.path), **tok_kw).save_pretrained(
        hf_dir)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(work / "model"),
           "-p", "fp32", "-e", "cpu", "-c", str(work / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"the onnxruntime-genai builder failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    (work / "model").rename(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def genai_runner(ck: Checkpoint, cache: Path) -> Run:
    og = need("onnxruntime_genai", "ort-genai")
    model = og.Model(str(genai_model_dir(ck, cache)))

    def tokens(ids: list[int], max_new: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
            yield gen.get_next_tokens()[0]

    return lambda ids, max_new, eos: until_eos(tokens(ids, max_new), max_new, eos)


PEERS = {
    "hf-greedy": Peer("transformers", partial(hf_runner, 0)),
    "hf-prompt-lookup": Peer("transformers", partial(hf_runner, LOOKUP)),
    **{llama_peer_name(t, k, r): Peer("llama.cpp", partial(llama_runner, t, k, r))
       for t in ("", *LLAMA_TYPES) for k in (0, LOOKUP) for r in (False, True)},
    "ort-genai": Peer("onnxruntime-genai", genai_runner),
}
