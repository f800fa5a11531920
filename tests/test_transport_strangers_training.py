"""A real P=2 V=2 training run over the TCP backend while strangers hit both ranks' transport listeners: from the
moment each rank publishes its address (start-up) until the run ends (training). Strangers know the job id but not
the secret (a well-formed hello), stay silent, send garbage, or storm the listener with short connections. The run
must finish with the losses of a clean run, and its start-up (the first iteration, which opens the transport and
connects) within 1 s of the clean run's."""

from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
import threading
import time

from pipeline_runs import HELPERS, REPO, run_env

WORKER = HELPERS / "simple_train_loop_worker.py"
KEY_PREFIX = "megatron_app/link"  # megatron_app/transport/rendezvous.py
TCP_MAGIC, TCP_VERSION = 0x5450414D, 1


class Strangers:
    """Reads the ranks' listening addresses from the job's store (as a stranger who learnt the ports would know
    them) and keeps hitting them until stopped."""

    def __init__(self, port_file, job_id, world):
        self.port_file, self.job_id, self.world = port_file, job_id, world
        self.stop = threading.Event()
        self.hits = 0
        self.silent: list[socket.socket] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _addresses(self):
        from torch.distributed import TCPStore

        while not self.port_file.exists() or not self.port_file.read_text():
            if self.stop.wait(0.01):
                return []
        port = int(self.port_file.read_text())
        store = None
        while store is None:
            try:
                store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=__import__("datetime").timedelta(seconds=30))
            except Exception:  # noqa: BLE001 - rank 0 has not bound the store yet
                if self.stop.wait(0.02):
                    return []
        keys = [f"{KEY_PREFIX}/{self.job_id}/1/addr/{rank}" for rank in range(self.world)]
        addresses = {}
        while len(addresses) < self.world and not self.stop.is_set():
            for rank, key in enumerate(keys):
                if rank not in addresses and store.check([key]):
                    addresses[rank] = json.loads(store.get(key))["tcp"]
            time.sleep(0.002)
        return list(addresses.values())

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
    port_file = tmp_path / f"{name}.port"
    job_id = f"strangers{name}{time.monotonic_ns() % 10**9}"
    cmd = [sys.executable, str(HELPERS / "fork_ranks.py"), "2", str(WORKER), "--pipeline_parallel", "2",
           "--model_chunks", "2", "--out", str(out)]
    env = run_env(MEGATRON_APP_TRANSPORT="tcp", MEGATRON_APP_JOB_ID=job_id, FORK_RANKS_PORT_FILE=port_file)
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    strangers = Strangers(port_file, job_id, 2)
    if with_strangers:
        strangers.__enter__()
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
        if with_strangers:
            strangers.__exit__()
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert strangers.error is None, strangers.error
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
