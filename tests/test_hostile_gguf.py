"""Truncated and hostile GGUF files (issue 62, item 7): each is one UserError naming the file, read in bounded time
and memory, never a traceback or a huge allocation. The files are a real tiny checkpoint (written as llama.cpp
writes one, with a byte-level BPE vocabulary and a chat template) with bytes changed where a corrupt download or a
crafted file would change them."""
from __future__ import annotations

import resource
import struct
import time

import gguf
import pytest

from spork_trt.checkpoint.tokenizer import load_tokenizer
from spork_trt.checkpoint.weights import load_checkpoint
from spork_trt.errors import UserError
from tests.test_weights import hf_tiny, write_gguf

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
             "{% endif %}<s>{{ m['content'] }}</s>{% endfor %}")


def with_vocab(tokens: int = 128, template: str | None = TEMPLATE, eos: int = 1):
    """A GGUFWriter hook adding a byte-level BPE vocabulary of `tokens` entries (and a chat template)."""
    original = gguf.GGUFWriter.write_header_to_file

    def hook(self, *a, **k):
        chars = [chr(c) for c in range(0x100, 0x100 + tokens - 3)]
        self.add_tokenizer_model("gpt2")
        self.add_tokenizer_pre("default")
        self.add_token_list(["<s>", "</s>", "<unk>"] + chars)
        self.add_token_types([3, 3, 2] + [1] * len(chars))
        self.add_token_scores([0.0] * tokens)
        self.add_token_merges([])
        self.add_bos_token_id(0)
        self.add_eos_token_id(eos)
        if template is not None:
            self.add_chat_template(template)
        return original(self, *a, **k)
    return hook


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    hf, _ = hf_tiny(d)
    return hf, d


def write(tiny, name, monkeypatch, **vocab):
    hf, d = tiny
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_vocab(**vocab))
    path = d / f"{name}.gguf"
    write_gguf(path, hf)
    monkeypatch.undo()
    return path


def tensor_info(raw: bytes, name: str) -> tuple[int, int]:
    """(offset of the first dimension, offset of the data offset) of tensor `name`'s info record."""
    at = raw.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    return at + 4, at + 4 + 8 * n_dims + 4


def refused(path, match: str) -> str:
    """load_checkpoint's UserError, in under 10 s and without growing the process by more than 256 MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(UserError, match=match) as e:
        load_checkpoint(path)
    assert time.monotonic() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    return str(e.value)


def patched(tmp_path, raw: bytes, at: int, fmt: str, *values) -> object:
    b = bytearray(raw)
    struct.pack_into(fmt, b, at, *values)
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(b))
    return out


def test_the_unchanged_file_loads_with_its_vocabulary_and_template(tiny, tmp_path, monkeypatch):
    path = write(tiny, "good", monkeypatch)
    ck = load_checkpoint(path)
    tok = load_tokenizer(path, "gguf", ck.cfg.eos_token_ids)
    assert ck.cfg.vocab_size == 128 and tok.has_chat_template
    assert tok.chat_ids([{"role": "user", "content": "\u0101"}])[0] == 0  # the template's <s>


def test_truncated_file_and_data_past_its_end(tiny, tmp_path, monkeypatch):
    raw = write(tiny, "whole", monkeypatch).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:len(raw) - 4096])  # a download stopped short
    refused(cut, "truncated or corrupt; download it again")
    _, offset = tensor_info(raw, "blk.2.ffn_down.weight")
    refused(patched(tmp_path, raw, offset, "<Q", 1 << 40), "truncated or corrupt")
    cut.write_bytes(raw[:20])  # inside the header
    refused(cut, "not a readable GGUF file")


@pytest.mark.parametrize("dims", [(1 << 62,), (1 << 33, 1 << 33), (1 << 32, 1 << 32)])
def test_impossible_dimensions_are_refused_without_allocating(tiny, tmp_path, monkeypatch, dims):
    """One dimension of 2^62 elements, and two whose product overflows 64 bits (2^66) or is exactly 2^64."""
    raw = write(tiny, "dims", monkeypatch).read_bytes()
    first, _ = tensor_info(raw, "blk.2.ffn_down.weight")
    refused(patched(tmp_path, raw, first + 8 * (2 - len(dims)), "<" + "Q" * len(dims), *dims), "not a readable GGUF")


@pytest.mark.parametrize("field,value", [(8, 1 << 60), (16, 1 << 60)])
def test_huge_tensor_and_metadata_counts(tiny, tmp_path, monkeypatch, field, value):
    """The header's tensor count (byte 8) and metadata count (byte 16) claiming 2^60 entries."""
    raw = write(tiny, "counts", monkeypatch).read_bytes()
    refused(patched(tmp_path, raw, field, "<Q", value), "not a readable GGUF")


def test_unknown_tensor_type_code(tiny, tmp_path, monkeypatch):
    raw = write(tiny, "type", monkeypatch).read_bytes()
    _, offset = tensor_info(raw, "blk.0.ffn_up.weight")
    refused(patched(tmp_path, raw, offset - 4, "<I", 9999), "not a readable GGUF")


@pytest.mark.parametrize("vocab,match", [
    (dict(tokens=200), r"tokenizer.ggml.tokens needs 200 token rows but token_embd.weight has 128"),
    (dict(eos=5000), r"tokenizer.ggml.eos_token_id needs 5001 token rows but token_embd.weight has 128"),
])
def test_a_vocabulary_that_does_not_match_the_embedding(tiny, monkeypatch, vocab, match):
    refused(write(tiny, "vocab", monkeypatch, **vocab), match)


def test_a_chat_template_that_raises_on_one_message_is_refused_at_load(tiny, monkeypatch):
    path = write(tiny, "raises", monkeypatch, template="{{ raise_exception('this template is broken') }}")
    with pytest.raises(UserError, match="chat template refused.*this template is broken.*fix or remove"):
        load_tokenizer(path, "gguf")
    path = write(tiny, "syntax", monkeypatch, template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(UserError, match="chat template refused"):
        load_tokenizer(path, "gguf")
    path = write(tiny, "types", monkeypatch, template="{{ messages[0]['content'] + 1 }}")  # a TypeError inside
    with pytest.raises(UserError, match="chat template refused"):
        load_tokenizer(path, "gguf")


def test_a_template_that_refuses_a_conversation_is_a_user_error_for_that_conversation(tiny, monkeypatch):
    """Gemma's and Mistral's templates refuse roles that do not alternate: that request is refused with the
    template's words (a 400 at the OpenAI API, tests/test_openai_edge.py), the model still loads and serves."""
    tok = load_tokenizer(write(tiny, "alternate", monkeypatch, template=ALTERNATE), "gguf")
    assert tok.chat_ids([{"role": "user", "content": "\u0101"}])
    two = [{"role": "user", "content": "\u0101"}, {"role": "user", "content": "\u0102"}]
    with pytest.raises(UserError, match="refused this conversation: Conversation roles must alternate"):
        tok.chat_ids(two)
    with pytest.raises(UserError, match="roles must alternate"):  # the control-token path renders it too
        tok.chat_ids([two[0], {"role": "user", "content": "<s>"}])


def test_tokenizer_metadata_that_transformers_cannot_build_is_one_error(tiny, tmp_path, monkeypatch):
    """A BPE vocabulary without scores or merges (transformers raises KeyError) and one whose merges name tokens
    it lacks (tokenizers raises a bare Exception)."""
    hf, d = tiny
    for name, broken in (("noscores", lambda w: None), ("badmerge", lambda w: w.add_token_merges(["x y"]))):
        original = gguf.GGUFWriter.write_header_to_file

        def hook(self, *a, _broken=broken, **k):
            self.add_tokenizer_model("gpt2")
            self.add_token_list(["<s>", "</s>", "a", "b"])
            self.add_token_types([3, 3, 1, 1])
            if name == "badmerge":
                self.add_token_scores([0.0] * 4)
            _broken(self)
            return original(self, *a, **k)
        monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", hook)
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, hf)
        monkeypatch.undo()
        with pytest.raises(UserError, match="cannot read a tokenizer from"):
            load_tokenizer(path, "gguf")


def test_the_openai_api_answers_a_conversation_its_template_refuses_with_a_400(tiny, monkeypatch):
    """The template's own words in OpenAI's error shape, param `messages`; no upstream is reached."""
    import http.client
    import json

    from spork_trt.serving.openai_api.app import create_app
    from spork_trt.serving.openai_api.model import ServedModel
    from tests.test_openai_edge import running

    tok = load_tokenizer(write(tiny, "served", monkeypatch, template=ALTERNATE), "gguf")
    body = {"model": "m", "messages": [{"role": "user", "content": "\u0101"}, {"role": "user", "content": "b"}]}
    with running(create_app(ServedModel("m", tok, 256, 128), "127.0.0.1:1", 1 << 16)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        status, err = r.status, json.loads(r.read())
        conn.close()
    assert status == 400 and err["error"]["param"] == "messages", err
    assert "Conversation roles must alternate" in err["error"]["message"]
