"""tools/rdma_check.py: the no-device and missing-pyverbs paths (one line, exit 1), and the device listing
rendered from a stand-in for pyverbs (no RDMA hardware exists on these machines)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "rdma_check.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("tool_rdma_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(TOOL), *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this kernel has RDMA support")
def test_no_devices_is_one_line_and_exit_1():
    tool = _load_tool()
    try:
        tool.import_pyverbs()
    except tool.CheckFailed:
        pytest.skip("pyverbs is not installed here (apt-get install python3-pyverbs)")
    result = _run()
    assert result.returncode == 1
    assert result.stdout.splitlines() == [tool.NO_DEVICES]
    assert result.stderr == ""
    as_json = _run("--json")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["devices"] == [] and report["error"] == tool.NO_DEVICES
    assert set(report["backend"]) == {"built", "usable", "detail"} and report["backend"]["usable"] is False


def test_missing_pyverbs_says_what_to_install(monkeypatch, tmp_path, capsys):
    tool = _load_tool()
    for name in [name for name in sys.modules if name == "pyverbs" or name.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError, wherever it is installed
    monkeypatch.setattr(tool, "DEBIAN_DIST_PACKAGES", str(tmp_path))
    assert tool.main([]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "pyverbs is not installed: apt-get install python3-pyverbs (rdma-core's Python bindings)"]


class FakeRdmaError(Exception):
    pass


class FakeContext:
    """Answers like pyverbs.device.Context for one RoCE port with two GIDs and an empty table slot."""

    def __init__(self, name):
        assert name == "mlx5_0"
        self.closed = False

    def query_device(self):
        return SimpleNamespace(fw_version="22.36.1010", node_guid=0x98039B0300E4C6, phys_port_cnt=1)

    def query_port(self, port):
        return SimpleNamespace(gid_tbl_len=3, state=4, link_layer=2, active_mtu=3, max_mtu=5, lid=0)

    def query_gid(self, port, index):
        gids = {0: "fe80:0000:0000:0000:9a03:9bff:fe00:e4c6", 1: "0000:0000:0000:0000:0000:ffff:0a00:0002"}
        if index not in gids:
            raise FakeRdmaError("Failed to query gid")
        return SimpleNamespace(gid=gids[index])

    def query_gid_type(self, port, index):
        return 2

    def close(self):
        self.closed = True


FAKE_DEVICE = SimpleNamespace(
    get_device_list=lambda: [SimpleNamespace(name=b"mlx5_0")],
    Context=FakeContext,
    port_state_to_str=lambda state: {4: "Active (4)"}[state],
    translate_link_layer=lambda layer: {2: "Ethernet"}[layer],
    translate_mtu=lambda mtu: {3: "1024 (3)", 5: "4096 (5)"}[mtu],
    translate_gid_type=lambda kind: {2: "RoCEv2"}[kind],
    guid_format=lambda guid: "9803:9b03:00e4:c600",
)


def test_devices_are_listed_like_ibv_devinfo(monkeypatch, capsys):
    tool = _load_tool()
    monkeypatch.setattr(tool, "import_pyverbs", lambda: (FAKE_DEVICE, FakeRdmaError))
    monkeypatch.setattr(tool, "backend_status",
                        lambda: {"built": True, "usable": True, "detail": "mlx5_0 port 1 (Ethernet/RoCE, ACTIVE)"})
    assert tool.main([]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mlx5_0: firmware 22.36.1010, node GUID 9803:9b03:00e4:c600, 1 port(s)",
        "  port 1: Active (4), Ethernet, MTU 1024 (3) active / 4096 (5) max, LID 0",
        "    GID[0] fe80:0000:0000:0000:9a03:9bff:fe00:e4c6 (RoCEv2)",
        "    GID[1] 0000:0000:0000:0000:0000:ffff:0a00:0002 (RoCEv2)",
        "rdma backend: built, usable (mlx5_0 port 1 (Ethernet/RoCE, ACTIVE))",
    ]
    monkeypatch.setattr(tool, "backend_status", lambda: {"built": False, "usable": False, "detail": "not built"})
    assert tool.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["devices"][0]["ports"][0]["gids"][1]["index"] == 1
    assert report["backend"] == {"built": False, "usable": False, "detail": "not built"}


def test_backend_line_wording():
    tool = _load_tool()
    assert tool.format_backend({"built": False, "usable": False, "detail": "x"}) == "rdma backend: not built (x)"
    assert tool.format_backend({"built": True, "usable": False, "detail": "no RDMA devices"}) == (
        "rdma backend: built, not usable (no RDMA devices)")
