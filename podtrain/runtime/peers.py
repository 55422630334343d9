"""A lost process of the job noticed within seconds by every other, with or without a launcher.

The coordination service (hosted by process 0) declares a process dead once its heartbeats stop
for distributed.heartbeat_timeout seconds. By default it then aborts every other process from C++
(SIGABRT and pages of stack traces), and a process not in touch with it waits in its collective.
podtrain starts the service recoverable instead, so that it only records the loss, and a watchdog
thread in every process asks it each second which processes live. On a loss the watchdog prints
one paragraph naming the lost processes and their hosts and ends the process with PeerLost's exit
code, "restart me", whatever the main thread is doing: a collective that can never finish included.

Process 0 takes the service with it: the others' runtime then aborts them at once from C++ (a
death by SIGABRT), which a launch or a scheduler restarts like any other.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

from podtrain.errors import PeerLost, first_line

HOSTS = "podtrain/host/"  # where each process leaves its host's name in the service's key-value store
LEFT = "podtrain/left/"  # and a mark as it stops on a loss
POLL_S = 1.0


class Watchdog:
    def __init__(self, client, index: int, count: int, heartbeat_timeout: int, shutdown_timeout: int):
        self.client, self.index, self.count = client, index, count
        self.heartbeat_timeout, self.shutdown_timeout = heartbeat_timeout, shutdown_timeout
        self.on_loss = []  # (survivors) -> None, run before this process stops
        self.stopped = threading.Event()
        client.key_value_set(f"{HOSTS}{index}", f"{socket.gethostname()} (pid {os.getpid()})")
        atexit.register(self.stopped.set)  # before jax's own exit handler disconnects this process
        threading.Thread(target=self._watch, name="podtrain-peers", daemon=True).start()

    def _watch(self) -> None:
        everyone = list(range(self.count))
        while not self.stopped.wait(POLL_S):
            try:
                live = self.client.get_live_nodes(everyone)
            except Exception as e:  # noqa: BLE001 - the service is gone: process 0 was lost
                if not self.stopped.is_set():
                    self._end([0], f"the coordination service in process 0 stopped answering ({first_line(e, 160)})")
                return
            if lost := [i for i in everyone if i not in live]:
                if not self.stopped.is_set():
                    self._end(lost, f"no heartbeat for {self.heartbeat_timeout} s (distributed.heartbeat_timeout)")
                return

    def _hosts(self, lost: list[int]) -> str:
        try:
            hosts = dict(self.client.key_value_dir_get(HOSTS))
        except Exception:  # noqa: BLE001 - without the service there is no one to ask
            hosts = {}
        return ", ".join(f"process {i} on {hosts.get(f'{HOSTS}{i}', 'an unknown host')}" for i in lost)

    def _end(self, lost: list[int], why: str) -> None:
        print(
            f"podtrain: error: process {self.index} of {self.count} lost {self._hosts(lost)}: {why}. It stops with "
            f"exit code {PeerLost.exit_code}, which asks for a restart: rerun the job (on the hosts left, with the "
            "same global batch) to resume from its newest checkpoint, or run it under `podtrain launch "
            "--max-restarts N` or a scheduler that restarts it.",
            file=sys.stderr,
            flush=True,
        )
        survivors = [i for i in range(self.count) if i not in lost]
        for save in self.on_loss:
            save(survivors)
        self._last_out(lost)
        os._exit(PeerLost.exit_code)

    def _last_out(self, lost: list[int]) -> None:
        """Process 0 hosts the service: the others, learning of the loss from it and saving what they
        hold, must be gone first, or losing it too would abort them from C++."""
        try:
            self.client.key_value_set(f"{LEFT}{self.index}", "")
            others = self.count - len(lost) - 1
            deadline = time.monotonic() + self.shutdown_timeout
            while self.index == 0 and time.monotonic() < deadline:
                if len(self.client.key_value_dir_get(LEFT)) > others:
                    return
                time.sleep(0.1)
        except Exception:  # noqa: BLE001, S110 - no service left to wait on
            pass

    def verdict(self) -> None:
        """Wait for the watchdog to name the lost process and end this one (a collective failed because
        a peer's socket closed); returns only if no loss is found within a heartbeat timeout."""
        time.sleep(self.heartbeat_timeout + 3 * POLL_S)


_watchdog: Watchdog | None = None


def watch(client, index: int, count: int, heartbeat_timeout: int, shutdown_timeout: int) -> None:
    """Start this process's watchdog (once per process, after joining)."""
    global _watchdog
    if _watchdog is None and count > 1:
        _watchdog = Watchdog(client, index, count, heartbeat_timeout, shutdown_timeout)


def on_loss(save) -> None:
    """Have `save(survivors)` run in this process when another is lost, before it stops."""
    if _watchdog is not None:
        _watchdog.on_loss.append(save)


def leave() -> None:
    """Leave with the others at the end of a program (the CLI's command) that succeeded, or stopped
    on request, in every process. Recoverable processes are not held by jax's shutdown barrier, and process 0 hosts the
    service: it goes last, once the others have said goodbye, or their goodbye would abort them.
    A process that fails leaves at once, and the others' watchdogs tell of it."""
    if _watchdog is None:
        return
    w = _watchdog
    w.stopped.set()
    deadline = time.monotonic() + w.shutdown_timeout
    try:
        w.client.wait_at_barrier("podtrain/leave", w.shutdown_timeout * 1000)
        while w.index == 0 and len(w.client.get_live_nodes(list(range(w.count)))) > 1:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
    except Exception:  # noqa: BLE001, S110 - a process that did not come: jax's shutdown says no more
        pass


def await_verdict() -> None:
    if _watchdog is not None:
        _watchdog.verdict()
