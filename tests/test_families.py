"""Families as data, checked against transformers, not ourselves: for each family a tiny random-weight model made
with transformers' own config and model classes, saved as safetensors, loaded by our loader into our reference
model: the same logits (fp32, within TOL) and the same greedy tokens (16 prompts x 64 tokens), and spork == plain
on the reference engine; the same on the ONNX graph `export build` makes. Engines that lack a family's features
refuse it in one line."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spork_trt.checkpoint.weights import load_checkpoint
from spork_trt.config import GenerateConfig, SpecConfig
from spork_trt.errors import UserError

TOL = 2e-4  # max |ours - transformers| over logits of magnitude ~1-10, fp32 (both sum in a different order)
VOCAB = 49152  # the default tokenizer's: llama.cpp's converter needs the model to cover the tokenizer
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def family_configs():
    import transformers as tf

    return {
        "llama": tf.LlamaConfig(**SHAPE),
        "mistral": tf.MistralConfig(**SHAPE, sliding_window=24),
        "qwen2": tf.Qwen2Config(**SHAPE),
        "qwen3": tf.Qwen3Config(**SHAPE, head_dim=16),
        # Gemma 3's own conventions, which llama.cpp assumes of a GGUF: one global layer in six, queries scaled by
        # 1 / sqrt(head_dim)
        "gemma3": tf.Gemma3TextConfig(**(SHAPE | {"num_hidden_layers": 6}), head_dim=16, sliding_window=24,
                                      query_pre_attn_scalar=16,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                      rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0},
                                                       "full_attention": {"rope_type": "default",
                                                                          "rope_theta": 1000000.0}}),
        "phi3": tf.Phi3Config(**SHAPE),
    }


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its safetensors folder)."""
    import transformers as tf

    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import default_gguf_path

    tok = load_tokenizer(default_gguf_path(), "gguf")  # any tokenizer: the prompts are token ids below VOCAB
    out = {}
    for name, cfg in family_configs().items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():  # norms and biases off their trivial init: a loader that drops them fails here
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.2)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(d)
        out[name] = (model, d)
    return out


def prompts(n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_our_reference_model_computes_transformers_logits(checkpoints, family):
    ref, d = checkpoints[family]
    ours = load_checkpoint(d).model
    assert ours.cfg.arch.family == family
    ids = torch.tensor([prompts(1)[0] * 2])  # [1, T]: long enough to cross Mistral's and Gemma's 24-token window
    t = ids.shape[1]
    from spork_trt.checkpoint.transformer import causal_mask

    with torch.no_grad():
        want = ref(ids).logits  # [1, T, V]
        got = ours(ids, torch.arange(t)[None], causal_mask(0, t)).logits
    assert t > 24 and (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_transformers_and_spork_is_plain(checkpoints, family):
    from spork_trt.loop.runtime import Runtime

    ref, d = checkpoints[family]
    rt = Runtime.load(d)
    cfg = GenerateConfig(max_new_tokens=64)
    for i, p in enumerate(prompts()):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                                pad_token_id=0)[0, len(p):].tolist()
        plain = rt.generate(p, cfg, mode="plain").token_ids
        draft = "self-int8" if i < 2 else "ngram"  # a model drafter's chains on two prompts, n-gram trees on the rest
        spork = rt.generate(p, cfg, mode="spork", spec=SpecConfig.for_draft(draft)).token_ids
        # ours stops at the tokenizer's end-of-text token (the default model's, in this vocabulary); transformers,
        # with no eos in the config, runs on
        assert plain == want[:len(plain)] and (len(plain) == 64 or want[len(plain)] in rt.tokenizer.eos_ids), (family, p)
        assert spork == plain, (family, p)


CONVERTER = Path(__file__).resolve().parents[1] / ".cache" / "llama-convert" / "llama.cpp" / "convert_hf_to_gguf.py"
SPM_FAMILIES = {"qwen2", "phi3"}  # llama.cpp's converter wants a SentencePiece tokenizer.model for these here


def sentencepiece_model(path: Path) -> Path:
    """A small BPE SentencePiece model trained on MT-bench's questions (the tokenizer only has to convert)."""
    import io

    import sentencepiece as spm

    from spork_trt.prompts import load_prompts

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([r["prompt"] for r in load_prompts("mt_bench")]),
                                   model_writer=buf, vocab_size=400, model_type="bpe", character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory):
    """family -> the GGUF (f32) llama.cpp's own converter writes from that family's transformers model."""
    return converted(checkpoints, tmp_path_factory.mktemp("gguf"), "f32")


def converted(checkpoints, root: Path, outtype: str) -> dict[str, Path]:
    """family -> the GGUF of `outtype` (f32, q8_0, ...) llama.cpp's own converter writes under `root`."""
    import shutil
    import subprocess
    import sys

    assert CONVERTER.is_file(), f"{CONVERTER} is missing: `make test` unpacks llama.cpp's converter first"
    spm_file = sentencepiece_model(root / "tokenizer.model")
    llama_cpp = CONVERTER.parent
    env = {**os.environ, "PYTHONPATH": f"{llama_cpp / 'gguf-py'}{os.pathsep}{llama_cpp}"}  # its own gguf-py
    out = {}
    for family, (_, d) in checkpoints.items():
        src = root / family
        src.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copyfile(d / f, src / f)
        if family in SPM_FAMILIES:
            shutil.copyfile(spm_file, src / "tokenizer.model")
        else:
            for f in d.glob("tokenizer*"):
                shutil.copyfile(f, src / f.name)
        r = subprocess.run([sys.executable, str(CONVERTER), str(src), "--outfile", str(root / f"{family}.gguf"),
                            "--outtype", outtype], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[family] = root / f"{family}.gguf"
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpps_gguf_of_each_family_loads_to_transformers_logits(checkpoints, gguf_files, family):
    """The GGUF names, Q/K layouts, fused tensors and implicit settings of each family, as llama.cpp writes them.
    Mistral's file is a `llama` GGUF without its window (llama.cpp runs it without one): compared within it."""
    ref, _ = checkpoints[family]
    ck = load_checkpoint(gguf_files[family])
    t = 20 if family == "mistral" else 50
    ids = torch.randint(0, 400, (1, t), generator=torch.Generator().manual_seed(2))  # [1, T]
    from spork_trt.checkpoint.transformer import causal_mask

    with torch.no_grad():
        want = ref(ids).logits
        got = ck.model(ids, torch.arange(t)[None], causal_mask(0, t)).logits
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("attention", ["gqa", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_onnx_graph_of_each_family_computes_the_reference_logits(checkpoints, family, attention, tmp_path):
    """lean.py's graph (ONNX Runtime's GroupQueryAttention, or standard ops for TensorRT) on a prompt that crosses
    the 24-token window, then one decode step: the reference engine's logits within TOL."""
    from spork_trt.engines import chain_input
    from spork_trt.engines.onnx_engine import OnnxEngine
    from spork_trt.engines.torch_engine import TorchEngine
    from spork_trt.export.onnx_graph import export_onnx

    ck = load_checkpoint(checkpoints[family][1])
    onnx = OnnxEngine(export_onnx(ck.model, tmp_path / "t.onnx", attention=attention), ck.cfg)
    ref = TorchEngine(ck.model)
    pools = onnx.make_pool(1, 128), ref.make_pool(1, 128)
    ids = prompts(1)[0] * 2  # 2 x 3..39 tokens
    for chunk in (ids[:-1], ids[-1:]):
        got, want = (e.forward_batch([chain_input(p.caches[0], chunk)])[0] for e, p in zip((onnx, ref), pools))
        assert got.shape == want.shape and (got - want).abs().max().item() < TOL, (family, len(chunk))
    assert len(ids) > 24


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_on_the_onnx_target_are_transformers_and_spork_is_plain(checkpoints, family, tmp_path):
    """The ONNX target `export build` makes: plain greedy decoding gives transformers' tokens, and spork (n-gram
    trees, and an early-exit model drafter's chains) gives plain's."""
    from spork_trt.engines.onnx_engine import OnnxEngine
    from spork_trt.export.onnx_graph import export_onnx
    from spork_trt.loop.generate import generate
    from spork_trt.spec.drafters import ModelDrafter, NgramDrafter
    from spork_trt.spec.sampling import make_generator

    ref, d = checkpoints[family]
    ck = load_checkpoint(d)
    target = OnnxEngine(export_onnx(ck.model, tmp_path / "t.onnx"), ck.cfg)
    early = OnnxEngine(export_onnx(ck.model, tmp_path / "e.onnx", n_layers=1), ck.cfg, n_layers=1)
    cfg = GenerateConfig(max_new_tokens=32)
    for i, p in enumerate(prompts(4)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                pad_token_id=0)[0, len(p):].tolist()
        plain = generate(target, p, cfg, frozenset()).token_ids
        drafter = NgramDrafter(4) if i % 2 else ModelDrafter(early, cfg.sampling, make_generator(None))
        spec = SpecConfig.for_draft("ngram" if i % 2 else "early-exit")
        spork = generate(target, p, cfg, frozenset(), drafter=drafter, spec=spec).token_ids
        assert plain == want, (family, p)
        assert spork == plain, (family, p)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_engines_without_a_familys_features_refuse_it_in_one_line(checkpoints, family):
    """The device engine runs Llama's decoder only (the CPU torch engine runs every family: test_family_engine.py)."""
    ck = load_checkpoint(checkpoints[family][1])
    from spork_trt.engines.device_engine import DeviceEngine

    with pytest.raises(UserError, match=rf"the device engine cannot run a {family} checkpoint: it lacks .*--dtype "
                       "fp32") as e:
        DeviceEngine(ck.model, "cpu", "fp32")
    assert "\n" not in str(e.value)


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "falcon"}')
    with pytest.raises(UserError, match=r"model_type 'falcon' is not supported \(supported: gemma3_text, llama, "
                                        r"mistral, phi3, qwen2, qwen3\)"):
        load_checkpoint(tmp_path)
