"""Device detection asks JAX's backends in turn, and the MFU peak comes from the device kind."""

from types import SimpleNamespace

import pytest
from podtrain.errors import DeviceError
from podtrain.runtime import chips, devices


def fake_backends(monkeypatch, present: dict):
    """jax.devices(platform) answering from `present`: a list of devices, or the error JAX raises."""

    def jax_devices(platform):
        answer = present.get(platform, RuntimeError(f"Unknown backend {platform}"))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(devices.jax, "devices", jax_devices)


def test_a_tpu_that_fails_to_start_falls_back_to_the_gpu(monkeypatch, capsys):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-8")  # no longer taken as proof of a TPU
    fake_backends(
        monkeypatch,
        {
            "tpu": RuntimeError("Backend 'tpu' failed to initialize: no TPU found"),
            "gpu": ["gpu0", "gpu1"],
            "cpu": ["cpu0"],
        },
    )
    assert devices.select_devices("auto") == ["gpu0", "gpu1"]
    assert (
        "the tpu backend did not start (Backend 'tpu' failed to initialize: no TPU found); using gpu"
        in capsys.readouterr().out
    )


def test_auto_takes_tpu_then_gpu_then_cpu(monkeypatch, capsys):
    fake_backends(monkeypatch, {"tpu": ["tpu0"], "gpu": ["gpu0"], "cpu": ["cpu0"]})
    assert devices.select_devices("auto") == ["tpu0"]
    fake_backends(monkeypatch, {"cpu": ["cpu0"]})
    assert devices.select_devices("auto") == ["cpu0"]
    no_libtpu = (  # what JAX 0.11 with CUDA says on a GPU machine
        "Backend 'tpu' failed to initialize: INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open "
        "shared object file: No such file or directory. Available backends are ['cpu', 'cuda']"
    )
    fake_backends(monkeypatch, {"tpu": RuntimeError(no_libtpu), "gpu": ["gpu0"], "cpu": ["cpu0"]})
    assert devices.select_devices("auto") == ["gpu0"]
    assert capsys.readouterr().out == ""  # absent backends are not news


def test_a_forced_platform_is_taken_or_is_an_error_that_says_why(monkeypatch):
    fake_backends(monkeypatch, {"tpu": ["tpu0"], "gpu": ["gpu0"], "cpu": ["cpu0"]})
    assert devices.select_devices("cuda") == ["gpu0"] and devices.select_devices("cpu") == ["cpu0"]
    fake_backends(monkeypatch, {"tpu": ["tpu0"], "cpu": ["cpu0"]})
    with pytest.raises(
        DeviceError, match=r"device_type=gpu was requested but JAX cannot start a GPU here \(Unknown backend gpu\)"
    ):
        devices.select_devices("gpu")


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2250e12),
        ("TPU v3", 61.5e12),  # one JAX device per core, half a chip
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),  # v5e
        ("TPU v5", 459e12),  # v5p
        ("TPU v6 lite", 918e12),  # v6e
        ("cpu", None),
    ],
)
def test_peak_flops_by_device_kind(kind, peak):
    assert chips.peak_flops(SimpleNamespace(device_kind=kind)) == peak
