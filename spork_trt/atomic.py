"""Files and folders that appear whole or not at all: every artifact, cache and result is written to a temporary
name in its own folder (the same filesystem) and renamed into place, so a reader, or a run that resumes after a
crash (an exception or a kill at any point), sees the old content or the new, never a part.

Temporary names start with "." and end with ".tmp": no glob for a real file (`*.jsonl`, `confidence_head*.json`)
picks one up. A killed writer may leave one behind; the next write of the same file does not reuse it.
"""
from __future__ import annotations

import builtins
import ctypes
import errno
import glob
import itertools
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_serial = itertools.count()  # two writers of one file in one process (threads) get different temporary names
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # linux/fcntl.h, linux/fs.h


TEMP = re.compile(r"\..+\.\d+-\d+\.[a-z]+")  # temp_name's pattern


def is_temp(name: str) -> bool:
    """`name` is one temp_name makes (a writer's, alive or killed), not a user's dot-file."""
    return TEMP.fullmatch(name) is not None


def temp_name(dest: Path, tag: str = "tmp") -> Path:
    """A fresh hidden name beside `dest` (this process's, never another's)."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{os.getpid()}-{next(_serial)}.{tag}")


@contextmanager
def path(dest: str | Path) -> Iterator[Path]:
    """`with atomic.path(dest) as tmp:` write the file `tmp`; it becomes `dest` when the block ends, and is removed
    if the block raises (`dest` is then untouched)."""
    dest = Path(dest)
    tmp = temp_name(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # raised: the partial file goes; replaced: nothing is left to remove


@contextmanager
def open(dest: str | Path, mode: str = "w", **kw) -> Iterator:
    """`with atomic.open(dest, "wb") as fh:` a new file that becomes `dest` when the block ends (np.save, json.dump
    and savefig write to file objects as to paths)."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic.open writes a whole new file (mode w or wb), not {mode!r}")
    with path(dest) as tmp, builtins.open(tmp, mode, **kw) as fh:
        yield fh


def write_text(dest: str | Path, text: str) -> Path:
    with open(dest, "w") as fh:
        fh.write(text)
    return Path(dest)


def write_bytes(dest: str | Path, data: bytes) -> Path:
    with open(dest, "wb") as fh:
        fh.write(data)
    return Path(dest)


def copy_file(src: str | Path, dest: str | Path) -> Path:
    with path(dest) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dest)


@contextmanager
def folder(dest: str | Path) -> Iterator[Path]:
    """`with atomic.folder(dest) as tmp:` fill the new, empty folder `tmp` (beside `dest`); it replaces `dest` whole
    when the block ends (replace_dir), and is removed if the block raises (`dest` is then untouched). Folders that
    killed writers left beside `dest` are removed first (sweep)."""
    dest = Path(dest).resolve()  # a symlink's target is replaced, beside it (the same filesystem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep(dest)
    tmp = temp_name(dest, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sweep(dest: Path) -> None:
    """Remove the temporary files and folders beside `dest` whose writer process is gone (killed mid-write)."""
    name = Path(dest).name
    for p in Path(dest).parent.glob(f".{glob.escape(name)}.*-*.*"):
        pid = p.name[len(name) + 2:].partition("-")[0]
        if not pid.isdigit() or alive(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def replace_dir(new: Path, dest: Path) -> None:
    """Put the folder `new` at `dest` (same filesystem) in one step; the old `dest`, if any, is removed after.
    Linux exchanges the two names atomically (renameat2 RENAME_EXCHANGE), so `dest` always names a whole folder,
    the old or the new one; where the filesystem cannot, two renames (a kill between them leaves the old folder at
    a hidden name beside `dest` and none at `dest`)."""
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.rename(new, dest)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, "renameat2", None) is not None:
        if libc.renameat2(AT_FDCWD, os.fsencode(new), AT_FDCWD, os.fsencode(dest), RENAME_EXCHANGE) == 0:
            shutil.rmtree(new)  # the old folder, now under the temporary name
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(dest))
    old = temp_name(dest, "old")
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old)
