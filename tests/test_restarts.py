"""`podtrain launch --max-restarts`: a job one of whose processes is killed starts again from its
newest checkpoint and ends as if uninterrupted; a user error and a stop on request are not restarted."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from podtrain.errors import Preempted
from podtrain.train.metrics import read_metrics

from helpers import CLEAN_ENV, SMALL, run_steps

STEPS = 12
JOB = [
    *SMALL,
    f"train.steps={STEPS}",
    "train.log_every=1",
    "checkpoint.every=2",  # a save every other step keeps the job going for a while after the kill
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_tokens=0",
]


def _launch(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "podtrain", "launch", *args],
        env={**CLEAN_ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.integration
def test_a_killed_process_restarts_the_job_which_ends_as_if_uninterrupted(tmp_path):
    run = tmp_path / "run"
    launcher = _launch(
        "--nproc", "2", "--devices-per-proc", "1", "--max-restarts", "2", "--", "train", *JOB, f"run_dir={run}"
    )
    pids, lines, deadline = {}, [], time.monotonic() + 240
    for line in launcher.stdout:  # kill process 1 once a checkpoint is complete
        lines.append(line)
        if m := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids[int(m[1])] = int(m[2])
        if line.startswith("[0] step ") and (run / "checkpoints" / "2").is_dir():
            break
        assert time.monotonic() < deadline, "".join(lines[-30:])
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    for line in launcher.stdout:
        lines.append(line)
        if line.startswith("[0] step ") and any("restarting the job" in seen for seen in lines):  # its first step
            print(f"from the kill to the restarted job's first step: {time.monotonic() - killed:.1f} s")
            break
    lines += launcher.communicate(timeout=240)[0].splitlines(keepends=True)
    output = "".join(lines)
    assert launcher.returncode == 0, output[-3000:]

    assert "Traceback" not in output  # the survivor says in one line that it lost a peer, if anything
    started = [int(pid) for pid in re.findall(r"\[launch\] process \d: pid (\d+)", output)]
    assert len(started) == 4 and not [pid for pid in started if _alive(pid)]
    assert "process 1 ended with signal SIGKILL\n" in output
    restart = re.search(r"restarting the job on 2 processes from step (\d+), its newest", output)
    assert restart and "(restart 1 of 2, 1 left)" in output, output[-3000:]
    resumed = int(restart[1])
    assert f"resuming from step {resumed}" in output and STEPS > resumed >= 2
    records = read_metrics(run)
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # each step once
    losses, _ = run_steps(JOB, n_devices=2, n_steps=STEPS)
    np.testing.assert_allclose([r["loss"] for r in logged], losses, rtol=0, atol=1e-5)
    (faults,) = [r for r in records if "restarts" in r]
    before = output[: restart.start()]  # the killed attempt's last printed step; its metrics line may be one past it
    last = max(int(n) for n in re.findall(r"^\[0\] step +(\d+)  grad_norm", before, re.MULTILINE))
    assert faults["step"] == resumed and faults["restarts"] == 1
    assert last - resumed <= faults["recomputed_steps"] <= last + 1 - resumed


def _alive(pid: int) -> bool:
    """Running, not a zombie awaiting its parent."""
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


EXIT = "import os, sys; sys.exit(int(os.environ['CODE']) if os.environ['PODTRAIN_RESTART'] == '0' else 0)"


@pytest.mark.parametrize("code", [2, Preempted.exit_code])
def test_a_user_error_or_a_stop_on_request_is_not_restarted(tmp_path, code):
    """A process that would succeed if restarted: its first exit code is the launch's."""
    launcher = _launch(
        "--nproc",
        "2",
        "--max-restarts",
        "3",
        "--log-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        EXIT,
        env={"CODE": str(code)},
    )
    output = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == code and "restarting" not in output, output
    assert len(re.findall(r"\[launch\] process \d: pid", output)) == 2  # started once


def test_other_failures_restart_until_none_is_left(tmp_path):
    crash = "import sys; sys.exit(1)"
    launcher = _launch(
        "--nproc", "1", "--max-restarts", "2", "--log-dir", str(tmp_path), "--", sys.executable, "-c", crash
    )
    output = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 1, output
    assert "(restart 1 of 2, 1 left)" in output and "(restart 2 of 2, 0 left)" in output
    assert "exit code 1; no restart left; stopping" in output
    assert len(re.findall(r"\[launch\] process 0: pid", output)) == 3
