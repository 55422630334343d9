"""One writer per run directory: RUN_DIR/.lock, an OS file lock and a lease.

A job holds the lock while it writes the run: a second job on the same directory is refused at
once, naming the holder. The OS releases the lock when the holder's process ends, however it
ends, so no stale lock survives a crash.

Shared file systems may not carry the lock from host to host, so the file is a lease as well: it
names its holder (host, pid, since), and its modification time is a heartbeat, renewed every
RENEW_S while the job runs; a job that ends clears it. A job on another host refuses a lease
renewed within STALE_S and takes over an older one, whose holder died without clearing it.

In a bucket, which has no locks, the lease is the object RUN_DIR/.lock alone, created only if
absent (GCS if-generation-match=0, S3 If-None-Match), so of two jobs starting at once one wins. It
records its holder, a token of its own (a create retried after its answer was lost finds its own
object) and the time of its last renewal; a lease not renewed within STALE_S, or held by a process
of this host that no longer runs (a job killed and restarted here), is replaced, again only if
absent, and the job that ends deletes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path

from podtrain import storage
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
def _renewed(renew):
    """Call `renew` every RENEW_S while inside."""
    stop = threading.Event()

    def beat():
        while not stop.wait(RENEW_S):
            with suppress(Exception):  # a run directory removed under the job, a bucket's hiccup: next beat
                renew()

    thread = threading.Thread(target=beat, name="podtrain-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def hold(run_dir):
    storage.makedirs(run_dir)
    if storage.is_remote(run_dir):
        with _held_in_bucket(run_dir):
            yield
        return
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
            with _renewed(lambda: os.utime(file.name)):
                yield
        finally:
            file.truncate(0)  # no longer held
            fcntl.flock(file, fcntl.LOCK_UN)


def _holder() -> dict:
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "token": uuid.uuid4().hex}


def _alive(holder: dict) -> bool:
    """Whether a lease's holder may still run: another host's may, this host's only if its process does."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder.get("pid", 0)), 0)
        return True
    except (OSError, ValueError):
        return False


def _lease(holder: dict) -> bytes:
    """The lease object's content: its holder, renewed now."""
    return json.dumps({**holder, "renewed": time.time()}).encode()


def _take(fs, name: str, holder: dict) -> dict | None:
    """Create the lease object if it is absent: None once this job holds it, else the lease found. A
    create whose answer was lost is retried by the client and finds the object there: its token
    tells it is this job's."""
    try:
        fs.pipe_file(name, _lease(holder), mode="create")
        return None
    except FileExistsError:
        try:
            other = json.loads(fs.cat_file(name))
        except (FileNotFoundError, ValueError):  # ended meanwhile, or half of a foreign file: try once more
            return {"renewed": 0}
        return None if other.get("token") == holder["token"] else other


@contextmanager
def _held_in_bucket(run_dir):
    fs, name, holder = storage.filesystem(run_dir), f"{storage.key(run_dir).rstrip('/')}/.lock", _holder()
    if (other := _take(fs, name, holder)) is not None:
        silent = time.time() - other.get("renewed", 0)
        described = f"host {other.get('host')}, pid {other.get('pid')}, since {other.get('since')}"
        if silent < STALE_S and _alive(other):
            raise _in_use(run_dir, described, f"; its lease was renewed {silent:.0f} s ago")
        print(f"[podtrain] taking over {run_dir} from a job that ended without clearing its lease ({described})")
        with suppress(FileNotFoundError):
            fs.rm_file(name)
        if _take(fs, name, holder) is not None:
            raise _in_use(run_dir, "a job that took it over at the same moment")
    try:
        with _renewed(lambda: fs.pipe_file(name, _lease(holder))):
            yield
    finally:
        with suppress(Exception):  # a bucket gone: the lease goes stale by itself
            fs.rm_file(name)
