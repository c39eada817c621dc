"""Files canaryd reads and writes, safely: only regular files are read, and what it writes is private.

Reading: a config, canary suite, pin or key file must be a regular file. ``/dev/zero`` would be read until
memory runs out and a FIFO would block the reader (``validate``, or a SIGHUP reload) forever, so the path
is checked with ``stat`` before it is opened, opened with ``O_NONBLOCK`` (a FIFO swapped in meanwhile
cannot block the open), checked again on the open descriptor, and never read past ``limit`` bytes.

Writing: the history (database, WAL, SHM), exports, pins and records are private to their owner whatever
the caller's umask: `private_umask` (the CLI's first step) sets umask 0077, as the systemd unit's
``UMask=`` does, and `write_private` creates files 0600 on its own (for callers that are not the CLI).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from canaryd.errors import InputError

FILE_MODE, DIR_MODE = 0o600, 0o700
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

# The umask the process started with: a command canaryd runs for the user (`preflight`) gets it back.
original_umask: int | None = None


def private_umask() -> None:
    """Make everything this process creates private (dirs 0700, files 0600), remembering the old umask."""
    global original_umask
    old = os.umask(0o077)
    if original_umask is None:
        original_umask = old


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _check(path: Path, what: str, st: os.stat_result, limit: int | None, limit_key: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: {what} must be a regular file, not {_kind(st.st_mode)}")
    if limit is not None and st.st_size > limit:
        raise InputError(
            f"{path}: {what} is {st.st_size} bytes, more than {limit_key} ({limit} bytes); not read"
        )


def read_regular(path: Path, what: str, *, limit: int | None = None, limit_key: str = "the limit") -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes.

    Anything else (a directory, a device, a FIFO, a socket, a file over the limit) is an `InputError` naming
    the file; a missing or unreadable file raises the `OSError` (callers word those themselves), and bytes
    that are not UTF-8 a `UnicodeDecodeError`.
    """
    _check(path, what, os.stat(path), limit, limit_key)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(path, what, os.fstat(fd), limit, limit_key)  # the file opened is the file checked
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:  # it grew since the stat
                raise InputError(f"{path}: {what} is more than {limit_key} ({limit} bytes); not read")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``; a file it creates is 0600 whatever the umask (an existing file
    keeps its mode, as a shell redirection would)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def exposed(path: Path) -> str | None:
    """Why a secret file is exposed (a symlink, or readable by group or others), or None when it is not."""
    try:
        st = os.lstat(path)
    except OSError:
        return None  # the reader reports a missing file
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink (its target's permissions are not checked)"
    if st.st_mode & 0o044:
        who = "group and others" if st.st_mode & 0o004 else "its group"
        return f"is readable by {who} (mode {st.st_mode & 0o777:04o})"
    return None
