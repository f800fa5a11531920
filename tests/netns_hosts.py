"""Two 'hosts' on this machine for tests: network namespaces joined by a veth pair (root only).

    with TwoHosts() as hosts:        # made here, removed on exit (namespaces, and with them the veth pair)
        hosts.run(0, ["bash", "run_master.sh", ...])      # a Popen inside host 0's namespace
Only 10.x addresses inside the test's own namespaces are used.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def netns_unavailable_reason() -> str | None:
    """None when the test can make namespaces here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"mapp_probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    def __init__(self, rate_limit: str | None = None):
        tag = os.getpid() % 100000
        self.names = [f"mapp{tag}h0", f"mapp{tag}h1"]
        subnet = 20 + tag % 200
        self.addresses = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]
        self.rate_limit = rate_limit  # e.g. "1gbit": tc tbf on both ends of the link

    def __enter__(self) -> TwoHosts:
        try:
            veth = [f"mv{os.getpid() % 100000}a", f"mv{os.getpid() % 100000}b"]
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
            for index, (name, device, address) in enumerate(zip(self.names, veth, self.addresses)):
                _ip("link", "set", device, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
                _ip("-n", name, "link", "set", device, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if self.rate_limit:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                                    "rate", self.rate_limit, "burst", "1mbit", "latency", "50ms"], check=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def run(self, host: int, argv, **popen_kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], **popen_kwargs)

    def kill_everything_in(self, host: int) -> None:
        """What a host crash looks like to the others: every process in its namespace dies at once."""
        pids = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc) -> None:
        for host in range(len(self.names)):
            self.kill_everything_in(host)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # also removes its veth end
