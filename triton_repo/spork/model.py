"""Triton python models `spork` (decoupled: streams) and `spork_unary` (one response per request): run the
speculative loop in-process on the engines named by the config. Each request runs on a worker thread with its own
KV caches (ONNX Runtime releases the GIL while it computes); a cancelled request stops at its next step and frees
its state. A thin adapter: the logic is spork_trt.service (tested without Triton)."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

from spork_trt import io_spec
from spork_trt.errors import UserError
from spork_trt.service import Service, model_parameters

STEP = next(s for s in io_spec.TRITON_STEPS if s.name == "spork")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(chunk):
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in chunk.tensors().items()])


def error_response(e):
    if isinstance(e, UserError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
    pb_utils.Logger.log_error(f"spork: request failed: {e!r}")
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {e!r}"))


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.service = Service.load(Path(params["engines"]), params["draft"], tuple(params["providers"].split(",")),
                                    int(params.get("spec_max_active", "0")))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.pool = ThreadPoolExecutor(max_workers=int(params["max_concurrency"]), thread_name_prefix="spork")

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self.pool.submit(self.stream, request)
            return None  # responses go through each request's sender
        return [f.result() for f in [self.pool.submit(self.answer, r) for r in requests]]

    def stream(self, request):
        sender = request.get_response_sender()
        try:
            send = lambda chunk: sender.send(response(chunk), flags=FINAL if chunk.final else 0)
            if not self.service.run(self.inputs(request), send, cancelled=request.is_cancelled):
                pb_utils.Logger.log_info("spork: request cancelled, its KV caches released")
                sender.send(flags=FINAL)  # close the stream
        except Exception as e:
            sender.send(error_response(e), flags=FINAL)

    def answer(self, request):
        chunks = []
        try:
            self.service.run(self.inputs(request), chunks.append, can_stream=False)
            return response(chunks[-1])
        except Exception as e:
            return error_response(e)

    @staticmethod
    def inputs(request):
        tensors = {t.name: pb_utils.get_input_tensor_by_name(request, t.name) for t in STEP.inputs}
        return {name: None if t is None else t.as_numpy() for name, t in tensors.items()}

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
