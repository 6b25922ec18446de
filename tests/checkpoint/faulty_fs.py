"""A fault-injecting in-memory fsspec filesystem: `faulty://...` URLs for unit tests.

It behaves like fsspec's MemoryFileSystem (with a store of its own, separate from memory://), except that
writes and removes can be made to fail on demand through the module-level `faults` controller:

    faults.fail_writes(count=2)                      # the next 2 writes raise OSError(ENOSPC)
    faults.fail_writes(after=1, error="EACCES")      # the first write passes, then every write fails
    faults.fail_removes(match="step-00000002")       # rm of matching paths raises PermissionError
    faults.heal()                                    # everything works again

A failing write can leave a truncated file behind (`partial=True`), like a disk that filled up mid-file.
Every write and remove is recorded (`faults.writes`, `faults.removes`) so that tests can check the order
of operations. `faults.before_write` is an optional hook called with the path before each write (to slow
writes down or to interleave a second writer at an exact point).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

PROTOCOL = "faulty"

_ERRORS = {
    "ENOSPC": lambda path: OSError(errno.ENOSPC, "No space left on device (injected)", path),
    "EACCES": lambda path: PermissionError(errno.EACCES, "Permission denied (injected)", path),
    "EIO": lambda path: OSError(errno.EIO, "Input/output error (injected)", path),
}


class _Rule:
    """Fail `count` matching calls (None: until healed) after letting `after` matching calls through."""

    def __init__(self, count: int | None, after: int, error: str, match: str | None) -> None:
        self.count = count
        self.after = after
        self.error = error
        self.match = match

    def fires(self, path: str) -> bool:
        if self.match is not None and self.match not in path:
            return False
        if self.after > 0:
            self.after -= 1
            return False
        if self.count is None:
            return True
        if self.count > 0:
            self.count -= 1
            return True
        return False


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.heal()
        self.writes: list[str] = []
        self.removes: list[str] = []
        self.failed_writes: list[str] = []
        self.failed_removes: list[str] = []
        self.before_write: Callable[[str], None] | None = None

    def heal(self) -> None:
        self._write_rule: _Rule | None = None
        self._remove_rule: _Rule | None = None
        self.partial = False

    def fail_writes(
        self,
        count: int | None = None,
        after: int = 0,
        error: str = "ENOSPC",
        match: str | None = None,
        partial: bool = False,
    ) -> None:
        self._write_rule = _Rule(count, after, error, match)
        self.partial = partial

    def fail_removes(
        self, count: int | None = None, after: int = 0, error: str = "EACCES", match: str | None = None
    ) -> None:
        self._remove_rule = _Rule(count, after, error, match)

    def check_write(self, path: str) -> OSError | None:
        with self._lock:
            rule = self._write_rule
            if rule is not None and rule.fires(path):
                self.failed_writes.append(path)
                return _ERRORS[rule.error](path)
            self.writes.append(path)
            return None

    def check_remove(self, path: str) -> None:
        with self._lock:
            rule = self._remove_rule
            if rule is not None and rule.fires(path):
                self.failed_removes.append(path)
                raise _ERRORS[rule.error](path)
            self.removes.append(path)


faults = Faults()


class FaultyFileSystem(MemoryFileSystem):
    protocol = PROTOCOL
    store: dict = {}  # noqa: RUF012 (class-level on purpose, like MemoryFileSystem: one shared store)
    pseudo_dirs = [""]  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    @classmethod
    def clear(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if faults.before_write is not None:
            faults.before_write(self._strip_protocol(path))
        error = faults.check_write(self._strip_protocol(path))
        if error is not None:
            if faults.partial:
                super().pipe_file(path, bytes(value[: len(value) // 2]), **kwargs)
            raise error
        return super().pipe_file(path, value, mode=mode, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" not in mode and "data" not in kwargs:  # a plain open-for-write (pipe_file checked already)
            if faults.before_write is not None:
                faults.before_write(self._strip_protocol(path))
            error = faults.check_write(self._strip_protocol(path))
            if error is not None:
                raise error
        return super()._open(path, mode=mode, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        faults.check_remove(self._strip_protocol(path))
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
