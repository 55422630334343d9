"""SIGTERM stops every process after the same step with one final checkpoint and exit code 75;
rerunning the same command continues from there; a second signal leaves at once."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from podtrain.errors import Preempted
from podtrain.train import preemption
from podtrain.train.metrics import read_metrics

from helpers import CLEAN_ENV, SMALL

ENDLESS = [
    *SMALL,
    "train.steps=100000",
    "train.log_every=1",
    "checkpoint.every=1000",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_tokens=0",
]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "podtrain", *args],
        env=CLEAN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _pids_once_training(process: subprocess.Popen, started: str) -> tuple[dict, list[str]]:
    """The launch's child pids by rank (if any), once a line starts with `started`."""
    pids, lines, deadline = {}, [], time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        if m := re.match(r"\[launch\] process (\d): pid (\d+)", line):
            pids[int(m[1])] = int(m[2])
        if line.startswith(started):
            return pids, lines
        assert time.monotonic() < deadline, "training did not start"
    raise AssertionError("".join(lines[-30:]))


def _stopped_step(output: str) -> int:
    return int(re.search(r"stopped after step (\d+) and saved its checkpoint", output)[1])


@pytest.mark.integration
def test_sigterm_saves_the_step_it_stopped_at_and_the_rerun_continues(tmp_path):
    run = tmp_path / "run"
    process = _start(["train", *ENDLESS, f"run_dir={run}"])
    _pids_once_training(process, "step      3")
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == Preempted.exit_code, output[-2000:]
    stopped = _stopped_step(output)
    assert (run / "checkpoints" / str(stopped)).is_dir()
    assert max(r["step"] for r in read_metrics(run)) == stopped

    again = _start(["train", *ENDLESS, f"run_dir={run}", f"train.steps={stopped + 2}"])
    output = again.communicate(timeout=240)[0]
    assert again.returncode == 0 and f"resuming from step {stopped}" in output, output[-2000:]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, stopped + 3))


@pytest.mark.integration
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    run = tmp_path / "run"
    launch = ["launch", "--nproc", "2", "--devices-per-proc", "4", "--", "train", *ENDLESS, f"run_dir={run}"]
    process = _start(launch)
    pids, _ = _pids_once_training(process, "[0] step      3")
    os.kill(pids[1], signal.SIGTERM)  # a preemption notice that reaches one host only
    output = process.communicate(timeout=120)[0]
    assert process.returncode == Preempted.exit_code, output[-3000:]
    logs = [(run / "logs" / f"process_{rank}.log").read_text() for rank in (0, 1)]
    stopped = _stopped_step(logs[0])
    assert _stopped_step(logs[1]) == stopped and (run / "checkpoints" / str(stopped)).is_dir()

    again = _start([*launch, f"train.steps={stopped + 1}"])
    output = again.communicate(timeout=240)[0]
    assert again.returncode == 0 and f"resuming from step {stopped}" in output, output[-3000:]


def test_a_second_signal_leaves_at_once(monkeypatch):
    before, left = signal.getsignal(signal.SIGTERM), []
    monkeypatch.setattr(preemption.os, "_exit", lambda code: left.append(code))
    with preemption.StopRequests() as stop:
        assert not stop.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reached(2) and not left
        os.kill(os.getpid(), signal.SIGINT)
        assert left == [128 + signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) == before  # given back after training
