"""A real two-node SLURM cluster for tests, on top of TwoHosts' network namespaces (root only).

    with TwoHosts() as hosts, SlurmCluster(hosts, gpus_per_node=2) as cluster:
        job_id, state, exit_code = cluster.run_job(["--nodes=2", "job.slurm"], timeout_s=60, cwd=..., env=...)
One munged (its own key and socket in a temp dir), slurmctld in host 0's namespace, and one slurmd per namespace
(`slurmd -N <namespace>`; NodeAddr is the namespace's address). Every daemon runs in the foreground as a child of
the test and is stopped by its pid; the temp dir goes too. Daemons enter a namespace with `nsenter --net`, not
`ip netns exec`: the latter remounts /sys without the cgroup mounts slurmd needs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from netns_hosts import netns_unavailable_reason

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "nsenter")

FINAL_JOB_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                    "DEADLINE", "PREEMPTED"}


def slurm_unavailable_reason() -> str | None:
    """None when a cluster can be started here, else why not (for pytest.skip)."""
    reason = netns_unavailable_reason()
    if reason:
        return reason
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


class SlurmCluster:
    def __init__(self, hosts, cpus_per_node: int = 2, gpus_per_node: int = 0, start_timeout_s: float = 30):
        self.hosts = hosts
        self.nodes = list(hosts.names)
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node  # SLURM bookkeeping only: no real GPU behind them (see _fake_gpus)
        self.start_timeout_s = start_timeout_s
        self.workdir: Path | None = None
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    # -- set-up ----------------------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            # munged wants every directory on its socket's path searchable by all: a 0755 dir, not pytest's 0700.
            self.workdir = Path(tempfile.mkdtemp(prefix="mapp_slurm"))
            self.workdir.chmod(0o755)
            self._start_munged()
            self.conf = self._write_conf()
            self._start("slurmctld", 0, ["slurmctld", "-D", "-f", str(self.conf)])
            for host, node in enumerate(self.nodes):
                (self.workdir / "spool" / node).mkdir(parents=True)
                self._start(f"slurmd {node}", host, ["slurmd", "-D", "-f", str(self.conf), "-N", node])
            self._wait_until_idle()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_munged(self) -> None:
        munge = self.workdir / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)  # never readable by others
        with os.fdopen(descriptor, "wb") as out:
            out.write(os.urandom(1024))
        self.munge_socket = munge / "munge.socket"
        self._start("munged", None, ["munged", "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
                                     f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait_for(lambda: self.munge_socket.exists(), "munged to create its socket")

    def _write_conf(self) -> Path:
        controller = socket.gethostname().split(".")[0]  # slurmctld runs only where this matches its host name
        work = self.workdir
        lines = [
            "ClusterName=mapptest",
            f"SlurmctldHost={controller}({self.hosts.addresses[0]})",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={work / 'state'}", f"SlurmdSpoolDir={work / 'spool' / '%n'}",
            f"SlurmctldPidFile={work / 'slurmctld.pid'}", f"SlurmdPidFile={work / 'slurmd-%n.pid'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2", "KillWait=5",
        ]
        gres = ""
        if self.gpus_per_node:
            lines.insert(0, "GresTypes=gpu")
            gres = f" Gres=gpu:{self.gpus_per_node}"
            (work / "gres.conf").write_text(f"Name=gpu File={self._fake_gpus()}\n")
        for node, address in zip(self.nodes, self.hosts.addresses):
            lines.append(f"NodeName={node} NodeAddr={address} CPUs={self.cpus_per_node} RealMemory=1000{gres}")
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        (work / "state").mkdir()
        conf = work / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _fake_gpus(self) -> str:
        """Device files SLURM can count as GPUs, so jobs get SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES set as on
        a GPU cluster (gres/gpu needs a character device per GPU; these are copies of /dev/null)."""
        devices = self.workdir / "fake_gpus"
        devices.mkdir()
        for index in range(self.gpus_per_node):
            os.mknod(devices / f"gpu{index}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        return f"{devices}/gpu[0-{self.gpus_per_node - 1}]"

    def _start(self, name: str, host: int | None, argv: list[str]) -> None:
        log = open(self.workdir / f"{name.replace(' ', '_')}.log", "w")
        if host is not None:
            argv = ["nsenter", f"--net=/run/netns/{self.hosts.names[host]}", *argv]  # nsenter execs: same pid
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.daemons.append((name, process))

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not ready():
            for name, process in self.daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n"
                                       f"{self.daemon_logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {self.start_timeout_s:g} s waiting for {what}:\n"
                                   f"{self.daemon_logs()}")
            time.sleep(0.3)

    def _wait_until_idle(self) -> None:
        def all_idle() -> bool:
            listing = self.client(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=15)
            states = dict(line.split() for line in listing.stdout.splitlines() if line.strip())
            return all(states.get(node) == "idle" for node in self.nodes)
        self._wait_for(all_idle, f"nodes {', '.join(self.nodes)} to be idle")

    # -- use -------------------------------------------------------------------------------------------------
    def env(self, base: dict | None = None, **extra) -> dict:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env.update({key: str(value) for key, value in extra.items()})
        return env

    def client(self, argv, host: int = 0, **run_kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, sbatch, scontrol, ...) run from inside `host`'s namespace."""
        run_kwargs.setdefault("env", self.env())
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.hosts.names[host]}", *map(str, argv)],
                              **run_kwargs)

    def run_job(self, sbatch_argv, timeout_s: float, **run_kwargs) -> tuple[str, str, int]:
        """Submit with `sbatch --parsable SBATCH_ARGV` and wait for the job to end; returns (job id, final state,
        exit code). Polls scontrol twice a second: `sbatch --wait` polls ever more slowly, up to 10 s apart."""
        submitted = self.client(["sbatch", "--parsable", *sbatch_argv], timeout=30, **run_kwargs)
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch failed: {submitted.stderr.strip()}\n{self.daemon_logs()}")
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout_s
        while True:
            shown = self.client(["scontrol", "show", "job", "--oneliner", job_id], timeout=15).stdout
            fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
            if fields.get("JobState") in FINAL_JOB_STATES:
                return job_id, fields["JobState"], int(fields["ExitCode"].split(":")[0])
            if time.monotonic() > deadline:
                self.client(["scancel", job_id], timeout=15)
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout_s:g} s")
            time.sleep(0.5)

    def daemon_logs(self, tail_lines: int = 15) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")) if self.workdir else []:
            lines = path.read_text(errors="replace").splitlines()[-tail_lines:]
            parts.append(f"== {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- tear-down -------------------------------------------------------------------------------------------
    def __exit__(self, *exc) -> None:
        if self.daemons and self.workdir is not None and (self.workdir / "slurm.conf").exists():
            try:  # end jobs a failed test left running while slurmctld can still do it; TwoHosts kills the rest
                jobs = self.client(["squeue", "--noheader", "--format=%i"], timeout=10).stdout.split()
                if jobs:
                    self.client(["scancel", *jobs], timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                pass
        # slurmds and slurmctld before munged (they talk to it while shutting down); each by its own pid.
        for name, process in reversed(self.daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.daemons.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
