"""Peers timed like our arms: transformers `generate` from the same checkpoint, greedy and with prompt lookup
decoding (`prompt_lookup_num_tokens`), on the same prompt token ids, with the same stop rule (EOS or max tokens)."""
from __future__ import annotations

import torch

from spork_trt.weights import Checkpoint

PEERS = {"hf-greedy": {}, "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10}}


def load_hf(ck: Checkpoint):
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if ck.kind == "gguf":
        return LlamaForCausalLM.from_pretrained(str(ck.path.parent), gguf_file=ck.path.name,
                                                dtype=torch.float32).eval()
    return LlamaForCausalLM.from_pretrained(str(ck.path), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate(hf, prompt_ids: list[int], max_new: int, eos_ids: frozenset[int], peer: str,
                min_new: int = 0) -> list[int]:
    """Generated ids, EOS excluded."""
    eos = sorted(eos_ids)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False,
                      eos_token_id=eos, pad_token_id=eos[0], **PEERS[peer])[0, len(prompt_ids):].tolist()
    return out[:next((i for i, t in enumerate(out) if t in eos_ids), len(out))]
