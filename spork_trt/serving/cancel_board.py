"""Cancels that reach whichever `spork` instance serves a request. A unary model (spork_unary, ensemble_unary)
cannot cancel the BLS request it sent (Triton 2.51), so it sends each request a random key (io_spec.CANCEL_KEY;
triton_unary.py) and, when its client cancels, a second request carrying that key alone; Triton hands that one to
any instance, so the key is posted on a board every instance of the machine reads (one empty file per key in a
private folder), and the instance serving the request sees it at its next step.

The serving instance marks its request's key as running (`serving`, a file under run/) and takes both off when the
request ends. A cancel of a running request is always taken (their number is bounded by the requests served). A
cancel of a key no request runs yet (it overtook its request in Triton's queue, or it is a guess) waits on the
board until its request starts or `max_age_s` passes; at most `max_keys` of those wait (beyond: QueueFull,
UNAVAILABLE, retry later), so a flood of made-up keys can neither fill the disk with names nor keep a client from
cancelling its running request."""
from __future__ import annotations

import os
import re
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from spork_trt.errors import QueueFull
from spork_trt.io_spec import CANCEL_KEY_HEX

KEY = re.compile(f"[0-9a-f]{{{CANCEL_KEY_HEX}}}")
RUN = "run"  # the board's sub-folder of running requests' keys


def touch(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600))


def new_key() -> str:
    return secrets.token_hex(CANCEL_KEY_HEX // 2)


@dataclass(frozen=True)
class CancelBoard:
    root: Path  # shared by the instances of one machine; keys are random, so servers may share it too
    max_age_s: float = 60.0  # a posted key nobody took off is swept after this
    max_keys: int = 4096  # posted for no running request, not yet taken off or swept; beyond: refused
    max_run_s: float = 86400.0  # a running mark older than this is an instance that died: swept

    @classmethod
    def default(cls) -> CancelBoard:
        """The user's board in the temp folder (each user their own: nobody else can post or read keys)."""
        return cls(Path(tempfile.gettempdir()) / f"spork_trt-cancel-{os.getuid()}")

    def post(self, key: str) -> None:
        """Cancel the request carrying `key`, wherever it is served."""
        self.own()
        if not self.running(key) and self.sweep() >= self.max_keys:
            raise QueueFull(f"{self.max_keys} cancels wait for requests not running: retry later")
        touch(self.path(key))

    def serving(self, key: str) -> None:
        """The request carrying `key` runs here: a cancel of it is always taken."""
        self.own()
        (self.root / RUN).mkdir(mode=0o700, exist_ok=True)
        touch(self.mark(key))

    def running(self, key: str) -> bool:
        return self.mark(key).exists()

    def own(self) -> None:
        """The board's folder, made private to this user; someone else's folder is never trusted."""
        self.root.mkdir(mode=0o700, exist_ok=True)
        if self.root.stat().st_uid != os.getuid():
            raise PermissionError(f"{self.root} belongs to another user")

    def posted(self, key: str) -> bool:
        try:
            return self.path(key).exists()
        except OSError:  # a board this user cannot read holds no cancel of theirs
            return False

    def clear(self, key: str) -> None:
        """The request carrying `key` ended: forget its key."""
        self.path(key).unlink(missing_ok=True)
        self.mark(key).unlink(missing_ok=True)

    def sweep(self) -> int:
        """Drop posted keys older than max_age_s and running marks older than max_run_s; the number of posted keys
        left that no request runs."""
        now, left = time.time(), 0
        run = self.root / RUN
        for p in [*self.root.iterdir(), *(run.iterdir() if run.is_dir() else ())]:
            try:
                if p == run:
                    continue
                age = now - p.stat(follow_symlinks=False).st_mtime
                if age > (self.max_run_s if p.parent == run else self.max_age_s):
                    p.unlink()
                elif p.parent != run and not (run / p.name).exists():
                    left += 1
            except FileNotFoundError:  # another instance swept it first
                pass
        return left

    def mark(self, key: str) -> Path:
        """Where the instance serving `key`'s request marks it running."""
        return self.root / RUN / self.path(key).name

    def path(self, key: str) -> Path:
        if not KEY.fullmatch(key):  # checked at the edge (request_tensors.cancel_key): a name inside root, always
            raise ValueError("not a cancel key")
        return self.root / key
