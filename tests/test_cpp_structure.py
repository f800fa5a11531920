"""The C++ core's structure (issue 12, item 6), checked on its sources the way import-linter checks the Python
layers: every backend sits behind one interface chosen by a factory, shared plumbing exists once, one function
names peers, and nothing depends on libtorch."""

import re
from pathlib import Path

import pytest

from transport_helpers.common import job_id_fixture  # noqa: F401  (provides the job_id fixture)

from megatron_app.transport import _shm_tensor_rdma as core
from megatron_app.transport import Transport

CORE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "shm_tensor_rdma"
SOURCES = sorted(CORE_DIR.rglob("*.h")) + sorted(CORE_DIR.rglob("*.cpp"))
BY_NAME = {path.name: path for path in SOURCES}   # files are named uniquely across the job folders

_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)


def _code_and_literals(path: Path) -> tuple[str, list[str]]:
    """The file's code with comments removed, and its string literals (without quotes)."""
    code, literals = [], []
    last = 0
    text = path.read_text()
    for match in _COMMENT_OR_STRING.finditer(text):
        code.append(text[last : match.start()])
        token = match.group(0)
        if token.startswith('"'):
            literals.append(token[1:-1])
            code.append('""')
        last = match.end()
    code.append(text[last:])
    return "".join(code), literals


def _files_where(predicate) -> list[str]:
    return sorted(path.name for path in SOURCES if predicate(*_code_and_literals(path)))


def test_sources_were_found():
    assert len(SOURCES) > 40 and "backend.h" in BY_NAME


def test_only_peer_name_spells_peer_rank():
    assert _files_where(lambda code, literals: any("peer rank" in literal for literal in literals)) == [
        "peer_name.cpp"
    ]


def test_transport_names_no_backend_and_includes_none():
    names = set(core.BACKENDS)
    for file in ("transport.h", "transport.cpp"):
        code, literals = _code_and_literals(BY_NAME[file])
        assert not names & set(literals), f"{file} compares backend names"
        includes = re.findall(r'#include "([^"]+)"', BY_NAME[file].read_text())
        backend_headers = [h for h in includes if h.split("_")[0] in names]
        assert backend_headers == [], f"{file} includes backend internals {backend_headers}"


def test_backends_come_from_one_registry(job_id):
    assert core.BACKENDS == ("shm", "tcp", "rdma")
    registered = _files_where(lambda code, literals: {"shm", "tcp", "rdma"} <= set(literals))
    assert registered == ["backend_registry.cpp"]
    with pytest.raises(ValueError, match="choose shm, tcp or rdma"):
        Transport(0, 2, job_id, backends={1: "carrier-pigeon"})


@pytest.mark.parametrize(
    "call, home",
    [
        (r"::eventfd\(", "unique_fd.cpp"),
        (r"::accept4\(", "listener.cpp"),
        (r"\btcp_listen\(", "listener.cpp"),
        (r"\btcp_connect\(", "address_book.cpp"),
        (r"\bparse_host_port\(", "address_book.cpp"),
    ],
)
def test_shared_plumbing_is_called_from_one_place(call, home):
    callers = _files_where(lambda code, literals: re.search(call, code) is not None)
    # The defining file (tcp_socket.cpp, host_port.cpp) declares it; only `home` may use it.
    definitions = {"tcp_socket.cpp", "tcp_socket.h", "host_port.cpp", "host_port.h"}
    assert [name for name in callers if name not in definitions] == [home]


def test_every_backend_implements_the_one_interface():
    implementations = _files_where(lambda code, literals: re.search(r"class \w+ : public Backend\s*\{", code))
    assert implementations == ["rdma_verbs_backend.h", "shm_backend.h", "tcp_backend.h"]


def test_core_does_not_depend_on_libtorch():
    users = _files_where(lambda code, literals: re.search(r"#include\s*<(torch|ATen|c10)/", code) is not None)
    assert users == []


def test_pythons_backend_table_and_automatic_choice_come_from_the_cores_registry():
    from megatron_app.transport.backend_choice import choose_backends
    from megatron_app.transport.backends import BACKENDS, BY_PRIORITY

    assert tuple(BACKENDS) == core.BACKENDS
    for row in core.BACKEND_KINDS:
        info = BACKENDS[row["name"]]
        assert (info.remote, info.needs_device, info.auto_priority) == (
            row["remote"], row["needs_device"], row["auto_priority"])
    assert BY_PRIORITY == ("shm", "rdma", "tcp")
    hosts = {0: "a", 1: "a", 2: "b", 3: "c"}
    devices = {0: True, 1: True, 2: True, 3: False}
    assert choose_backends(0, [1, 2, 3], hosts, devices, "auto") == {1: "shm", 2: "rdma", 3: "tcp"}
