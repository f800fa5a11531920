"""A real P=2 V=2 training run over the TCP backend while strangers hit both ranks' transport listeners: from the
moment each rank publishes its address (start-up) until the run ends (training). Strangers know the job id but not
the secret (a well-formed hello), stay silent, send garbage, or storm the listener with short connections. The run
must finish with the losses of a clean run, and its start-up (the first iteration, which opens the transport and
connects) within 1 s of the clean run's."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time

from pipeline_runs import HELPERS, REPO, run_env

WORKER = HELPERS / "simple_train_loop_worker.py"
TCP_MAGIC, TCP_VERSION = 0x5450414D, 1


class Strangers:
    """Finds the ranks' transport listeners as a port scan would, and keeps hitting them until stopped."""

    def __init__(self, launcher_pid, job_id, world):
        self.launcher_pid, self.job_id, self.world = launcher_pid, job_id, world
        self.not_ours: set[str] = set()
        self.stop = threading.Event()
        self.hits = 0
        self.silent: list[socket.socket] = []
        self.error: BaseException | None = None
        self.found_at: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _addresses(self):
        """The ranks' transport listeners: their loopback listening sockets that greet a connection with the
        admission challenge (magic "MADN"), as a port scan would find them."""
        while not self.stop.is_set():
            candidates = [address for address in self._loopback_listeners() if address not in self.not_ours]
            found = self._greeting_with_a_challenge(candidates)
            if len(found) >= self.world:
                self.found_at.append(time.monotonic())
                return found
            time.sleep(0.005)
        return []

    def _loopback_listeners(self):
        ranks = [pid for pid in _children(self.launcher_pid)]
        inodes = set()
        for pid in ranks:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
            except OSError:
                continue
        listeners = []
        with open("/proc/net/tcp") as table:
            for line in list(table)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes and local.startswith("0100007F:"):
                    listeners.append(f"127.0.0.1:{int(local.split(':')[1], 16)}")
        return listeners

    def _greeting_with_a_challenge(self, candidates):
        """Connects to every candidate at once and waits 0.2 s for a greeting; the silent ones are not ours."""
        pending = {}
        for address in candidates:
            host, port = address.rsplit(":", 1)
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((host, int(port)))
            pending[sock] = address
        found = []
        deadline = time.monotonic() + 0.2
        while pending and time.monotonic() < deadline:
            readable, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
            for sock in readable:
                address = pending.pop(sock)
                try:
                    if sock.recv(4) == b"MADN":
                        found.append(address)
                    else:
                        self.not_ours.add(address)
                except OSError:
                    self.not_ours.add(address)
                sock.close()
        for sock, address in pending.items():
            self.not_ours.add(address)
            sock.close()
        return found

    def _hit(self, address, rng):
        host, port = address.rsplit(":", 1)
        kind = rng.choice(["silent", "garbage", "no_secret", "storm"])
        try:
            sock = socket.create_connection((host, int(port)), timeout=2)
        except OSError:
            return
        self.hits += 1
        if kind == "silent" and len(self.silent) < 16:
            self.silent.append(sock)
            return
        try:
            if kind == "garbage":
                sock.sendall(rng.randbytes(rng.randrange(1, 300)))
            elif kind == "no_secret":  # skips the challenge: a hello with the right job id and a real rank
                hello = struct.pack("<IIiI", TCP_MAGIC, TCP_VERSION, rng.randrange(self.world), 0)
                sock.sendall(hello + self.job_id.encode().ljust(64, b"\0"))
        except OSError:
            pass
        sock.close()

    def _run(self):
        try:
            addresses = self._addresses()
            rng = random.Random(3)
            while not self.stop.is_set() and addresses:
                self._hit(rng.choice(addresses), rng)
                if self.hits % 50 == 0:
                    time.sleep(0.01)  # a storm, but one that leaves the ranks some CPU on a 2-core machine
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)
        for sock in self.silent:
            sock.close()


def run_p2_v2(tmp_path, name, with_strangers: bool):
    out = tmp_path / name
    out.mkdir()
    job_id = f"strangers{name}{time.monotonic_ns() % 10**9}"
    cmd = [sys.executable, str(HELPERS / "fork_ranks.py"), "2", str(WORKER), "--pipeline_parallel", "2",
           "--model_chunks", "2", "--iters", "30", "--out", str(out)]
    env = run_env(MEGATRON_APP_TRANSPORT="tcp", MEGATRON_APP_JOB_ID=job_id)
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    strangers = Strangers(process.pid, job_id, 2)
    if with_strangers:
        strangers.__enter__()
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
        if with_strangers:
            strangers.__exit__()
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert strangers.error is None, (strangers.error, strangers.hits, strangers.found_at)
    losses = json.loads((out / "losses.json").read_text())
    start_up = max(json.loads((out / f"first_iteration_s_rank{rank}.json").read_text()) for rank in range(2))
    return losses, start_up, strangers.hits


def test_training_completes_with_strangers_at_the_listeners(tmp_path):
    clean_losses, clean_start_up, _ = run_p2_v2(tmp_path, "clean", with_strangers=False)
    losses, start_up, hits = run_p2_v2(tmp_path, "strangers", with_strangers=True)
    print(f"start-up: clean {clean_start_up:.3f} s, with strangers {start_up:.3f} s ({hits} stranger connections)")
    assert hits >= 20, "the strangers never reached the listeners"
    assert losses == clean_losses
    assert start_up < clean_start_up + 1.0, (start_up, clean_start_up)


def _children(parent_pid):
    """The forked ranks: processes whose parent is the launcher."""
    children = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent_pid:
                        children.append(int(name))
            except OSError:
                continue
    return children
