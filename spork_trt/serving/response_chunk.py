"""One response of the `spork` step and its output tensors, named and ordered as io_spec's table (the engine
service makes them; the Triton model sends them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spork_trt import io_spec
from spork_trt.loop.stats import Stats
from spork_trt.spec.logprobs import TokenLogprob


@dataclass(frozen=True)
class Chunk:
    """One response of the spork step."""

    output_ids: list[int]  # [n] the new tokens, after up to engine_service.DETOKENIZE_CONTEXT already sent (a window)
    sent_len: int  # how many of output_ids earlier responses carried (postprocessing decodes the rest)
    final: bool
    stats: Stats
    stop_reason: str  # "" until final
    prompt_len: int  # the prompt's tokens
    cut_at: tuple[str, ...] = ()  # the request's stop strings, on the final response: its text ends at the first
    logprobs: tuple[TokenLogprob, ...] = ()  # with the request's `logprobs`: one per token of output_ids[sent_len:]
    top: int = 0  # alternatives per token (the request's `logprobs`)

    def tensors(self) -> dict[str, np.ndarray]:
        """Output tensors with the batch dim, named as in io_spec."""
        st = self.stats
        values = {"output_ids": np.array([self.output_ids], np.int32),  # [1, n]
                  "sent_len": np.array([[self.sent_len]], np.int32), "final": np.array([[self.final]], np.bool_),
                  "cut_at": np.array([[s.encode() for s in self.cut_at]], np.object_),  # [1, k]
                  "acceptance_rate": np.array([[st.acceptance_rate]], np.float32),
                  "total_accepted_draft_tokens": np.array([[st.accepted_tokens]], np.int32),
                  "total_draft_tokens": np.array([[st.draft_tokens]], np.int32),
                  "mean_accepted_length": np.array([[st.mean_accepted_length]], np.float32),
                  "num_steps": np.array([[st.steps]], np.int32),
                  "cached_tokens": np.array([[st.cached_tokens]], np.int32),
                  "stop_reason": np.array([[self.stop_reason.encode()]], np.object_),
                  "num_input_tokens": np.array([[self.prompt_len]], np.int32),
                  "num_output_tokens": np.array([[len(self.output_ids) - self.sent_len]], np.int32)}
        values |= logprob_tensors(self.logprobs, self.top)
        spork = next(s for s in io_spec.TRITON_STEPS if s.name == "spork")
        assert list(values) == [t.name for t in spork.outputs]
        return values


def logprob_tensors(logs: tuple[TokenLogprob, ...], k: int) -> dict[str, np.ndarray]:
    """io_spec.LOGPROB_OUTPUTS of a response: [1, m], [1, m, k], [1, m, k] (m = 0 without logprobs)."""
    pad = [(-1, float("-inf"))] * k  # a token with fewer than k alternatives: id -1 fills the rest
    tops = [(list(x.top) + pad)[:k] for x in logs]
    ids = np.array([[[t for t, _ in top] for top in tops]], np.int32).reshape(1, len(logs), k)
    values = np.array([[[v for _, v in top] for top in tops]], np.float32).reshape(1, len(logs), k)
    return {"output_logprobs": np.array([[x.logprob for x in logs]], np.float32).reshape(1, len(logs)),
            "top_logprob_ids": ids, "top_logprobs": values}
