"""A checkpoint that does not fit its disk: a warning before the save, one paragraph after it fails.

orbax writes a checkpoint in background threads. A full disk fails the writes there; the error
reaches podtrain at the next save or at the end of the run, and is reported with the free space
against what a checkpoint needs and the step a rerun resumes from (orbax's own records of it are
dropped by podtrain.train.orbax_quiet).
"""

from __future__ import annotations

import errno
import shutil
import time
from pathlib import Path

from podtrain import storage
from podtrain.errors import DiskFull


def says_full(text: str) -> bool:
    return "No space left on device" in text  # strerror(ENOSPC), as tensorstore's messages quote it


def is_full(error: BaseException | None) -> bool:
    """Whether an error, or one it arose from, is a full disk: ENOSPC from Python's writes, or
    tensorstore's RESOURCE_EXHAUSTED "Failed writing ... No space left on device"."""
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or says_full(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def free_bytes(directory: str) -> int | None:
    """Free bytes on the file system of a local directory (or of its nearest existing parent);
    None for remote storage (gs://...), where podtrain cannot tell."""
    if storage.is_remote(directory):
        return None
    path = Path(directory)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:,.1f} MiB"


def short_of_space(directory: str, needed: int, step: int) -> str | None:
    """The warning before a save that cannot fit, or None when it can (or when podtrain cannot tell)."""
    free = free_bytes(directory)
    if free is None or free >= needed:
        return None
    return (
        f"[podtrain] warning: {directory} has {mib(free)} free and a checkpoint of this run takes about "
        f"{mib(needed)}: the save of step {step} will likely fail. Free some space there, or set checkpoint.dir to "
        "a larger disk."
    )


def remove_partial(directory: str, step: int) -> None:
    """The folder a failed save left (orbax writes a step into <step>.orbax-checkpoint-tmp...):
    nothing in it can be restored, and its room is what the next save needs."""
    if not storage.is_remote(directory):
        for folder in Path(directory).glob(f"{step}.orbax-checkpoint-tmp*"):
            # The failed save's other writes may still land in it for a moment: remove until gone.
            deadline = time.monotonic() + 10
            while folder.exists() and time.monotonic() < deadline:
                shutil.rmtree(folder, ignore_errors=True)
                time.sleep(0.05)


def full_disk(step: int, directory: str, needed: int, intact: int | None) -> DiskFull:
    """The error of a checkpoint its disk could not hold."""
    kept = (
        f"The newest intact checkpoint is step {intact}; run the same command again to resume from it"
        if intact is not None
        else "No checkpoint of this run was written; run the same command again to start afresh"
    )
    return DiskFull(
        f"The checkpoint of step {step} could not be written to {directory}: its disk is full "
        f"({mib(free_bytes(directory))} free, a checkpoint of this run needs about {mib(needed)}). {kept} once there "
        "is room: free some space there (a lower checkpoint.keep keeps fewer) or set checkpoint.dir to a larger disk."
    )
