"""Triton python model `preprocessing`: text_input -> input_ids through the chat template.
A thin adapter: the logic is spork_trt.serving.triton_steps.encode_text (tested without Triton)."""
import triton_python_backend_utils as pb_utils

from spork_trt.errors import UserError
from spork_trt.serving.engine_service import public_error
from spork_trt.serving.triton_steps import encode_text, model_text_limit, model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tok = model_tokenizer(args)
        self.max_bytes = model_text_limit(args, self.tok)  # longer texts are refused before any work

    def execute(self, requests):
        responses = []
        for request in requests:  # each request gets its own response, or its own error
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input")  # [1, 1] bytes, or absent
                ids = encode_text(self.tok, None if text is None else text.as_numpy(), self.max_bytes)  # [1, n]
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
            except UserError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
            except Exception as e:  # its id only: the detail is logged under it
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"preprocessing: {public_error(e)}", pb_utils.TritonError.INTERNAL)))
        return responses
