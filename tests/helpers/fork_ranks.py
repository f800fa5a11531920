"""Runs a rank script on N local ranks as forks of one process that imported torch and megatron-core once.

What torchrun --standalone gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), without each rank paying
the ~10 s of CPU that importing torch and megatron-core costs (torch.compile decorators pull in dynamo/inductor): on
the 2-core CI machine the imports were most of a small multi-rank test. Only for tests; users launch with torchrun.
    python tests/helpers/fork_ranks.py NPROC SCRIPT [ARGS...]
    python tests/helpers/fork_ranks.py --serve SOCKET     (runs of the above, each a fork of one server: serve())
Like torchrun: the first rank that fails stops the others, and the exit status is non-zero if any rank failed.

The rule on a CUDA host: this parent process never touches CUDA; each rank initialises CUDA itself, after the fork.
A child forked after its parent initialised CUDA cannot use it ("Cannot re-initialize CUDA in forked subprocess"),
and torch counts as initialised much earlier than a first CUDA tensor: any `torch.cuda.is_available()` that asks
the CUDA runtime (not NVML) marks every later fork bad. megatron-core 0.19 asks at import time
(megatron/core/dist_checkpointing/strategies/torch.py, reached from `import megatron.core`; also its triton fusions
with triton < 3.4; Transformer Engine's imports, where TE is installed, may do more). So the parent sets
PYTORCH_NVML_BASED_CUDA_CHECK=1 before importing anything (torch then answers is_available() from NVML, which
leaves forks alone), watches the imports for CUDA queries, and refuses to fork, with one message naming the first
query, when CUDA was initialised, a query reached the CUDA runtime, a forked child would be in torch's "bad fork",
or the CUDA driver was initialised (cuInit, by anything). Tests whose ranks need something that initialises CUDA
before the rank script runs start their ranks as fresh interpreters instead: tests/pipeline_runs.py `torchrun()`.
"""

import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import signal
import socket
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
# megatron_app's trainer modules too: the rank scripts all use them, and each rank paid ~0.25 s of CPU for them.
PRELOAD = ("torch", "torch.distributed", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
           "megatron_app.train.args", "megatron_app.train.init", "megatron_app.train.loop",
           "megatron_app.train.forward_backward")
# torch._C functions that register torch's at-fork handler ("poison the fork"): CUDA initialisation itself, and the
# runtime's device count (torch.cuda.is_available(), and device_count() when NVML cannot answer).
CUDA_QUERIES = ("_cuda_init", "_cuda_getDeviceCount", "_cuda_getArchFlags")


class ForkUnsafe(RuntimeError):
    """Forking now would give ranks that cannot use CUDA."""


def free_port() -> int:
    """A port below the kernel's ephemeral range, free when probed: a port the kernel hands out (bind to 0) is in
    that range, where any process's next outgoing connection (gloo opens many) can take it before rank 0 binds it
    (EADDRINUSE seen under two pytest workers)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    chooser = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        port = chooser.randrange(10000, max(10001, min(ephemeral_low, 29000)))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def watch_cuda_queries(torch, found: list[str]):
    """While inside, every call of a CUDA_QUERIES function of torch._C appends where it came from (the innermost
    frame outside torch: "file:line")."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    originals = {name: getattr(torch._C, name) for name in CUDA_QUERIES if hasattr(torch._C, name)}

    def watched(name, original):
        def call(*args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(torch_dir)]
            found.append(f"{frames[-1].filename}:{frames[-1].lineno} (torch._C.{name})" if frames else name)
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(torch._C, name, watched(name, original))
    try:
        yield found
    finally:
        for name, original in originals.items():
            setattr(torch._C, name, original)


def preload(modules=PRELOAD) -> list[str]:
    """Imported before forking, so every rank finds them in sys.modules. Nothing here may start a thread or touch
    CUDA. Returns where the imports queried CUDA (see watch_cuda_queries)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")    # is_available() from NVML: forks stay good
    import torch

    with watch_cuda_queries(torch, []) as found:
        for module in modules:
            importlib.import_module(module)
    return found


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit): without it, every driver call, such as
    cuDeviceGetCount, answers CUDA_ERROR_NOT_INITIALIZED. Never loads the driver itself."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # only if already loaded
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0


def forked_child_in_bad_fork(torch) -> bool:
    """Whether a child forked now would be in torch's bad fork (cannot initialise CUDA): asked of a real child."""
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    child = os.fork()
    if child == 0:   # pragma: no cover - runs in the child
        os._exit(1 if in_bad_fork() else 0)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) != 0


def check_fork_safe(queries: list[str] = ()) -> None:
    """Raise ForkUnsafe, with the cause and the remedy, unless ranks forked now can initialise CUDA themselves.
    `queries`: where the preloaded imports queried CUDA (preload's answer)."""
    import torch

    if torch.cuda.is_initialized():
        why = "CUDA is initialised in the parent process"
    elif queries:
        why = "the parent process queried the CUDA runtime"
    elif cuda_driver_initialised():
        why = "the CUDA driver is initialised in the parent process (cuInit)"
    elif forked_child_in_bad_fork(torch):
        why = "torch marked forks of the parent process bad (it asked the CUDA runtime)"
    else:
        return
    first = f", first at {queries[0]}" if queries else ""
    raise ForkUnsafe(
        f"fork_ranks: {why}{first}, so forked ranks could not use CUDA (\"Cannot re-initialize CUDA in forked "
        f"subprocess\"). Nothing the parent imports may touch CUDA (PYTORCH_NVML_BASED_CUDA_CHECK=1 is set for "
        f"torch.cuda.is_available()); or start these ranks with tests/pipeline_runs.py torchrun().")


def run_rank(rank: int, world: int, script: str, args: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no orphans if the parent is killed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exit_request:
        code = exit_request.code
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
    except BaseException:  # noqa: BLE001 - a rank's failure becomes its exit status, as under torchrun
        traceback.print_exc()
        return 1


def preload_for_forks() -> str:
    """Import PRELOAD and check that ranks forked now can use CUDA: '' when they can, else the refusal (ForkUnsafe's
    message)."""
    try:
        check_fork_safe(preload())
    except ForkUnsafe as unsafe:
        return str(unsafe)
    return ""


def launch(world: int, script: str, args: list[str]) -> int:
    """Fork the ranks of one run (the imports are done) and wait for them; the first failure stops the others."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # The port is picked after the ~10 s of imports, just before rank 0 binds it: picked before, another test's
    # process took it in between once (EADDRINUSE under two pytest workers).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = run_rank(rank, world, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            print(f"fork_ranks: rank {rank} exited with {code}; stopping the others", file=sys.stderr)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while ranks and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.05)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


def serve(socket_path: str) -> int:
    """`--serve SOCKET`: import once, then run each request (a JSON line: argv, env, cwd, stdout and stderr files) in
    a fork of this process, as a fresh `fork_ranks.py ARGV` would run it; answers {"pid"} at once, {"returncode"}
    when it ends. One request at a time. tests/pipeline_runs.py keeps one such server per pytest worker: a fresh
    launcher paid ~4 s of CPU for its imports, each of the suite's ~50 runs."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # ends with the pytest worker
    refusal = preload_for_forks()
    if refusal:
        print(f"unsafe: {refusal}", flush=True)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(1)
    print("ready", flush=True)
    with open(os.devnull, "w") as devnull:   # nobody reads the ready pipe from here on
        os.dup2(devnull.fileno(), 1)
    while True:
        connection, _ = listener.accept()
        with connection:
            with connection.makefile("r") as stream:
                request = json.loads(stream.readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:   # pragma: no cover - runs in the child
                listener.close()
                connection.close()
                os._exit(_serve_one(request))
            with contextlib.suppress(OSError):   # also here: the client may kill the group before the child sets it
                os.setpgid(pid, pid)
            _answer(connection, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            _answer(connection, {"returncode": os.waitstatus_to_exitcode(status)})


def _answer(connection: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):   # a client that timed out has killed the run and gone
        connection.sendall((json.dumps(message) + "\n").encode())


def _serve_one(request: dict) -> int:
    """A served request, in its own process group (a timeout kills the group: this launcher and its ranks)."""
    os.setpgid(0, 0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        world, script, args = int(request["argv"][0]), request["argv"][1], request["argv"][2:]
        sys.argv = [__file__, *request["argv"]]
        code = launch(world, script, args)
    except BaseException:  # noqa: BLE001 - reported as a fresh launcher's traceback would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main() -> int:
    if sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    world, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    refusal = preload_for_forks()
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    return launch(world, script, args)


if __name__ == "__main__":
    sys.exit(main())
