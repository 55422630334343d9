"""The test servers of buckets.py, through the libraries podtrain uses: gcsfs and s3fs write, list,
read a range and delete, straight or through a FaultyProxy whose 503s and dropped connections they
retry; tensorstore writes and reads a zarr array in a gs:// bucket; fake-gcs-server has its objects
again after a restart, moto none. Nothing of it warns, logs a warning or prints."""

import logging
import subprocess
import sys
import urllib.request

import fsspec
import pytest

pytest_plugins = ["buckets"]  # its fixtures: gcs, s3, faulty_proxy

KINDS = ("gcs", "s3")
# Big enough for gcsfs's resumable upload (blocks of 256 KiB: under aiohttp's 1 MiB, above which it
# warns that it sends raw bytes) and for s3fs's multipart one (parts of at least 5 MiB).
BLOCK = {"gcs": 2**18, "s3": 5 * 2**20}


@pytest.fixture(autouse=True)
def quiet(caplog, capfd, recwarn):
    """Each test here warns nothing, logs nothing at WARNING or above and prints nothing on stderr."""
    for name in ("gcsfs", "s3fs", "fsspec", "botocore", "aiobotocore", "google.auth", "asyncio"):
        caplog.set_level(logging.WARNING, logger=name)  # even where podtrain.storage has quieted them
    yield
    assert [f"{w.category.__name__}: {w.message}" for w in recwarn] == []
    assert [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert capfd.readouterr().err == ""


def round_trip(kind: str, bucket: str) -> None:
    fs = fsspec.filesystem(kind)
    data = bytes(range(256)) * (BLOCK[kind] // 256) + b"tail"  # two parts
    with fs.open(f"{bucket}/dir/big", "wb", block_size=BLOCK[kind]) as f:
        f.write(data)
    fs.pipe(f"{bucket}/dir/small", b"0123456789")
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/big", f"{bucket}/dir/small"]
    assert fs.cat_file(f"{bucket}/dir/big", start=1000, end=3000) == data[1000:3000]
    assert fs.cat_file(f"{bucket}/dir/big") == data
    fs.rm(f"{bucket}/dir/big")
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/small"]


@pytest.mark.parametrize("kind", KINDS)
def test_write_list_read_a_range_and_delete(kind, request):
    round_trip(kind, request.getfixturevalue(kind).name)


@pytest.mark.parametrize("kind", KINDS)
def test_a_proxy_without_faults_forwards_everything(kind, request, faulty_proxy):
    bucket = request.getfixturevalue(kind)
    proxy = faulty_proxy(bucket, delay=0.005)
    round_trip(kind, bucket.name)
    assert proxy.requests >= 8
    assert (proxy.failed, proxy.dropped) == (0, 0)
    if kind == "gcs":  # a resumable upload's Location names the proxy: the chunks come through it too
        start = f"{proxy.url}/upload/storage/v1/b/{bucket.name}/o?uploadType=resumable&name=x"
        with urllib.request.urlopen(urllib.request.Request(start, b"{}", {"Content-Type": "application/json"})) as r:
            assert r.headers["Location"].startswith(f"{proxy.url}/upload/storage/v1/b/{bucket.name}/o?")


@pytest.mark.parametrize("fault", ["fail_every", "drop_every", "lose_every"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_clients_retry_what_the_proxy_fails_drops_or_loses(kind, fault, request, faulty_proxy):
    bucket = request.getfixturevalue(kind)
    proxy = faulty_proxy(bucket, **{fault: 3})
    fs = fsspec.filesystem(kind)
    fs.pipe(f"{bucket.name}/a", b"0123456789")
    fs.pipe(f"{bucket.name}/b", b"abc")
    assert fs.cat_file(f"{bucket.name}/a", start=2, end=5) == b"234"
    assert fs.ls(bucket.name, detail=False) == [f"{bucket.name}/a", f"{bucket.name}/b"]
    print(kind, fault, proxy.counts())
    assert proxy.failed + proxy.dropped + proxy.lost >= 1


# In a process of its own: it reaches the server by the environment the fixtures set, as a podtrain
# process a test starts would. Retries quicker than tensorstore's own (1 s, doubling) for the 503s.
ZARR = """
import sys, numpy as np, tensorstore as ts
spec = {"driver": "zarr", "kvstore": {"driver": "gcs", "bucket": sys.argv[1], "path": "array/"},
        "context": {"gcs_request_retries": {"initial_delay": "10ms", "max_delay": "100ms"}}}
array = ts.open(spec, create=True, dtype=ts.int32, shape=[8, 8], chunk_layout=ts.ChunkLayout(read_chunk_shape=[4, 4]))
array.result()[...] = np.arange(64, dtype=np.int32).reshape(8, 8)
print(ts.open(spec).result()[2:4, 5].read().result().tolist())
"""


def test_tensorstore_writes_and_reads_a_zarr_array_in_a_bucket(gcs, faulty_proxy):
    proxy = faulty_proxy(gcs, fail_every=3)
    run = subprocess.run([sys.executable, "-c", ZARR, gcs.name], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[21, 29]"
    assert proxy.failed >= 1
    # On stderr only the line of tensorstore's C++ log (not Python's) that says which credentials it uses.
    assert [line for line in run.stderr.splitlines() if "Using GOOGLE_AUTH_TOKEN_FOR_TESTING" not in line] == []
    proxy.fail_every = 0
    chunks = {"0.0", "0.1", "1.0", "1.1"}
    assert {p.rsplit("/", 1)[1] for p in fsspec.filesystem("gcs").ls(f"{gcs.name}/array")} == {".zarray", *chunks}


def test_fake_gcs_server_has_its_objects_again_after_a_restart(gcs):
    fs = fsspec.filesystem("gcs")
    fs.pipe(f"{gcs.name}/kept", b"kept")
    gcs.stop()
    gcs.start()
    assert fs.cat_file(f"{gcs.name}/kept") == b"kept"


def test_moto_comes_back_from_a_restart_empty(s3):
    fs = fsspec.filesystem("s3")
    fs.pipe(f"{s3.name}/lost", b"lost")
    s3.stop()
    s3.start()
    fs.invalidate_cache()
    assert not fs.exists(s3.name)
