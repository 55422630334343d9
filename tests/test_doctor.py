"""`podtrain doctor`, the smoke test: every check passes on one device and on eight (two processes
in tests/test_multihost.py); a broken data path and an unwritable checkpoint directory each give
a ✗ that names the fix, and exit 2."""

import re

from podtrain.cli import main

from compile_flags import TEST_COMPILES
from helpers import podtrain

CHECKS = ["devices", "data", "train step", "grad sync", "checkpoint", "all-reduce"]


def passed(out: str) -> list[str]:
    return re.findall(r"^\[doctor\] ✓ ([\w -]+):", out, re.M)


def test_every_check_passes_on_eight_devices(tmp_path, small_overrides, capsys):
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    assert main(["doctor", *small_overrides, *mesh, f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert passed(out) == CHECKS, out
    assert "8 x cpu" in out and "the 8-device step's update equals a 1-device step's" in out
    assert "[doctor] all 6 checks passed, 1 process" in out
    assert not (tmp_path / "run").exists()  # the scratch checkpoint and the folders made for it are gone


def test_every_check_passes_on_one_device(tmp_path, small_overrides):
    one_device = {"XLA_FLAGS": f"{TEST_COMPILES} --xla_force_host_platform_device_count=1"}
    done = podtrain("doctor", *small_overrides, f"run_dir={tmp_path}", env=one_device, timeout=300)
    assert done.returncode == 0 and passed(done.stdout) == CHECKS, done.stdout + done.stderr[-2000:]
    assert "1 x cpu" in done.stdout


def test_broken_data_and_checkpoint_directory_fail_with_their_fixes(tmp_path, small_overrides, capsys):
    (tmp_path / "file").write_text("not a folder")
    broken = ["data.source=text", f"data.path={tmp_path / 'missing.txt'}", f"checkpoint.dir={tmp_path / 'file' / 'ck'}"]
    assert main(["doctor", *small_overrides, *broken, f"run_dir={tmp_path / 'run'}"]) == 2
    out, err = capsys.readouterr()
    assert passed(out) == ["devices", "all-reduce"], out
    data = next(line for line in out.splitlines() if line.startswith("[doctor] ✗ data:"))
    checkpoint = next(line for line in out.splitlines() if line.startswith("[doctor] ✗ checkpoint:"))
    assert "missing.txt" in data and "fix:" in data
    assert str(tmp_path / "file" / "ck") in checkpoint and "checkpoint.dir" in checkpoint
    assert "[doctor] - train step: not run" in out
    assert "2 of 4 checks failed (data, checkpoint)" in err and "Traceback" not in err
