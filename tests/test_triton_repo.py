"""The rendered Triton repository parses with Triton's own ModelConfig schema and agrees with io_spec."""
from __future__ import annotations

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from spork_trt import io_spec
from spork_trt.errors import UserError
from spork_trt.serving.triton_steps import model_parameters
from spork_trt.serving.triton_repo import RepoConfig, render

pytestmark = pytest.mark.slow  # needs a default build


def load(repo, name) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def same(io, t: io_spec.TritonTensor) -> bool:
    return (io.name, mc.DataType.Name(io.data_type), list(io.dims), getattr(io, "optional", False)) == (
        t.name, "TYPE_" + t.dtype, list(t.dims), t.optional)


@pytest.mark.parametrize("profile", ["cpu", "gpu", "gpu-onnx"])
def test_rendered_configs_match_io_spec(default_engines, tmp_path, profile, capsys):
    repo = render(RepoConfig(default_engines, tmp_path / "repo", profile, instances=2, slots=4, max_context=1024,
                             unary_instances=3))
    # the default build's GroupQueryAttention graphs: ORT's GPU providers want plain attention graphs
    assert ("--attention plain" in capsys.readouterr().err) == (profile == "gpu-onnx")
    for model in io_spec.PYTHON_MODELS:
        c = load(repo, model)
        step = io_spec.model_step(model)
        assert c.name == model and c.backend == "python" and c.max_batch_size > 0
        assert len(c.input) == len(step.inputs) and all(same(i, t) for i, t in zip(c.input, step.inputs))
        assert len(c.output) == len(step.outputs) and all(same(o, t) for o, t in zip(c.output, step.outputs))
        assert c.model_transaction_policy.decoupled == (model == "spork")
        assert (repo / model / "1" / "model.py").is_file()
        args = {"model_config": json_format.MessageToJson(c, preserving_proto_field_name=True),
                "model_repository": str(repo / model)}  # what Triton hands initialize()
        if model not in io_spec.UNARY_MODELS:  # they load no engines: they call spork (one core, one pool)
            assert model_parameters(args)["engines"] == str(default_engines.resolve())
        gpu = profile != "cpu" and model == "spork"
        assert mc.ModelInstanceGroup.Kind.Name(c.instance_group[0].kind) == ("KIND_GPU" if gpu else "KIND_CPU")
        # a bounded queue in front of each unary model (the default --max-queue), the others' unbounded
        assert c.dynamic_batching.default_queue_policy.max_queue_size == (64 if model in io_spec.UNARY_MODELS else 0)
    sp = load(repo, "spork")
    assert sp.instance_group[0].count == 2 and sp.parameters["slots"].string_value == "4"
    assert int(sp.parameters["max_len"].string_value) > 1024 and sp.parameters["max_queue"].string_value == "64"
    assert ("TensorrtExecutionProvider" in sp.parameters["providers"].string_value) == (profile == "gpu-onnx")
    if profile != "cpu":  # the cpu profile's default target: test_the_default_repository_serves_...
        assert sp.parameters["device"].string_value == ("cuda" if profile == "gpu" else "")  # "": ONNX Runtime
        assert sp.parameters["dtype"].string_value == "fp32"  # config.DEVICE_DTYPE: the lossless one on a GPU
    assert all(load(repo, m).instance_group[0].count == 3 for m in io_spec.UNARY_MODELS)
    # cancel_key is the unary models' own, per request: a client cannot send one; without input_ids it would be a cancel
    unary = load(repo, "spork_unary")
    assert "cancel_key" in {i.name for i in sp.input} - {i.name for i in unary.input}
    assert unary.input[0].name == "input_ids" and not unary.input[0].optional and sp.input[0].optional
    # both entry points take and give the same tensors: the streaming ensemble and the unary python model
    for name in (io_spec.ENSEMBLE, "ensemble_unary"):
        e = load(repo, name)
        assert [i.name for i in e.input] == [t.name for t in io_spec.ENSEMBLE_INPUTS]
        assert all(same(i, t) for i, t in zip(e.input, io_spec.ENSEMBLE_INPUTS))
        assert len(e.output) == len(io_spec.ENSEMBLE_OUTPUTS)
        assert all(same(o, t) for o, t in zip(e.output, io_spec.ENSEMBLE_OUTPUTS))
    e = load(repo, io_spec.ENSEMBLE)
    assert e.platform == "ensemble"
    available = {i.name for i in e.input}  # every step input is a client input or an earlier step's output
    for s in e.ensemble_scheduling.step:
        assert set(s.input_map.values()) <= available, s.model_name
        available |= set(s.output_map.values())
    assert {o.name for o in e.output} <= available
    assert [s.model_name for s in e.ensemble_scheduling.step] == ["preprocessing", "spork", "postprocessing"]


def test_render_refuses_what_is_not_a_build(tmp_path):
    with pytest.raises(UserError):
        render(RepoConfig(tmp_path))
    with pytest.raises(UserError, match="--profile"):
        render(RepoConfig(tmp_path, profile="tpu"))
    for bad in (dict(device="tpu"), dict(profile="gpu", dtype="fp8")):
        with pytest.raises(UserError, match="--device must be one of cuda, cpu"):
            render(RepoConfig(tmp_path, **bad))


def test_each_gpu_instance_runs_on_its_own_gpu():
    from spork_trt.serving.triton_steps import instance_device

    assert instance_device("cuda", {"model_instance_kind": "GPU", "model_instance_device_id": "1"}) == "cuda:1"
    assert instance_device("cpu", {"model_instance_kind": "CPU"}) == "cpu"
    assert instance_device("", {"model_instance_kind": "GPU"}) is None  # ONNX Runtime on its providers


def test_render_refuses_bad_sizes(default_engines, tmp_path):
    for bad, flag in ((dict(slots=0), "--slots"), (dict(max_queue=-1), "--max-queue"),
                      (dict(max_context=100000), "--max-context")):
        with pytest.raises(UserError, match=flag):
            render(RepoConfig(default_engines, tmp_path / "repo", **bad))


def test_a_repository_rendered_by_another_version_is_rendered_again(default_engines, tmp_path):
    from spork_trt.serving.triton_repo import adapters_current, ensure_rendered

    cfg = RepoConfig(default_engines, tmp_path / "repo")
    repo = render(cfg)
    assert adapters_current(repo) and ensure_rendered(cfg) == repo
    (repo / "spork" / "1" / "model.py").write_text("# an older adapter\n")
    assert not adapters_current(repo)
    assert ensure_rendered(cfg) == repo and adapters_current(repo)


def test_the_startup_line_names_the_target_the_repository_serves(default_engines, tmp_path):
    """`serve` prints what it serves: the build's target, or its checkpoint on a torch engine (export triton
    --device cpu --dtype bf16 or int4: the CPU torch engine)."""
    from spork_trt.cli.serving import served_target

    onnx = render(RepoConfig(default_engines, tmp_path / "onnx", device=""))  # export triton --device onnx
    bf16 = render(RepoConfig(default_engines, tmp_path / "bf16", device="cpu", dtype="bf16"))
    assert served_target(onnx).startswith("fp32 target, ")
    int4 = render(RepoConfig(default_engines, tmp_path / "int4", device="cpu", dtype="int4"))
    assert served_target(bf16).startswith("bf16 target (the build's checkpoint on the CPU torch engine), ")
    assert served_target(int4).startswith("int4 target (the build's checkpoint on the CPU torch engine), ")
    with pytest.raises(UserError, match="runs on the CPU torch engine"):
        render(RepoConfig(default_engines, tmp_path / "cuda", device="cuda", dtype="int4"))


def test_a_step_s_error_kind_is_found_from_its_message():
    from spork_trt.io_spec import error_kind

    assert error_kind("input_ids must be token ids in [0, 49152), got -5 at position 0") == "invalid"
    assert error_kind("temperature must be >= 0.01 and finite, or 0 for greedy, got nan") == "invalid"
    assert error_kind("all 2 slots are in use and 1 requests wait for one (max_queue): retry later") == "unavailable"
    assert error_kind("the server is shutting down: retry on another instance") == "unavailable"
    assert error_kind("internal error in request 3f2a: the server logged the detail (quote this id)") == "internal"
    assert error_kind('text_input is missing: send the prompt as "text_input" (a string)') == "invalid"  # preprocessing
    assert error_kind("preprocessing: internal error in request 3f2a: the server logged the detail") == "internal"


def test_the_default_repository_serves_the_build_s_default_target(default_engines, tmp_path, monkeypatch):
    """With no --device or --dtype the repository runs the build's default target on this host
    (engines/default_target.py): int4 on the CPU torch engine where the CPU has oneDNN's bf16 kernels or spork's
    (AVX2 too), else the build's ONNX target; the gpu profiles keep their device."""
    from spork_trt.checkpoint import manifest as mf
    from spork_trt.engines.cpu import kernels as int4_kernel, engine as onednn_engine
    from spork_trt.engines.default_target import default_target

    from .test_default_target import int4_here

    want = default_target(mf.read(default_engines))
    assert (want.device, want.dtype) == (("cpu", "int4") if int4_here() else ("", "fp32"))
    sp = load(render(RepoConfig(default_engines, tmp_path / "auto")), "spork").parameters
    assert (sp["device"].string_value, sp["dtype"].string_value) == (want.device, want.dtype)
    monkeypatch.setattr(onednn_engine, "onednn_bf16_available", lambda: False)  # a CPU without them
    monkeypatch.setattr(int4_kernel, "kernel", lambda: "aten")  # nor spork's kernels
    sp = load(render(RepoConfig(default_engines, tmp_path / "plain_cpu")), "spork").parameters
    assert (sp["device"].string_value, sp["dtype"].string_value) == ("", "fp32")
    sp = load(render(RepoConfig(default_engines, tmp_path / "gpu", "gpu")), "spork").parameters
    assert (sp["device"].string_value, sp["dtype"].string_value) == ("cuda", "fp32")
