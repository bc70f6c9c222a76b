"""The exceptions a front end answers with: bad user input (the CLI prints its message on one line and exits 2), a
full server, an internal failure (named by the request's id only)."""
from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message says what is wrong and how to fix it."""


class FieldError(UserError):
    """A bad value of one request field. The message starts with the field's name, which every front end spells its
    own way (io_spec.REQUEST_FIELDS: the config field, the Triton tensor, the CLI flag): `named` is the same message
    under another spelling."""

    def __init__(self, field: str, rest: str, name: str | None = None) -> None:
        self.field, self.rest = field, rest  # rest: the message after the name ("must be ..., got ...")
        super().__init__(f"{name or field} {rest}")

    def named(self, name: str) -> FieldError:
        return FieldError(self.field, self.rest, name)


# words every "try again" answer of the server carries (a full queue, a draining or failed instance; Triton's own
# full queue in front of a unary model): the request did nothing, so a client may send it again, later or to another
# replica (triton_client.py, openai_api/upstream.py)
RETRY_HINTS = ("retry later", "retry on another instance", "Exceeds maximum queue size",
               "is not healthy")  # Triton's "Stub process 'spork_0_0' is not healthy.": its engine process stopped
# answering (a replica the watchdog is about to replace); another replica can take the request


def retryable(message: str) -> bool:
    """The server's message says the request did nothing and may be sent again (RETRY_HINTS)."""
    return any(h in message for h in RETRY_HINTS)


class Unanswered(UserError):
    """A request that got no answer yet and may be sent again (refused as unavailable, or its connection failed
    before the first response)."""


class QueueFull(Exception):
    """Every slot is in use and the wait queue is full: the server answers 'unavailable, retry later'."""


class InternalError(Exception):
    """A request failed on the server's side: the client's answer names the request's id and nothing else (the
    detail is in the server's log under that id)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"internal error in request {request_id}: the server logged the detail (quote this id)")
