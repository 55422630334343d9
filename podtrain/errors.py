"""User-facing errors: each says what was wrong and what to do; the CLI prints it and exits 2."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """An error's first line, to quote a library's error inside podtrain's paragraph."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


class PodtrainError(Exception):
    """An error the user can fix. The CLI prints the message without a traceback."""

    exit_code = 2


class ConfigError(PodtrainError):
    """Malformed YAML, unknown key, wrong type or an inconsistent combination of values."""


class DeviceError(PodtrainError):
    """A forced device type that is not present."""


class MeshError(PodtrainError):
    """A mesh shape that does not match the devices."""


class DataError(PodtrainError):
    """Missing or unusable training data."""


class TrainingDiverged(PodtrainError):
    """A loss that is no longer finite."""


class CheckpointError(PodtrainError):
    """A run directory or checkpoint that cannot be used."""


class StorageError(PodtrainError):
    """A path in a bucket that cannot be reached or used, or a scheme podtrain does not serve."""


class DiskFull(CheckpointError):
    """A checkpoint the disk had no room for."""


class SaveFailed(CheckpointError):
    """A checkpoint the storage failed to write (a bucket unreachable through every retry). The earlier
    checkpoints are intact and rerunning resumes from them: EX_TEMPFAIL, "try again", as for Preempted."""

    exit_code = 75


class DistributedError(PodtrainError):
    """A half-set multi-process environment, or processes that cannot join each other."""


class PeerLost(DistributedError):
    """Another process of the job was lost. Nothing here is the user's to fix and a restart on the
    processes left recovers: an exit code of its own that asks for one, distinct from an error (2)
    and from a requested stop (75)."""

    exit_code = 76


class Preempted(PodtrainError):
    """Stopped by SIGTERM or SIGINT after saving a checkpoint; rerunning the same command resumes.
    The exit code is EX_TEMPFAIL, "try again", distinct from errors (2) and from being killed (128 + signal)."""

    exit_code = 75


class DoesNotFit(PodtrainError):
    """A train step that needs more memory than a device has."""


class RunInUse(PodtrainError):
    """A run directory another job is writing."""


class ChecksFailed(PodtrainError):
    """A `doctor` check that failed; its line names the fix."""
