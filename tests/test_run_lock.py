"""One writer per run directory: a job holds RUN_DIR/.lock while it runs; a second job on the
same directory is refused at once, naming the holder, and touches nothing; a killed holder leaves
no stale lock."""

import signal
import subprocess
import sys

import pytest
from podtrain.config.load import load_config
from podtrain.errors import RunInUse
from podtrain.train.loop import train
from podtrain.train.run import Run

from helpers import SMALL

HOLD = (
    "import sys, time; from podtrain.train.run import Run; from podtrain.config.load import load_config\n"
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
