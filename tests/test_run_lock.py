"""One writer per run directory: a job holds RUN_DIR/.lock while it runs; a second job on the
same directory is refused at once, naming the holder, and touches nothing; a killed holder leaves
no stale lock. Where the lock does not reach from host to host, the file's lease does."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from podtrain.errors import RunInUse
from podtrain.program.load import load_config
from podtrain.train import lease
from podtrain.train.loop import train
from podtrain.train.run import Run

from helpers import SMALL

HOLD = (
    "import sys, time; from podtrain.train.run import Run; from podtrain.program.load import load_config\n"
    "with Run.of(load_config(None, [f'run_dir={sys.argv[1]}'])).lock():\n    print('held', flush=True); time.sleep(600)"
)


def test_a_second_job_on_a_held_run_directory_is_refused(tmp_path):
    cfg = load_config(None, [*SMALL, "train.steps=2", "train.sample_tokens=0", f"run_dir={tmp_path}"])
    with Run.of(cfg).lock():
        with pytest.raises(RunInUse, match=r"in use by another job \(host .*, pid \d+, since .*\)"):
            train(cfg)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # nothing else was written
    assert train(cfg)["step"] == 2  # free again once the holder is done


def test_a_killed_holder_leaves_the_lock_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUse, match=f"pid {holder.pid}"), Run(tmp_path, None).lock():
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with Run(tmp_path, None).lock():  # the OS released it with the process
        pass


OTHER_HOST = "host node-7, pid 4242, since 2026-11-25 09:00:00"  # a job whose flock this host cannot see


def test_a_fresh_lease_of_another_host_is_refused_and_a_stale_one_taken_over(tmp_path, capsys):
    (tmp_path / ".lock").write_text(OTHER_HOST + "\n")
    refused = r"in use by another job \(host node-7, pid 4242, .*renewed \d+ s ago\)"
    with pytest.raises(RunInUse, match=refused), Run(tmp_path, None).lock():
        pass
    assert (tmp_path / ".lock").read_text() == OTHER_HOST + "\n"  # untouched

    silent = time.time() - lease.STALE_S - 1
    os.utime(tmp_path / ".lock", (silent, silent))
    with Run(tmp_path, None).lock():
        assert (tmp_path / ".lock").read_text().startswith(f"host {socket.gethostname()}, pid {os.getpid()},")
    assert "taking over" in (err := capsys.readouterr().err) and f"({OTHER_HOST})" in err
    assert (tmp_path / ".lock").read_text() == ""  # cleared at the end: free for any host at once


def test_the_lease_is_renewed_while_held(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    with Run(tmp_path, None).lock():
        os.utime(tmp_path / ".lock", (0, 0))
        time.sleep(0.3)
        assert time.time() - (tmp_path / ".lock").stat().st_mtime < 1
