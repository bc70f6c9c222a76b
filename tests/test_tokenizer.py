"""Tokenizer from the GGUF: chat template as transformers applies it; streaming never splits characters."""
from __future__ import annotations

import pytest

from spork_trt.errors import UserError
from spork_trt.checkpoint.tokenizer import StreamDecoder

pytestmark = pytest.mark.slow


def test_chat_template_matches_transformers(default_tokenizer):
    hf = default_tokenizer.hf
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    got = default_tokenizer.encode_prompt("What is the capital of France?")
    assert got == list(want)
    assert got[-4:] == hf.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert default_tokenizer.encode_prompt("hi", raw=True) == hf.encode("hi")
    assert default_tokenizer.eos_ids == frozenset({2})


def test_empty_prompt_is_refused(default_tokenizer):
    with pytest.raises(UserError, match="empty"):
        default_tokenizer.encode_prompt("   ")


def test_stream_decoder_reassembles_multibyte_text(default_tokenizer):
    text = "naïve café → 東京 🙂 done"
    ids = default_tokenizer.hf.encode(text, add_special_tokens=False)
    dec = StreamDecoder(default_tokenizer)
    deltas = [dec.feed([i]) for i in ids]
    assert "".join(deltas) == default_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
