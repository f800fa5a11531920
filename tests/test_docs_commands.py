"""Docs cannot drift: every shell block of README.md and docs/*.md runs here in a smoke form (DESIGN.md, Habits).

A shell block is a ```bash, ```sh, ```shell or ```console fence; each one is a test named by its file and line. Its
commands run in order in one scratch directory, so a block that makes data and then trains on it is checked as a
whole. Per command, by its program:

- run: cheap commands run as written (the simulator, the trace tools on a small trace, the corpus and
  preprocessing tools, torch_schedule_csv.py), with `python` this interpreter and repository paths made absolute.
  A ```console block's `$ ` commands must also print the output the block shows.
- check: what trains or needs root, SLURM, a GPU, RDMA or many minutes is not run (CHECK_ONLY says why). Its flags
  go through the program's own parser: for the launchers, the launcher's own flags must be ones its script takes
  and the rest go through the trainer's `--check-config` in this process, as the launcher runs it before any rank
  starts (layout, data paths, the checkpoint to resume); a `--save` leaves the checkpoint manifest the run would
  leave, so a documented resume is checked against it.

Everywhere: a `[--flag ...]` option in brackets must be a flag of its program (the command runs without it),
metavariables (`P`, `V`, ...) take the values in METAVARIABLES, an environment variable set in front of a command
must be one the project reads, and a command no rule knows fails the test (add its smoke form here).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")
PYTHON = sys.executable

# Stand-ins for a synopsis's metavariables.
METAVARIABLES = {"P": "2", "V": "2", "T": "1", "D": "1"}
PLACEHOLDER = "PLACEHOLDER"          # what an <angle-bracketed> placeholder becomes; only check-only commands take one
# Environment variables documented in front of a command that are not the project's own.
EXTERNAL_ENVIRONMENT = {"LD_PRELOAD", "TSAN_OPTIONS", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}
LAUNCHERS = {"run_single.sh": "run_single.sh", "run_master.sh": "tools/launch_node.sh",
             "run_worker.sh": "tools/launch_node.sh", "tools/slurm/run.slurm": "tools/slurm/run.slurm"}
LAYOUT_FLAGS = {"--pipeline_parallel": "P", "--model_chunks": "V", "--tensor_parallel": "T", "--data_parallel": "D"}
# Python tools that are flag-checked, not run, with the package function that parses their flags.
CHECK_ONLY = {
    "tools/loss_sweep.py": ("megatron_app.bench.loss_sweep", "parse_args", "trains one model per rate and loss "
                            "model: minutes to an hour"),
}
WHY_NOT_RUN = {
    "launcher": "it trains (the launchers themselves run in tests/test_run_single.py and test_multinode_*.py)",
    "sbatch": "it needs a SLURM cluster (tests/test_slurm.py runs one where it can)",
    "tests": "it is the test command, or a part of it that builds sanitizer modules (minutes)",
    "pip": "it installs into the environment",
    "example": "it trains (tests/test_simple_train_loop.py runs examples/simple_train_loop.py at P=1, P=2 and P=2 V=2)",
    "gpu_check": "it is the GPU proof (minutes on a GPU host); its CPU rehearsal runs in tests/test_gpu_check.py",
}
GPU_CHECK_FLAGS = {"--out": True, "--wheels": True, "--steps": True, "--cpu": False, "--budget-s": True,
                   "--no-ahead": False}   # flag -> takes a value


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str            # path relative to the repository
    line: int           # of the opening fence
    fence: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclasses.dataclass
class Command:
    text: str                        # one command, continuation lines joined
    expected_output: list[str] | None = None   # a console block's lines after the command


def shell_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            opening = re.match(r"^(\s*)```(\w+)\s*$", lines[index])
            if opening is None:
                index += 1
                continue
            indent, fence = opening.groups()
            end = next(k for k in range(index + 1, len(lines)) if re.match(r"^\s*```\s*$", lines[k]))
            if fence in SHELL_FENCES:
                body = "\n".join(line[len(indent):] if line.startswith(indent) else line
                                 for line in lines[index + 1:end])
                blocks.append(Block(str(path.relative_to(REPO)), index + 1, fence, body))
            index = end + 1
    return blocks


def commands_of(block: Block) -> list[Command]:
    """A bash block: every command, continuations joined. A console block: its `$ ` commands and their output."""
    result: list[Command] = []
    pending = ""
    for line in block.text.splitlines():
        if block.fence == "console" and not pending:
            if line.startswith("$ "):
                line = line[2:]
            else:
                if result and line.strip():
                    result[-1].expected_output.append(line.rstrip())
                continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text and not text.startswith("#"):
            result.append(Command(text, [] if block.fence == "console" else None))
    assert not pending, f"{block.id}: the last command ends with a line continuation"
    return result


@dataclasses.dataclass
class Parsed:
    environment: dict[str, str]
    argv: list[str]
    optional_flags: list[str]        # flags shown in [brackets]


def parse_command(text: str) -> Parsed:
    optional = []
    for group in re.findall(r"(?<=\s)\[([^\[\]]*)\]", text):
        optional += re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", group)
    text = re.sub(r"(?<=\s)\[[^\[\]]*\]", " ", text)
    text = re.sub(r"<[^<>\s][^<>]*>", PLACEHOLDER, text)
    tokens = shlex.split(text, comments=True)
    environment = {}
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        environment[name] = value
    return Parsed(environment, [METAVARIABLES.get(token, token) for token in tokens], optional)


# ---------------------------------------------------------------------------------------------------------------
# What the project reads: environment variables, launcher flags, test files and markers.

def project_sources() -> str:
    paths = [*REPO.glob("*.sh"), *(REPO / "tools").rglob("*"), *(REPO / "megatron_app").rglob("*.py"),
             *(REPO / "tests").rglob("*.py"), *(REPO / "csrc").rglob("*"), REPO / "setup.py"]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths
                     if p.is_file() and p.suffix not in (".so", ".o", ".pyc", ".png") and p.name != Path(__file__).name)


def check_environment(environment: dict[str, str], sources: str) -> None:
    for name in environment:
        assert name in EXTERNAL_ENVIRONMENT or re.search(rf"\b{name}\b", sources), \
            f"the environment variable {name} is read nowhere in the project"


def launcher_flags(script: str) -> dict[str, bool]:
    """The flags a launcher script's `case` takes: {flag: takes a value}; flags it refuses are left out."""
    flags = {}
    for pattern, action in re.findall(r"^\s*((?:-h\|)?--[\w|-]+)\)(.*?);;", (REPO / script).read_text(),
                                      re.M | re.S):
        if "fail " in action and "shift" not in action:
            continue        # e.g. run.slurm refuses --nnodes: it comes from the allocation
        for name in pattern.split("|"):
            flags[name] = name not in ("-h", "--help")
    return flags


def help_flags(argv: list[str]) -> set[str]:
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", done.stdout))


# ---------------------------------------------------------------------------------------------------------------
# Per-program smoke forms.

class Workspace:
    """One block's scratch directory: the commands run here, in order."""

    def __init__(self, directory: Path, monkeypatch, sources: str):
        self.dir = directory
        self.monkeypatch = monkeypatch
        self.sources = sources
        self.environment = dict(os.environ)      # before a trainer check sets WORLD_SIZE in this process

    def run(self, argv: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess:
        env = dict(self.environment, **environment)
        done = subprocess.run(argv, cwd=self.dir, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        return done


def repository_path(token: str) -> str:
    return str(REPO / token) if (REPO / token).is_file() else token


def smoke_python(command: Parsed, workspace: Workspace) -> tuple[subprocess.CompletedProcess | None, str]:
    """`python tools/X.py ...` or `python -m module ...`: run it, or parse its flags when it is CHECK_ONLY."""
    argv = command.argv[1:]
    program = argv[0] if argv[0] != "-m" else argv[1]
    if argv[0] == "-m" and argv[1] == "pytest":
        smoke_tests(argv[2:])
        return None, "checked, not run: " + WHY_NOT_RUN["tests"]
    # the repository's own files named in a command (a tool, a committed lengths file) are read from the repository
    full = [PYTHON, *[repository_path(token) for token in argv]]
    if command.optional_flags:
        known = help_flags(full[:3] if argv[0] == "-m" else full[:2])
        unknown = [flag for flag in command.optional_flags if flag not in known]
        assert not unknown, f"{program} has no {', '.join(unknown)}"
    if program in CHECK_ONLY:
        module, function, why = CHECK_ONLY[program]
        getattr(importlib.import_module(module), function)(argv[1:])    # argparse exits 2 on a bad flag
        return None, f"flags parsed by {module}.{function}, not run: {why}"
    assert PLACEHOLDER not in full, f"{program}: a command that runs cannot hold a <placeholder>"
    return workspace.run(full, command.environment), "ran"


def smoke_launcher(command: Parsed, workspace: Workspace) -> None:
    """A launcher's own flags must be its script's; the rest goes through the trainer's --check-config."""
    argv = command.argv
    if argv[0] == "sbatch":
        argv = argv[argv.index("tools/slurm/run.slurm"):]          # the options before the script are sbatch's
    elif argv[0] == "bash":
        argv = argv[1:]
    script, flags = argv[0], argv[1:]
    own = launcher_flags(LAUNCHERS[script])
    unknown = [flag for flag in command.optional_flags if flag not in own]
    if unknown:                                   # [--flag] in a synopsis: the launcher's, or the trainer's
        trainer_flags = help_flags([PYTHON, "-m", "megatron_app.train"])
        assert all(flag in trainer_flags for flag in unknown), \
            f"neither {script} nor the trainer has {', '.join(f for f in unknown if f not in trainer_flags)}"
    layout = dict.fromkeys(LAYOUT_FLAGS.values(), 1)
    nnodes, trainer = 1, []
    index = 0
    while index < len(flags):
        flag = flags[index]
        if flag not in own:                       # the trainer's, passed through
            trainer.append(flag)
            index += 1
            continue
        value = flags[index + 1] if own[flag] else None
        canonical = "--" + flag[2:].replace("-", "_")
        if canonical in LAYOUT_FLAGS:
            layout[LAYOUT_FLAGS[canonical]] = int(value)
        elif canonical == "--nnodes":
            nnodes = int(value)
        index += 2 if own[flag] else 1
    world = layout["P"] * layout["T"] * layout["D"]
    environment = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world // nnodes)}
    # As the launchers call it: the whole layout first, then the trainer's flags.
    layout_argv = [str(part) for flag, key in LAYOUT_FLAGS.items() for part in (flag, layout[key])]
    check_config(layout_argv + trainer, environment, workspace)


def check_config(trainer_argv: list[str], environment: dict[str, str], workspace: Workspace) -> None:
    """The trainer's own pre-flight (`python -m megatron_app.train ... --check-config`), here in this process."""
    import megatron_app.train.__main__ as trainer
    from megatron_app.train.args import parse_args

    monkeypatch = workspace.monkeypatch
    monkeypatch.chdir(workspace.dir)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    argv = [*trainer_argv, "--check-config"]
    try:
        trainer.main(argv)
    except SystemExit as exit_:
        pytest.fail(f"the trainer refuses {shlex.join(trainer_argv)} (exit {exit_.code}; its line is above)")
    args = parse_args(argv, environment)
    if args.save:
        leave_checkpoint(args)


def leave_checkpoint(args) -> None:
    """The manifest the run would leave in --save at its last iteration (it always saves there), so that a
    documented resume from it is checked against it."""
    from megatron_app.train.checkpoint_manifest import commit, iteration_dir, manifest_for

    os.makedirs(iteration_dir(args.save, args.iters), exist_ok=True)
    commit(args.save, manifest_for(args, args.iters, args.iters * args.global_batch_size, files=[]))


def smoke_tests(pytest_args: list[str]) -> None:
    """The test command (or pytest itself): every test file it names exists and every marker is declared."""
    markers = re.findall(r"^\s+(\w+):", (REPO / "pytest.ini").read_text().split("markers =", 1)[1], re.M)
    index = 0
    while index < len(pytest_args):
        argument = pytest_args[index]
        if argument == "-m":
            words = set(re.findall(r"\w+", pytest_args[index + 1])) - {"not", "and", "or"}
            assert words <= set(markers), f"undeclared pytest marker(s) {sorted(words - set(markers))}"
            index += 2
            continue
        if not argument.startswith("-"):
            assert (REPO / argument.split("::")[0]).exists(), f"{argument} does not exist"
        index += 1


def smoke_pip(command: Parsed) -> None:
    """`pip install [-e] /path/to/megatron_app[extra]`: the extras exist."""
    setup = (REPO / "setup.py").read_text()
    for target in command.argv[2:]:
        extra = re.search(r"\[(\w+)\]$", target)
        if extra:
            assert re.search(rf'"{extra.group(1)}"\s*:', setup), f"setup.py declares no extra [{extra.group(1)}]"


def smoke_gpu_check(arguments: list[str]) -> None:
    """tools/gpu_check.sh's flags are the ones its parser takes (it writes nothing without --out)."""
    assert (REPO / "tools" / "gpu_check.sh").is_file()
    rest = list(arguments)
    while rest:
        flag = rest.pop(0)
        assert flag in GPU_CHECK_FLAGS, f"tools/gpu_check.sh takes no {flag}"
        if GPU_CHECK_FLAGS[flag]:
            assert rest, f"tools/gpu_check.sh {flag} needs a value"
            rest.pop(0)
    assert "--out" in arguments, "tools/gpu_check.sh needs --out DIR"


def smoke_torchrun(command: Parsed) -> None:
    """`torchrun --nproc_per_node N examples/X.py ...`: the example exists, takes every flag given, and N ranks are
    the pipeline's (--pipeline_parallel, 1 without it)."""
    argv = command.argv[1:]
    nproc = 1
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--nproc_per_node":
            nproc = int(argv.pop(0))
        elif flag != "--standalone":
            pytest.fail(f"torchrun {flag}: no smoke form for it in tests/test_docs_commands.py")
    script, flags = argv[0], argv[1:]
    assert script.startswith("examples/") and (REPO / script).is_file(), f"{script} is no example of this repository"
    known = help_flags([PYTHON, str(REPO / script)])
    unknown = [flag for flag in [*flags, *command.optional_flags] if flag.startswith("--") and flag not in known]
    assert not unknown, f"{script} has no {', '.join(unknown)}"
    pipeline = int(flags[flags.index("--pipeline_parallel") + 1]) if "--pipeline_parallel" in flags else 1
    assert nproc == pipeline, f"{script}: --nproc_per_node {nproc} ranks for a pipeline of {pipeline}"


def smoke(command: Command, workspace: Workspace) -> str:
    """Run or check one documented command; what was done, in words."""
    parsed = parse_command(command.text)
    check_environment(parsed.environment, workspace.sources)
    argv = parsed.argv
    result = None
    program = argv[1] if argv[0] in ("bash", "sbatch") and len(argv) > 1 else argv[0]
    if argv[0] == "sbatch" or program in LAUNCHERS:
        smoke_launcher(parsed, workspace)
        how = ("launcher flags and the trainer's --check-config, not run: "
               + WHY_NOT_RUN["sbatch" if argv[0] == "sbatch" else "launcher"])
    elif program == "tools/run_tests.sh":
        smoke_tests(argv[2:])
        how = "test files and markers checked, not run: " + WHY_NOT_RUN["tests"]
    elif program == "tools/gpu_check.sh":
        smoke_gpu_check(argv[2:])
        how = "flags checked, not run: " + WHY_NOT_RUN["gpu_check"]
    elif program == "tools/build_sanitized.sh":
        assert (REPO / program).is_file()
        assert parsed.environment.get("MAPP_SANITIZE") in (None, "thread", "address,undefined")
        how = "checked, not run: " + WHY_NOT_RUN["tests"]
    elif argv[0] in ("python", "python3", ".venv/bin/python"):
        result, how = smoke_python(parsed, workspace)
    elif argv[0] == "torchrun":
        smoke_torchrun(parsed)
        how = "flags checked, not run: " + WHY_NOT_RUN["example"]
    elif argv[:2] == ["mkdir", "-p"]:
        workspace.run(argv, parsed.environment)
        how = "ran"
    elif argv[:2] == ["pip", "install"]:
        smoke_pip(parsed)
        how = "extras checked, not run: " + WHY_NOT_RUN["pip"]
    else:
        pytest.fail(f"no smoke form for `{command.text}`: add one to tests/test_docs_commands.py")
    if command.expected_output is not None:
        assert result is not None, f"`{command.text}` shows output but is not run"
        shown = [line.rstrip() for line in result.stdout.splitlines()]
        assert shown == command.expected_output, (
            f"`{command.text}` printed\n" + "\n".join(shown) + "\nbut the doc shows\n"
            + "\n".join(command.expected_output))
        how += ", output as shown"
    return how


# ---------------------------------------------------------------------------------------------------------------
# What a doc's blocks presuppose, made in the scratch directory first.

def simulated_run_in_traces(directory: Path, made: "Made") -> None:
    """traces.md's tools read `traces/`: a small P=4 V=2 run there (simulated: training one takes a minute)."""
    done = subprocess.run([PYTHON, "-m", "megatron_app.sim", "--pipeline_parallel", "4", "--model_chunks", "2",
                           "--microbatches", "8", "--policy", "planned", "--link-latency-us", "100", "--iterations", "3",
                           "--trace-dir", str(directory / "traces")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def corpus_sources(directory: Path, made: "Made") -> None:
    """running.md preprocesses corpus.jsonl with a GPT-2 vocab.json + merges.txt: make_corpus.py's."""
    corpus = made.corpus()
    for name in ("corpus.jsonl", "vocab.json", "merges.txt"):
        (directory / name).write_bytes((corpus / name).read_bytes())


class Made:
    """What several blocks' set-ups use, made once per module."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._corpus = None

    def corpus(self) -> Path:
        if self._corpus is None:
            out = self.directory / "corpus"
            done = subprocess.run([PYTHON, str(REPO / "tools" / "make_corpus.py"), "--output-dir", str(out),
                                   "--sources", "licenses"], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            self._corpus = out
        return self._corpus


# (doc, a text its block contains) -> what that block presupposes.
SETUP = {("docs/traces.md", "_trace.py"): simulated_run_in_traces,
         ("docs/running.md", "corpus.jsonl"): corpus_sources}

BLOCKS = shell_blocks()


@pytest.fixture(scope="module")
def sources() -> str:
    return project_sources()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Made:
    return Made(tmp_path_factory.mktemp("made"))


def test_the_docs_have_shell_blocks():
    """The extraction finds the blocks (a renamed fence would silently check nothing)."""
    docs = {block.doc for block in BLOCKS}
    assert {"README.md", "docs/running.md", "docs/simulator.md", "docs/traces.md"} <= docs
    assert len(BLOCKS) >= 12


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_documented_commands_work(block, tmp_path, monkeypatch, sources, made):
    commands = commands_of(block)
    assert commands, f"{block.id}: an empty shell block"
    for (doc, needle), setup in SETUP.items():
        if block.doc == doc and needle in block.text:
            setup(tmp_path, made)
    before = set(os.listdir(tmp_path))
    workspace = Workspace(tmp_path, monkeypatch, sources)
    for command in commands:
        print(f"{command.text}\n    -> {smoke(command, workspace)}")     # shown with the test's output (-rA, -s)
    # Run from a checkout, as the docs say, what these commands write must not show up as untracked files.
    written = [name + "/" if (tmp_path / name).is_dir() else name for name in set(os.listdir(tmp_path)) - before]
    for name in written:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=REPO)
        assert ignored.returncode == 0, f"{name}, which the commands of {block.id} write, is not in .gitignore"


# ---------------------------------------------------------------------------------------------------------------
# The check itself: what a wrong doc looks like must fail.

def smoke_block(text: str, directory: Path, monkeypatch, sources, fence: str = "bash") -> None:
    block = Block("docs/example.md", 1, fence, text)
    workspace = Workspace(directory, monkeypatch, sources)
    for command in commands_of(block):
        smoke(command, workspace)


WRONG_DOCS = {   # what the doc says -> what the failure names
    "trainer flag that does not exist": ("bash run_single.sh --pipeline_parallel 2 --no-such-flag 3",
                                         "unrecognized arguments: --no-such-flag"),
    "launcher flag run_single.sh lacks": ("bash run_single.sh --pipeline_parallel 2 --transport tcp",
                                          "unrecognized arguments: --transport"),
    "model that does not split": ("bash run_single.sh --pipeline_parallel 8 --model_chunks 2",
                                  "--num-layers 8 is not divisible"),
    "flag run.slurm refuses": ("sbatch tools/slurm/run.slurm --pipeline_parallel 2 --nnodes 2",
                               "unrecognized arguments: --nnodes"),
    "resume with nothing left to train": ("bash run_single.sh --pipeline_parallel 2 --save ckpt --iters 3\n"
                                          "bash run_single.sh --pipeline_parallel 2 --load ckpt --iters 3",
                                          "nothing left to train"),
    "tool flag that does not exist": ("python -m megatron_app.sim --pipeline_parallel 2 --microbatches 4 --no-such 1",
                                      "unrecognized arguments: --no-such"),
    "optional flag that does not exist": ("python tools/process_trace.py --help [--no-such-option K]",
                                          "process_trace.py has no --no-such-option"),
    "long tool's flag that does not exist": ("python tools/loss_sweep.py --iters 3 --no-such-flag",
                                             "unrecognized arguments: --no-such-flag"),
    "example's flag that does not exist": ("torchrun --nproc_per_node 2 examples/simple_train_loop.py "
                                           "--pipeline_parallel 2 --no-such-flag", "has no --no-such-flag"),
    "example on too few ranks": ("torchrun --nproc_per_node 1 examples/simple_train_loop.py --pipeline_parallel 2",
                                 "--nproc_per_node 1 ranks for a pipeline of 2"),
    "environment nobody reads": ("MEGATRON_APP_NO_SUCH_SETTING=1 bash run_single.sh --pipeline_parallel 2",
                                 "MEGATRON_APP_NO_SUCH_SETTING is read nowhere"),
    "test file that does not exist": ("bash tools/run_tests.sh tests/test_no_such_file.py",
                                      "tests/test_no_such_file.py does not exist"),
    "undeclared marker": ('bash tools/run_tests.sh -m "not sluggish"', "undeclared pytest marker(s) ['sluggish']"),
    "command with no smoke form": ("make everything", "no smoke form for `make everything`"),
}


@pytest.mark.parametrize("text, named", WRONG_DOCS.values(), ids=WRONG_DOCS.keys())
def test_a_wrong_command_fails_naming_why(text, named, tmp_path, monkeypatch, sources, capsys):
    with pytest.raises((AssertionError, SystemExit, pytest.fail.Exception)) as failure:
        smoke_block(text, tmp_path, monkeypatch, sources)
    captured = capsys.readouterr()
    assert named in str(failure.value) + captured.out + captured.err


def test_the_right_commands_pass(tmp_path, monkeypatch, sources):
    """The counterparts of the wrong ones above."""
    smoke_block("bash run_single.sh --pipeline_parallel 2 --save ckpt --iters 3\n"
                "bash run_single.sh --pipeline_parallel 2 --load ckpt --iters 4  # resume\n"
                "MEGATRON_APP_TRANSPORT=tcp bash run_single.sh --pipeline_parallel 2 \\\n    --iters 1\n"
                "python tools/process_trace.py --help [--trace-dir DIR] [--iteration K]\n", tmp_path, monkeypatch,
                sources)


def test_a_console_block_must_print_what_it_shows(tmp_path, monkeypatch, sources):
    command = "$ python -m megatron_app.sim --pipeline_parallel 2 --microbatches 2 --policy dfc"
    printed = subprocess.run([PYTHON, "-m", "megatron_app.sim", "--pipeline_parallel", "2", "--microbatches", "2",
                              "--policy", "dfc"], capture_output=True, text=True, check=True).stdout
    smoke_block(f"{command}\n{printed}", tmp_path, monkeypatch, sources, fence="console")
    with pytest.raises(AssertionError, match="but the doc shows"):
        smoke_block(f"{command}\n{printed.replace('dfc', 'bfc')}", tmp_path, monkeypatch, sources, fence="console")
