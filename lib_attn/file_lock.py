"""An exclusive lock shared by processes, held on a lock file of its own: ``fcntl.flock`` on POSIX
(Linux, macOS), ``msvcrt.locking`` on its first byte on Windows.

The operating system drops the lock when its holder closes the file or exits, so a process that
crashes leaves no stale lock behind. The lock file itself stays: removing it could let two processes
lock two different files of the same name.
"""
from __future__ import annotations

import errno
import os
import time

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

# Errors msvcrt.locking gives when another process holds the byte.
_BUSY = {errno.EACCES, getattr(errno, "EDEADLK", None), getattr(errno, "EDEADLOCK", None)} - {None}
_POLL_S = (0.001, 0.005)  # first and longest wait between tries


def _try_lock(fd: int) -> bool:
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
    os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the current position
    try:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


class FileLock:
    """The lock on the file at ``path``: ``acquire(timeout)``, then ``release()``."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def acquire(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (0: one try) for the lock. TimeoutError when another
        process held it all that time; OSError when the lock file cannot be opened or locked."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            deadline = time.monotonic() + timeout
            wait = _POLL_S[0]
            while not _try_lock(fd):
                left = deadline - time.monotonic()
                if left <= 0:
                    held = f"for more than {timeout:g} s" if timeout > 0 else "now"
                    raise TimeoutError(f"another process holds it {held}")
                time.sleep(min(wait, left))
                wait = min(2 * wait, _POLL_S[1])
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _unlock(fd)
        except OSError:
            pass  # closing the file below releases it as well
        finally:
            os.close(fd)
