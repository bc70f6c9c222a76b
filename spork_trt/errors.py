"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Something the user can fix; the message says what is wrong and how to fix it."""


class QueueFull(Exception):
    """Every slot is in use and the wait queue is full: the server answers 'unavailable, retry later'."""
