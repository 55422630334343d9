"""One writer per run directory: RUN_DIR/.lock, an OS file lock and a lease.

A job holds the lock while it writes the run: a second job on the same directory is refused at
once, naming the holder. The OS releases the lock when the holder's process ends, however it
ends, so no stale lock survives a crash.

Shared file systems may not carry the lock from host to host, so the file is a lease as well: it
names its holder (host, pid, since), and its modification time is a heartbeat, renewed every
RENEW_S while the job runs; a job that ends clears it. A job on another host refuses a lease
renewed within STALE_S and takes over an older one, whose holder died without clearing it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from podtrain.errors import RunInUse

RENEW_S = 15
STALE_S = 120


def _in_use(run_dir: Path, holder: str, renewed: str = "") -> RunInUse:
    return RunInUse(
        f"{run_dir} is in use by another job ({holder}{renewed}); wait for it to end, stop it, or give this job its "
        "own run_dir."
    )


def _check(run_dir: Path, file) -> None:
    """Refuse a fresh lease of another host; take over a stale one. This host's are the lock's to decide."""
    file.seek(0)
    holder = file.read().strip()
    if not holder or holder.startswith(f"host {socket.gethostname()},"):
        return
    silent = time.time() - os.fstat(file.fileno()).st_mtime
    if silent < STALE_S:
        raise _in_use(run_dir, holder, f"; its lease was renewed {silent:.0f} s ago")
    print(
        f"[podtrain] taking over {run_dir} from a job whose lease was last renewed {silent:.0f} s ago ({holder})",
        file=sys.stderr,
    )


@contextmanager
def _renewed(path: str):
    """Touch `path` every RENEW_S while inside."""
    stop = threading.Event()

    def beat():
        while not stop.wait(RENEW_S):
            with suppress(OSError):  # a run directory removed under the job: nothing left to renew
                os.utime(path)

    thread = threading.Thread(target=beat, name="podtrain-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def hold(run_dir: Path):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            raise _in_use(run_dir, file.read().strip() or "another process") from None
        _check(run_dir, file)
        file.truncate(0)
        file.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        try:
            with _renewed(file.name):
                yield
        finally:
            file.truncate(0)  # no longer held
            fcntl.flock(file, fcntl.LOCK_UN)
