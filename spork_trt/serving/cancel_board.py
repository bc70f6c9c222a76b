"""Cancels that reach whichever `spork` instance serves a request. A unary model (spork_unary, ensemble_unary)
cannot cancel the BLS request it sent (Triton 2.51), so it sends each request a random key (io_spec.CANCEL_KEY;
triton_unary.py) and, when its client cancels, a second request carrying that key alone; Triton hands that one to any instance, so the key is posted on a board every
instance of the machine reads (one empty file per key in a private folder), and the instance serving the request
sees it at its next step. The serving instance takes its key off when the request ends; a post also sweeps keys
older than `max_age_s` (cancels of requests already gone, or never here), and a board holding `max_keys` refuses
more (QueueFull: UNAVAILABLE, retry later), so a flood of cancels cannot fill the disk with names."""
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


def new_key() -> str:
    return secrets.token_hex(CANCEL_KEY_HEX // 2)


@dataclass(frozen=True)
class CancelBoard:
    root: Path  # shared by the instances of one machine; keys are random, so servers may share it too
    max_age_s: float = 60.0  # a posted key nobody took off is swept after this
    max_keys: int = 4096  # posted and not yet taken off or swept; beyond: refused

    @classmethod
    def default(cls) -> CancelBoard:
        """The user's board in the temp folder (each user their own: nobody else can post or read keys)."""
        return cls(Path(tempfile.gettempdir()) / f"spork_trt-cancel-{os.getuid()}")

    def post(self, key: str) -> None:
        """Cancel the request carrying `key`, wherever it is served."""
        self.root.mkdir(mode=0o700, exist_ok=True)
        if self.root.stat().st_uid != os.getuid():  # someone else's folder: never trust what it holds
            raise PermissionError(f"{self.root} belongs to another user")
        if self.sweep() >= self.max_keys:
            raise QueueFull(f"{self.max_keys} cancels are pending: retry later")
        fd = os.open(self.path(key), os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        os.close(fd)

    def posted(self, key: str) -> bool:
        try:
            return self.path(key).exists()
        except OSError:  # a board this user cannot read holds no cancel of theirs
            return False

    def clear(self, key: str) -> None:
        """The request carrying `key` ended: forget its key."""
        self.path(key).unlink(missing_ok=True)

    def sweep(self) -> int:
        """Drop keys older than max_age_s; the number left."""
        cutoff, left = time.time() - self.max_age_s, 0
        for p in self.root.iterdir():
            try:
                if p.stat(follow_symlinks=False).st_mtime < cutoff:
                    p.unlink()
                else:
                    left += 1
            except FileNotFoundError:  # another instance swept it first
                pass
        return left

    def path(self, key: str) -> Path:
        if not KEY.fullmatch(key):  # checked at the edge (request_tensors.cancel_key): a name inside root, always
            raise ValueError("not a cancel key")
        return self.root / key
