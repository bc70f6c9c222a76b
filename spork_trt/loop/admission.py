"""The one admission check: what a request may generate and the KV positions it needs. The engine core runs it on
every request it queues, the service before it queues one (so a bad request is answered before any work), and
`generate` to size its one slot. Its errors name the prompt and max_new_tokens; a front end spells them its own way
(errors.FieldError.named)."""
from __future__ import annotations

from dataclasses import dataclass

from spork_trt.config import SpecConfig
from spork_trt.errors import FieldError, UserError


@dataclass(frozen=True)
class Size:
    max_new: int  # new tokens the request may generate
    room: int  # KV positions it may use: prompt + max_new + one step's tree (SpecConfig.tree_room)


def size_request(prompt_len: int, max_new_tokens: int, spec: SpecConfig, context: int, slot: int | None = None,
                 clip: bool = True) -> Size:
    """A request of `prompt_len` prompt tokens asking for `max_new_tokens` in a `context` window: its new tokens are
    clipped to the window (`clip`; else more than fit is refused), and it must fit a slot of `slot` positions."""
    if prompt_len == 0:
        raise FieldError("prompt", "encodes to no tokens: send some text", "the prompt")
    if prompt_len >= context:
        raise FieldError("prompt", f"has {prompt_len} tokens but the context window is {context}: shorten it",
                         "the prompt")
    fits = context - prompt_len
    if max_new_tokens > fits and not clip:
        raise FieldError("max_new_tokens", f"{max_new_tokens} is beyond the context: the prompt has {prompt_len} "
                         f"tokens and the context window is {context}, so at most {fits} new tokens fit")
    max_new = min(max_new_tokens, fits)
    size = Size(max_new, prompt_len + max_new + spec.tree_room)
    if slot is not None and size.room > slot:
        raise UserError(f"the request needs {size.room} KV positions (prompt {prompt_len} + max_tokens {max_new} + "
                        f"a draft tree) and a slot holds {slot}: shorten it")
    return size
