#!/usr/bin/env python3
"""Which RDMA devices this host has, and whether megatron_app's RDMA backend can run here.

    python tools/rdma_check.py [--json]

Prints each device and port like a short `ibv_devinfo -v` (state, link layer, MTU active/max, LID, GIDs), then
one line on the compiled backend: "rdma backend: built, usable (...)". Uses pyverbs (Debian: python3-pyverbs).
Exit status 0 when the backend can run here, 1 when it cannot (no device, no pyverbs, backend not built).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Debian's python3-pyverbs installs here, outside any virtual environment's path; it is built for the system
# Python's ABI, which a venv made from that Python shares.
DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
NO_DEVICES = "no RDMA devices (the kernel has no RDMA support or no HCA is present)"
NO_PYVERBS = "pyverbs is not installed: apt-get install python3-pyverbs (rdma-core's Python bindings)"


class CheckFailed(Exception):
    """The one line to print before exiting 1."""


def import_pyverbs():
    """(pyverbs.device, PyverbsRDMAError), looking in Debian's dist-packages when the running Python lacks it."""
    def attempt():
        import pyverbs.device as device
        from pyverbs.pyverbs_error import PyverbsError

        return device, PyverbsError

    try:
        return attempt()
    except ImportError:
        if not os.path.isdir(DEBIAN_DIST_PACKAGES) or DEBIAN_DIST_PACKAGES in sys.path:
            raise CheckFailed(NO_PYVERBS) from None
    sys.path.append(DEBIAN_DIST_PACKAGES)  # last, so it never shadows the environment's own packages
    try:
        return attempt()
    except ImportError:
        raise CheckFailed(NO_PYVERBS) from None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_port(device, context, port: int, errors) -> dict:
    attr = context.query_port(port)
    gids = []
    for index in range(attr.gid_tbl_len):
        try:
            gid = _text(context.query_gid(port, index).gid)
        except errors:
            continue  # an empty table entry
        if not gid.replace(":", "").strip("0"):
            continue
        try:
            gid_type = device.translate_gid_type(context.query_gid_type(port, index))
        except errors:
            gid_type = "?"
        gids.append({"index": index, "gid": gid, "type": gid_type})
    return {"port": port, "state": device.port_state_to_str(attr.state),
            "link_layer": device.translate_link_layer(attr.link_layer),
            "active_mtu": device.translate_mtu(attr.active_mtu), "max_mtu": device.translate_mtu(attr.max_mtu),
            "lid": attr.lid, "gids": gids}


def list_devices(device, errors) -> list[dict]:
    """Every device with its ports. CheckFailed(NO_DEVICES) when there is none."""
    try:
        found = device.get_device_list()
    except errors:  # "Failed to get devices list": no RDMA support in this kernel
        raise CheckFailed(NO_DEVICES) from None
    if not found:
        raise CheckFailed(NO_DEVICES)
    devices = []
    for entry in found:
        name = _text(entry.name)
        context = device.Context(name=name)
        try:
            attr = context.query_device()
            devices.append({"name": name, "fw_version": _text(attr.fw_version),
                            "node_guid": device.guid_format(attr.node_guid),
                            "ports": [describe_port(device, context, port, errors)
                                      for port in range(1, attr.phys_port_cnt + 1)]})
        finally:
            context.close()
    return devices


def backend_status() -> dict:
    try:
        from megatron_app.transport import _shm_tensor_rdma as core
    except ImportError as error:
        return {"built": False, "usable": False, "detail": f"megatron_app is not built ({error})"}
    built, usable, detail = core.rdma_status()
    return {"built": built, "usable": usable, "detail": detail}


def format_backend(status: dict) -> str:
    if not status["built"]:
        return f"rdma backend: not built ({status['detail']})"
    return f"rdma backend: built, {'usable' if status['usable'] else 'not usable'} ({status['detail']})"


def format_devices(devices: list[dict]) -> list[str]:
    lines = []
    for dev in devices:
        lines.append(f"{dev['name']}: firmware {dev['fw_version']}, node GUID {dev['node_guid']}, "
                     f"{len(dev['ports'])} port(s)")
        for port in dev["ports"]:
            lines.append(f"  port {port['port']}: {port['state']}, {port['link_layer']}, MTU {port['active_mtu']} "
                         f"active / {port['max_mtu']} max, LID {port['lid']}")
            for gid in port["gids"]:
                lines.append(f"    GID[{gid['index']}] {gid['gid']} ({gid['type']})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="rdma_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        device, errors = import_pyverbs()
        devices = list_devices(device, errors)
    except CheckFailed as failure:
        if args.json:
            print(json.dumps({"devices": [], "error": str(failure), "backend": backend_status()}, indent=1))
        else:
            print(failure)
        return 1
    status = backend_status()
    if args.json:
        print(json.dumps({"devices": devices, "error": None, "backend": status}, indent=1))
    else:
        print("\n".join(format_devices(devices) + [format_backend(status)]))
    return 0 if status["usable"] else 1


if __name__ == "__main__":
    sys.exit(main())
