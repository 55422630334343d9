"""Where a path a user gives lives: the local disk, or a bucket (gs://..., s3://...).

Every such path goes through `path()`. A local one becomes a `pathlib.Path`; a bucket's becomes an
etils `epath.Path` (the path type orbax uses) over fsspec's gcsfs or s3fs, with the same methods:
`/`, read_text, write_text, read_bytes, open, glob, iterdir, is_file, is_dir, exists, mkdir. A
scheme podtrain does not serve is an error, so no `hdfs://...` ever becomes a local folder `hdfs:`.
orbax and tensorstore write checkpoint arrays to the same strings (podtrain.train.checkpoint).

Credentials come from the environment, as each library reads them: Application Default
Credentials or the metadata server for gcsfs and tensorstore, the AWS variables and files for
s3fs. Nothing of them is written into a run. Test servers are reached by the libraries' standard
settings (STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL; AWS_ENDPOINT_URL).

Transient errors (5xx, 429, a dropped connection) are retried with backoff by gcsfs, s3fs
(botocore) and tensorstore themselves; `explain` turns what is left (no such bucket, no access,
no credentials, no server) into one paragraph naming the path and what to check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from podtrain.errors import StorageError, first_line

# scheme: (the fsspec package that serves it, the podtrain extra that installs it)
SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}

# Libraries that log a warning per call for what is normal here (gcsfs: "Could not determine
# bucket type", anonymous access to an emulator), or retries they then make good.
_CHATTY = ("gcsfs", "gcsfs.credentials", "s3fs", "aiobotocore", "botocore", "google.auth", "fsspec")


def scheme(p: str | os.PathLike) -> str | None:
    """'gs' or 's3' for a bucket's path, None for a local one; an error for any other scheme."""
    text = str(p)
    if "://" not in text:
        return None
    name = text.split("://", 1)[0]
    if name not in SCHEMES:
        raise StorageError(
            f"{text}: podtrain reads and writes local paths, gs://BUCKET/... and s3://BUCKET/..., not {name}://. "
            "Copy the data to one of those, or mount it and give its local path."
        )
    return name


def is_remote(p: str | os.PathLike) -> bool:
    return scheme(p) is not None


def path(p: str | os.PathLike):
    """The path a user gave, local (`pathlib.Path`) or in a bucket (`epath.Path`)."""
    name = scheme(p)
    if name is None:
        return Path(p)
    package, extra = SCHEMES[name]
    if importlib.util.find_spec(package) is None:
        raise StorageError(
            f"{p} is in a bucket, and reaching {name}:// takes {package}, which is not installed: "
            f"pip install 'podtrain[{extra}]'."
        )
    _configure()
    from etils import epath

    return epath.Path(str(p))


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/part/...` as a string, keeping a bucket's `scheme://`."""
    return str(path(base).joinpath(*parts))


def write_bytes(target: str | os.PathLike, data: bytes) -> None:
    """Written whole or not at all: a local file through a temporary renamed over it (a kill leaves
    the last one); an object in a bucket is replaced whole by one upload anyway."""
    target = path(target)
    if is_remote(target):
        target.write_bytes(data)
        return
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_bytes(data)
    temporary.replace(target)


def write_text(target: str | os.PathLike, text: str) -> None:
    write_bytes(target, text.encode())


def makedirs(p: str | os.PathLike) -> None:
    """A local folder made with its parents; in a bucket, where folders are only key prefixes, a check
    that the bucket exists (a write there would fail later, less clearly)."""
    if not is_remote(p):
        Path(p).mkdir(parents=True, exist_ok=True)
        return
    bucket = key(p).split("/", 1)[0]
    try:
        found = filesystem(p).exists(bucket)
    except Exception as e:  # noqa: BLE001 - explained, or raised as it came
        raise explain(e, p) or e from None
    if not found:
        raise StorageError(f"{p}: the bucket {bucket} does not exist. Create it, or check the bucket's name.")


def cache_root() -> Path:
    """This host's cache of what it fetched from buckets: $PODTRAIN_CACHE, else $XDG_CACHE_HOME/podtrain."""
    default = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "podtrain"
    return Path(os.environ.get("PODTRAIN_CACHE", default))


def local_copy(p: str | os.PathLike) -> Path:
    """A local path holding what `p` holds, for libraries that read only local files (tokenizers,
    safetensors): `p` itself when local; for a bucket's file or folder, a copy in this host's cache,
    one per version of the objects (their names, sizes and generations), fetched once."""
    if not is_remote(p):
        return Path(p)
    fs, name = filesystem(p), key(p).rstrip("/")
    try:
        folder = fs.isdir(name)
        listing = fs.find(name, detail=True) if folder else {name: fs.info(name)}
    except FileNotFoundError:
        raise StorageError(f"{p} does not exist; check the path.") from None
    except Exception as e:  # noqa: BLE001
        raise explain(e, p) or e from None
    stamp = json.dumps({k: [v.get("size"), str(v.get("generation") or v.get("ETag"))] for k, v in listing.items()})
    copy = cache_root() / "buckets" / scheme(p) / f"{name}@{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    files = {remote: os.path.relpath(remote, name) if folder else os.path.basename(name) for remote in listing}
    if not copy.is_dir():
        _fetch(fs, files, copy)
    return copy if folder else copy / os.path.basename(name)


def _fetch(fs, files: dict[str, str], copy: Path) -> None:
    """The objects fetched into a folder of this process's own, renamed to `copy` whole: processes of
    one host that fetch the same version at once each end with a whole copy, never with one another's
    half (one renames its folder into place; the others find it there and drop theirs)."""
    copy.parent.mkdir(parents=True, exist_ok=True)
    fetching = Path(tempfile.mkdtemp(dir=copy.parent, prefix=f".{copy.name}."))
    try:
        for remote, relative in files.items():
            (fetching / relative).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(fetching / relative))
        fetching.rename(copy)
    except OSError:
        if not copy.is_dir():  # not a copy another process renamed into place first
            raise
    finally:
        shutil.rmtree(fetching, ignore_errors=True)


def upload(folder: str | os.PathLike, out: str | os.PathLike, last: tuple[str, ...] = ()) -> None:
    """The files of a local folder copied under `out` (in a bucket), those named in `last` after
    the rest: a reader that finds them (a manifest) finds everything they list."""
    files = sorted(f for f in Path(folder).rglob("*") if f.is_file())
    files.sort(key=lambda f: f.name in last)
    for file in files:
        path(out).joinpath(str(file.relative_to(folder))).write_bytes(file.read_bytes())


@contextmanager
def staged(out: str | os.PathLike, last: tuple[str, ...] = ()) -> Iterator[Path]:
    """A local folder to write what goes to `out`: `out` itself when local; for a bucket, a fresh local
    folder, uploaded to `out` when the block ends without an error (see `upload` for `last`)."""
    if not is_remote(out):
        Path(out).mkdir(parents=True, exist_ok=True)
        yield Path(out)
        return
    makedirs(out)
    with tempfile.TemporaryDirectory(prefix="podtrain-") as folder:
        yield Path(folder)
        upload(folder, out, last)


class Mirror:
    """A run directory's files that grow by appending (metrics.jsonl, TensorBoard events, logs),
    which an object in a bucket cannot do: written into a local folder, and copied whole to the
    bucket at most every `every` seconds and at close. For a local run directory the folder is the
    run directory itself and there is nothing to copy."""

    def __init__(self, run_dir: str | os.PathLike, fetch: tuple[str, ...] = (), every: float = 10.0):
        self.remote = path(run_dir) if is_remote(run_dir) else None
        self.every, self.synced, self.sent = every, 0.0, {}
        if self.remote is None:
            self.local = Path(run_dir)
            self.local.mkdir(parents=True, exist_ok=True)
            return
        self.local = Path(tempfile.mkdtemp(prefix="podtrain-run-"))
        for name in fetch:  # what a resumed run continues
            if (self.remote / name).is_file():
                (self.local / name).write_bytes((self.remote / name).read_bytes())
                self.sent[name] = self._version(self.local / name)

    @staticmethod
    def _version(file: Path) -> tuple[int, int]:
        stat = file.stat()
        return stat.st_size, stat.st_mtime_ns

    def sync(self, force: bool = False) -> None:
        if self.remote is None or (not force and time.monotonic() - self.synced < self.every):
            return
        self.synced = time.monotonic()
        for file in sorted(f for f in self.local.rglob("*") if f.is_file()):
            name = str(file.relative_to(self.local))
            if self.sent.get(name) != (version := self._version(file)):
                (self.remote / name).write_bytes(file.read_bytes())
                self.sent[name] = version

    def close(self) -> None:
        self.sync(force=True)
        if self.remote is not None:
            shutil.rmtree(self.local, ignore_errors=True)


def filesystem(p: str | os.PathLike):
    """The fsspec file system of a bucket's path (for range reads and conditional writes)."""
    import fsspec

    path(p)  # the scheme's checks and settings
    return fsspec.filesystem(scheme(p))


def key(p: str | os.PathLike) -> str:
    """A bucket path as fsspec names it: BUCKET/KEY."""
    return str(p).split("://", 1)[1]


_configured = False


def _configure() -> None:
    """Once per process: quiet the libraries' per-call warnings, and no listing cache (another host
    may have written the folder since this one last listed it)."""
    global _configured
    if _configured:
        return
    import fsspec.config

    # gcsfs's experimental zonal/HNS file system asks each bucket's type over gRPC, which an
    # emulator does not serve (its retries stall every call) and plain buckets do not need.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.ERROR)
    for protocol in ("gcs", "s3"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)
    _configured = True


def explain(error: BaseException, where: str | os.PathLike | None = None) -> StorageError | None:
    """One paragraph for a bucket that could not be reached or used, or None if `error` is not that."""
    text = f"{type(error).__name__}: {error}"
    place = f"{where}: " if where else ""
    if type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"):
        return StorageError(
            f"{place}no credentials to reach the bucket. For gs://, run `gcloud auth application-default login` "
            "or use a VM with a service account; for s3://, set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE)."
        )
    lowered = text.lower()
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered or "specified bucket does not" in lowered:
        return StorageError(f"{place}the bucket does not exist. Create it, or check the bucket's name in the path.")
    refused = isinstance(error, PermissionError) or getattr(error, "code", None) in (401, 403)
    if refused or "accessdenied" in lowered or "forbidden" in lowered:
        return StorageError(
            f"{place}access refused ({first_line(error)}). Check that the credentials in use may read and write this "
            "bucket (roles/storage.objectAdmin on GCS; s3:GetObject, PutObject, ListBucket, DeleteObject on S3)."
        )
    if any(
        s in lowered for s in ("cannot connect", "connection refused", "clientconnectorerror", "endpointconnection")
    ):
        return StorageError(
            f"{place}the storage server could not be reached ({first_line(error)}), after retries. Check the network, "
            "and STORAGE_EMULATOR_HOST or AWS_ENDPOINT_URL if they are set."
        )
    return None


def failed(error: BaseException | None) -> bool:
    """Whether an error, or one it arose from, is a bucket's request that failed through every retry:
    raised by gcsfs, s3fs or the HTTP clients under them, or a file the store lost (a restarted
    server forgets an upload in progress: FileNotFoundError of its URL)."""
    while error is not None:
        library = type(error).__module__.split(".")[0]
        if library in _CLIENTS or (isinstance(error, FileNotFoundError) and "://" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


_CLIENTS = ("gcsfs", "s3fs", "aiohttp", "botocore", "aiobotocore", "google")
