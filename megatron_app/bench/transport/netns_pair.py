"""Two 'hosts' on one machine for benchmarks: two network namespaces joined by a veth pair (root only).

    with VethPair(rate="1gbit") as link:            # made here, removed on exit
        subprocess.Popen(link.exec_prefix(0) + ["python", ...])   # a process inside host 0's namespace
        link.addresses[1], link.devices[1]           # host 1's address and its end of the veth pair

The same construction as tests/netns_hosts.py (which also kills whole hosts for fault tests); names and the
10.232.x.0/24 subnet differ from the tests' so a benchmark and a test can run side by side.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_BITS_PER_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# tbf drops packets larger than its bucket, and veth hands it 64 KiB GSO packets; a few ms of traffic at the
# configured rate also keeps the bucket from throttling below the rate.
_MIN_BURST_BYTES = 256 * 1024
_BURST_SECONDS = 0.004


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate like '1gbit', '500mbit'. ValueError naming the text otherwise."""
    match = _RATE.match(text.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"not a rate: {text!r} (use e.g. 500mbit, 1gbit, 10gbit)")
    return float(match.group(1)) * _BITS_PER_UNIT[match.group(2)]


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root: cannot create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class VethPair:
    def __init__(self, rate: str | None = None):
        tag = os.getpid() % 100000
        self.names = [f"mbt{tag}h0", f"mbt{tag}h1"]
        self.devices = [f"mbt{tag}a", f"mbt{tag}b"]
        subnet = 20 + tag % 200
        self.addresses = [f"10.232.{subnet}.1", f"10.232.{subnet}.2"]
        self.rate = rate
        self.rate_bits = parse_rate(rate) if rate else None

    def __enter__(self) -> VethPair:
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for name, device, address in zip(self.names, self.devices, self.addresses):
                _ip("link", "set", device, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
                _ip("-n", name, "link", "set", device, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                if self.rate_bits:
                    burst = max(_MIN_BURST_BYTES, int(self.rate_bits / 8 * _BURST_SECONDS))
                    done = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", device, "root",
                                           "tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"],
                                          capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"tc tbf rate {self.rate} on {device}: {done.stderr.strip()}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def exec_prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[host]]

    def describe(self) -> str:
        limit = f", tc tbf {self.rate} each way" if self.rate else ""
        return f"veth pair between network namespaces {self.addresses[0]} <-> {self.addresses[1]}{limit}"

    def __exit__(self, *exc) -> None:
        for name in self.names:  # deleting a namespace also removes its end of the veth pair (and with it both)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
