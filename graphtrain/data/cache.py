"""Crash- and concurrency-safe creation of cache files (tokenizer.json, token streams).

Why: several ranks of one job start at once and share a cache directory, and a run can be killed at
any moment. Two mechanisms, each enough on its own where it works:

- an exclusive ``fcntl.flock`` on ``<name>.lock`` makes the first process build while the others wait
  and then load its result (on file systems without working flock, e.g. some NFS setups, every process
  may build);
- every build writes a temp file unique to its process, fsyncs it and ``os.replace``s it onto the final
  name, so a reader never sees a half-written file and a killed process leaves at most a stray temp.
  The lock file is removed after each build, successful or not.

Builds are deterministic, so when several processes do build, whichever ``os.replace`` lands last
installs the same bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False  # no flock here (some network file systems): the atomic rename suffices
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_cached(path: Path, build: Callable[[Path], None]) -> Path:
    """Return ``path``, first creating it with ``build(temp_path)`` if it does not exist yet.

    ``build`` must write the complete file at the temp path it is given; it is then fsynced and
    atomically renamed to ``path``. Returns immediately, without locking, if ``path`` exists.
    """
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    with _file_lock(lock):
        if path.exists():  # another process built it while we waited for the lock
            return path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            build(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
            # No empty .lock left per build or failed attempt. Safe while we hold it: a waiter
            # on the old file then finds the result (or builds, as without flock), a newcomer
            # finds the result or locks a new file; a build is atomic either way.
            lock.unlink(missing_ok=True)
    return path
