"""Eight fake CPU devices for every test and no implicit rank promotion, set before JAX is imported."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
# Broadcasting between arrays of different ranks is an error, not a silent expansion (here and in
# the processes the tests start): shapes are meant to line up explicitly.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# One compilation cache for the session and the processes it starts, not the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="podtrain-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

import pytest  # noqa: E402

# A model small enough for 2 CPU cores, with grouped-query attention (n_kv_heads < n_heads).
SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.batch_size=8",
    "model.compute_dtype=float32",
    "device_type=cpu",
]


@pytest.fixture
def small_overrides():
    return list(SMALL)
