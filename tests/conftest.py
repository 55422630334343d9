"""Eight fake CPU devices for every test and no implicit rank promotion, set before JAX is imported."""

import atexit
import os
import shutil
import tempfile

from compile_flags import TEST_COMPILES

# How the tests compile: compile_flags.py (test_golden's values are those of these compiles).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + TEST_COMPILES
os.environ["JAX_PLATFORMS"] = "cpu"
# Broadcasting between arrays of different ranks is an error, not a silent expansion (here and in
# the processes the tests start): shapes are meant to line up explicitly.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# One compilation cache for the session, its workers and the processes they start, not the user's:
# a program one test compiled is read back by every later test (or worker) that compiles it again.
if "PODTRAIN_TESTS_CACHE" not in os.environ:  # the first process of the session makes it
    os.environ["PODTRAIN_TESTS_CACHE"] = tempfile.mkdtemp(prefix="podtrain-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["PODTRAIN_TESTS_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["PODTRAIN_TESTS_CACHE"]

# Each xdist worker on cores of its own, as are the processes it starts: XLA sizes its thread
# pools by the cores a process may use, and two workers' pools over the same cores cost more in
# waiting for each other than they gain (a tenth of the suite's time on 2 cores).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= _WORKERS:
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, _cores[int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) :: _WORKERS])

import pytest  # noqa: E402
from podtrain.runtime import use_compile_cache  # noqa: E402

from helpers import SMALL  # noqa: E402

use_compile_cache("auto")  # what `train` does: the in-process tests share it too


@pytest.fixture
def small_overrides():
    return list(SMALL)


# The slowest files first (seconds of work each on 2 cores): xdist hands whole files (--dist
# loadfile) to its workers in collection order, so a slow file collected last keeps one worker
# busy while the other waits.
SLOWEST_FIRST = (
    "test_context.py",
    "test_pipeline.py",
    "test_multihost.py",
    "test_plan.py",
    "test_notebook.py",
    "test_harness.py",
    "test_reasoning.py",
    "test_mhc.py",
    "test_moe.py",
    "test_hf.py",
    "test_hf_families.py",
    "test_sharding.py",
)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)
