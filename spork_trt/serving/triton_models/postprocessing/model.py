"""Triton python model `postprocessing`: the spork step's token ids -> the text this response adds.
Stateless (every response carries its new ids after a few already sent, and how many those are), so a stream never
splits a multi-byte character and never decodes the whole prefix. Each request gets its own response or error.
A thin adapter: the logic is spork_trt.serving.triton_steps.decode_chunk (tested without Triton)."""
import triton_python_backend_utils as pb_utils

from spork_trt.errors import UserError
from spork_trt.serving.engine_service import public_error
from spork_trt.serving.triton_steps import decode_chunk, model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tok = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:  # one request's failure never fails the others
            try:
                ids, sent, final, cut_at = (pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                                            for n in ("output_ids", "sent_len", "final", "cut_at"))
                text = decode_chunk(self.tok, ids, sent, final, cut_at)  # [1, 1] bytes
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
            except Exception as e:  # bad input as it is; anything else by its id only (the detail logged under it)
                code = pb_utils.TritonError.INVALID_ARG if isinstance(e, UserError) else pb_utils.TritonError.INTERNAL
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"postprocessing: {public_error(e)}", code)))
        return responses
