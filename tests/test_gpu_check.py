"""tools/gpu_check.sh's CPU rehearsal: every step of the GPU proof runs at small sizes, so the script cannot rot
between GPU runs. The GPU targets themselves are judged on a GPU host (the report's numbers), not here."""

import dataclasses
import json
import tarfile
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # every step, the opt-in one too (gpu_check.py's STEPS)
    steps = "host,pytest,equality,own-loop,transport,prediction,curves,composition,ipc-sends,slots8"
    result = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--cpu", "--out", str(out),
                             "--steps", steps], capture_output=True, text=True, timeout=900)
    return out, result


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_and_writes_both_reports(rehearsal):
    out, result = rehearsal
    report = json.loads((out / "report.json").read_text())
    assert list(report["steps"]) == ["setup", "host", "pytest", "equality", "own-loop", "transport", "prediction",
                                     "curves", "composition", "ipc-sends", "slots8"]
    # where the launches' time went: before the rank, the rank's start-up phases, iterations, after
    launch = report["launch"]
    assert launch["launches"] == 4 + 4 + 2 and list(launch["median_alone"]) == [
        "total", "exposed", "gate_opened", "before_rank", "launcher_setup_env", "launcher_check_config",
        "launcher_to_rank", "rank_imports", "rank_gate", "rank_process_group", "rank_model_parallel", "rank_trainer",
        "rank_trainer_model", "rank_trainer_optimizer", "rank_trainer_data", "rank_trainer_runtime", "iterations",
        "after", "after_loop_outside_iterations", "after_rank_closing", "after_rank_process_group",
        "after_rank_exit", "ahead_overlap"]
    assert all(value >= 0 for value in launch["median_alone"].values()), launch
    # the timing steps' six runs: each started ahead, behind its gate (the first beside the equality step)
    assert launch["started_ahead"] == 6 and launch["ahead_overlap_max"] >= 0
    assert ("launch      median seconds of the launches that ran alone (of 10; 6 started ahead behind a gate"
            in (out / "report.txt").read_text())
    probes = report["steps"]["host"]["startup_probes_s"]
    assert set(probes) == {"python", "import_torch", "import_megatron_core_gc_paused",
                           "getfqdn", "gethostbyname"}
    assert all(seconds is not None and seconds > 0 for seconds in probes.values()), probes
    text = (out / "report.txt").read_text()
    assert text.startswith("gpu_check: ") and all(name in text for name in report["steps"])
    for name in ("setup", "host", "equality", "own-loop", "curves", "transport", "composition"):
        assert report["steps"][name]["status"] == "pass", (name, report["steps"][name], result.stdout[-2000:])
    # no CUDA here: the cuda-marked tests skip, and the report says why
    assert report["steps"]["pytest"]["status"] == "skip" and report["steps"]["pytest"]["skipped"] > 0
    assert "no CUDA" in report["steps"]["pytest"]["reason"]
    # the prediction step measures (its targets are a GPU host's): numbers for both layouts, spans for every rank
    rows = report["steps"]["prediction"]["rows"]
    assert set(rows) == {"p1", "p2v2"}
    ipc = report["steps"]["ipc-sends"]["rows"]["p2v2+ipc"]   # the same run by opt-in CUDA IPC: host tensors here
    slots8 = report["steps"]["slots8"]["rows"]["p2v2+slots8"]   # opt-in: staged through 8 MiB slots, measured
    assert slots8["transport"] == "staged, 8 MiB slots x 4" and 0 < slots8["send_share"] <= 1
    assert ipc["transport"] == "ipc (no fallback said)" and set(ipc["transfer_shares"]) == {"pp0", "pp1"}
    assert all(row["errors"] and set(row["span_coverage"]) == ({"pp0"} if name == "p1" else {"pp0", "pp1"})
               for name, row in rows.items())
    # the time between tasks each rank's planner learnt (its calls' task_gap_us): positive on CPU
    assert set(rows["p2v2"]["task_gap_us"]) == {"pp0", "pp1"} and all(
        gap > 0 for row in rows.values() for gap in row["task_gap_us"].values()), rows
    assert set(rows["p2v2"]["replay"]) == {"without_gaps", "with_gaps"}   # what the gap buys on this host
    # host-bound shares need device-timed tasks (tests/test_call_span_on_device.py has them): none on CPU
    assert all(row["host_bound_share"] == {} for row in rows.values()), rows
    # Python's garbage collections in each rank's trace: counted where any ran (a few a call even at this size)
    assert all(set(pauses) == {"collections", "total_ms", "longest_ms", "inside_tasks"} and pauses["collections"] > 0
               for row in rows.values() for pauses in row["gc"].values()), rows
    # each rank's peak memory over the scored iterations (the trace's memory events: the process's resident peak here)
    assert all(set(row["peak_memory_mib"]) == ({"pp0"} if name == "p1" else {"pp0", "pp1"}) and
               all(peak > 10 for peak in row["peak_memory_mib"].values()) for name, row in rows.items()), rows
    # a rank's one scored iteration here may hold no collection; over both rows some do, on the rows' own ranks
    assert any(row["gc"] for row in rows.values()) and all(
        set(row["gc"]) <= ({"pp0"} if name == "p1" else {"pp0", "pp1"}) for name, row in rows.items()), rows
    # P=1 trains one iteration more under torch.profiler, left out of every figure: its files are archived and its
    # top operators by host time reported
    profile = rows["p1"]["profile"]
    assert profile["iterations"] == [4, 4] and len(rows["p1"]["errors"]) == 1, rows["p1"]   # 3 scored, from the 3rd
    assert profile["trace"].startswith("runs/predict-p1/") and profile["trace"].endswith(".pt.trace.json.gz")
    assert len(profile["top_host_ms"]) == 8 and all(host > 0 for _, host, _ in profile["top_host_ms"])
    assert "profile" not in rows["p2v2"] and '"top_host_ms"' in (out / "report.txt").read_text()
    with tarfile.open(out / "runs.tar.gz") as archive:
        assert {profile["trace"], profile["operators"]} <= set(archive.getnames())
    # the transport issue's measure on the P=2 V=2 run: shares of the call with a send in flight, receiving, waiting
    shares = rows["p2v2"]["transfer_shares"]
    assert set(shares) == {"pp0", "pp1"} and "transfer_shares" not in rows["p1"]
    assert all(0 < share["send"] <= 1 and 0 <= share["recv"] <= 1 and 0 <= share["wait"] <= 1
               for share in shares.values()), shares
    assert rows["p2v2"]["send_share"] == max(share["send"] for share in shares.values())
    assert "send_share" in (out / "report.txt").read_text()
    assert (out / "transport.json").exists() and (out / "runs.tar.gz").exists()
    rows = report["steps"]["composition"]["rows"]     # the simulator under each of the rehearsal's curves
    assert set(rows) == {"cost_curves_h32:c2048-p4v2m16", "cost_curves_h48:c2048-p4v2m16"}, rows
    for row in rows.values():
        assert row["balanced_over_packed"] > 0 and set(row["makespan_ms"]) >= {"loader", "packed", "balanced"}


@pytest.mark.slow
def test_the_equality_rows_hold_their_tolerance(rehearsal):
    out, _ = rehearsal
    rows = json.loads((out / "report.json").read_text())["steps"]["equality"]["rows"]
    assert set(rows) == {"mock-fp32-optim", "balanced-fp32-dropout-llama-recompute"}
    for row in rows.values():
        assert row["max_relative_difference"] <= row["tolerance"] and len(row["losses_p1"]) == 2


@pytest.mark.slow
def test_the_users_own_loop_runs_and_matches_megatrons_schedule(rehearsal):
    """examples/simple_train_loop.py, P=2 V=2 under our schedule against P=1 under Megatron's (dropout 0.1): whole
    documents regrouped by `balanced`, three iterations, within the stated tolerance (the rehearsal's one row; on a
    GPU host fixed lengths and `packed` too)."""
    out, _ = rehearsal
    rows = json.loads((out / "report.json").read_text())["steps"]["own-loop"]["rows"]
    assert set(rows) == {"balanced"}
    for row in rows.values():
        assert len(row["losses_p1"]) == len(row["losses_p2v2"]) == 3
        assert row["max_relative_difference"] <= row["tolerance"] == 1e-5
    assert "own-loop" in (out / "report.txt").read_text()


@pytest.mark.slow
def test_the_curves_are_the_simulators_cost_curves(rehearsal):
    """The fitted file loads as --cost-curves and the simulator runs a composition row with it. Each hidden size's
    curves come from a P=1 run of its own on the sweep of compositions (every document count, the token range)."""
    out, _ = rehearsal
    curves = out / "cost_curves_h32.json"
    source = json.loads(curves.read_text())["source"]
    assert source["fit"].startswith("whole model") and source["num_layers"] == 4
    assert source["run"] == "curve-h32" and "--synthetic-microbatches" not in source["flags"]
    assert source["sweep"]["documents_range"] == [1, 16] and source["sweep"]["iterations"] == 6
    assert source["documents_range"] == [1, 16]          # what the fitted (traced) microbatches held
    low, high = source["tokens_range"]      # the fitted iterations' (after the skipped first)
    assert 16 <= low < 40 and 90 < high <= 128
    other = json.loads((out / "cost_curves_h48.json").read_text())["source"]
    assert other["run"] == "curve-h48" and other["model"]["hidden_size"] == 48
    # the output layer's FLOP share that the fit spreads over the layers: 2 h V / (L (8 h^2 + 4 h ffn) + 2 h V)
    model = source["model"]
    h, vocab = 32, model["vocab_size"]
    assert source["output_layer_share"] == round(2 * h * vocab / (4 * (8 * h * h + 4 * h * 128) + 2 * h * vocab), 4)
    # the traced model, from the run's trace header
    assert {k: model[k] for k in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "params_dtype",
                                  "tensor_parallel")} == {"hidden_size": 32, "num_attention_heads": 4,
                                                          "ffn_hidden_size": 128, "params_dtype": "float32",
                                                          "tensor_parallel": 1}
    assert model["vocab_size"] > 0 and model["num_layers"] == 4
    result = subprocess.run([sys.executable, "-m", "megatron_app.sim", "--pipeline_parallel", "2", "--model_chunks",
                             "2", "--microbatches", "4", "--cost-curves", str(curves), "--num-layers", "8",
                             "--lengths-file", "docs/results/lengths/copyright_2048.txt",
                             "--documents-per-microbatch", "2", "--iterations", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    said = f"cost curves {curves}: the traced model (num_layers 4, hidden_size 32, num_attention_heads 4"
    assert said in result.stderr


def test_bad_flags_get_one_line_and_exit_2(tmp_path):
    for argv, message in (([], "--out DIR is required"), (["--out"], "--out needs a folder"),
                          (["--bogus"], "unknown argument '--bogus'"),
                          (["--out", str(tmp_path), "--wheels", str(tmp_path / "none")], "is not a folder")):
        result = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), *argv], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_without_cuda_the_gpu_mode_refuses_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    if "no CUDA device visible" not in result.stderr:
        pytest.skip("this host has CUDA")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_time_budget_cuts_the_steps_it_cannot_start_and_fails_the_check(tmp_path, monkeypatch, capsys):
    """--budget-s: a step is not started once the budget is spent (reported `cut`, failing the check), and a command
    gets at most what is left. The steps are stand-ins: the budget is the gate around them."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    ran = []

    def slow_host(self):
        ran.append("host")
        time.sleep(0.5)
        return {"status": "pass"}

    monkeypatch.setattr(gpu_check.Check, "host", slow_host)
    monkeypatch.setattr(gpu_check.Check, "transport", lambda self: ran.append("transport") or {"status": "pass"})
    rc = gpu_check.main(["--out", str(tmp_path), "--cpu", "--steps", "host,transport", "--budget-s", "0.2"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 1 and ran == ["host"] and not report["passed"]
    transport = report["steps"]["transport"]
    assert transport["status"] == "cut" and "0 s budget was spent" in transport["reason"]
    assert "transport   cut" in (tmp_path / "report.txt").read_text()
    # a step whose command the budget's end stopped is `cut` too, with its error kept (the H100 run's curves step)
    monkeypatch.setattr(gpu_check.Check, "host", lambda self: time.sleep(0.3) or {"status": "fail",
                                                                                   "error": "the run took over 0.2 s"})
    assert gpu_check.main(["--out", str(tmp_path), "--cpu", "--steps", "host", "--budget-s", "0.2"]) == 1
    host = json.loads((tmp_path / "report.json").read_text())["steps"]["host"]
    assert host["status"] == "cut" and host["reason"] == "stopped when the 0 s budget ran out (the run took over 0.2 s)"
    check = gpu_check.Check(tmp_path, gpu_check.CPU, sys.executable, deadline=time.monotonic() + 5)
    assert 4 < check.limit(600) <= 5 and check.limit(2) == 2
    assert gpu_check.Check(tmp_path, gpu_check.CPU, sys.executable, deadline=time.monotonic() - 1).limit(600) == 1.0
    assert gpu_check.main(["--out", str(tmp_path), "--cpu", "--budget-s", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--budget-s must be a positive number of seconds, got 0.0")


def test_the_8_mib_slots_run_only_when_the_steps_name_it(tmp_path):
    """It judges no issue and costs a GPU host's check a launch (its time is a target): opt-in, last."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    check = gpu_check.Check(tmp_path, gpu_check.GPU, sys.executable)
    check.set_timed_plan(list(gpu_check.DEFAULT_STEPS))
    assert list(check.timed_plan)[-1] == "predict-p2v2-ipc" and "predict-p2v2-slots8" not in check.timed_plan
    check.set_timed_plan([*gpu_check.DEFAULT_STEPS, "slots8"])
    assert list(check.timed_plan)[-1] == "predict-p2v2-slots8"
    assert gpu_check.PHASES[-1] == ("slots8",) and "slots8" in gpu_check.STEPS


def test_the_steps_of_a_phase_run_side_by_side(tmp_path, monkeypatch):
    """equality and own-loop (losses only) share a phase and overlap; the timing steps run alone after them."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    spans = {}

    def step(name):
        def run(self):
            start = time.monotonic()
            time.sleep(0.4)
            spans[name] = (start, time.monotonic())
            return {"status": "pass"}
        return run

    for name in ("equality", "own_loop", "transport"):
        monkeypatch.setattr(gpu_check.Check, name, step(name))
    assert gpu_check.main(["--out", str(tmp_path), "--cpu", "--steps", "equality,own-loop,transport"]) == 0
    assert spans["equality"][0] < spans["own_loop"][1] and spans["own_loop"][0] < spans["equality"][1]
    assert spans["transport"][0] >= max(spans["equality"][1], spans["own_loop"][1])
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["steps"]) == ["equality", "own-loop", "transport"] and report["launch"] is None


def test_a_run_that_cannot_start_ahead_fails_its_own_step_not_the_check(tmp_path, monkeypatch):
    """The first timed run starts beside equality and own-loop; what fails there (its flags need the corpus, say)
    is its own step's to report when its turn comes, and every step still runs and is reported."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    def cannot_start(self, name):
        raise RuntimeError("the corpus could not be built")

    monkeypatch.setattr(gpu_check.Check, "start_ahead", cannot_start)
    monkeypatch.setattr(gpu_check.Check, "own_loop", lambda self: {"status": "pass"})
    monkeypatch.setattr(gpu_check.Check, "prediction", lambda self: {"status": "fail", "error": "its own turn"})
    assert gpu_check.main(["--out", str(tmp_path), "--cpu", "--steps", "own-loop,prediction"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"]["own-loop"]["status"] == "pass" and report["steps"]["prediction"]["status"] == "fail"


def test_a_launchs_phases_add_up_to_its_time():
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    log = {"startup": {"process_started_unix": 1000.0 + 4.0, "total_s": 6.0,
                       "seconds": {"imports": 5.0, "process_group": 0.5, "model_parallel": 0.1, "trainer": 0.4}},
           "iterations": [{"time_ms": 1500.0}, {"time_ms": 500.0}]}
    phases = gpu_check.launch_phases(1000.0, 15.0, log)
    assert phases == {"total": 15.0, "exposed": 15.0, "before_rank": 4.0, "rank_imports": 5.0,
                      "rank_process_group": 0.5, "rank_model_parallel": 0.1, "rank_trainer": 0.4, "iterations": 2.0,
                      "after": 3.0}
    # a run started ahead: its gate opened 3 s in; what it added to the check is the rest
    gated = gpu_check.launch_phases(1000.0, 15.0, log, gate_opened_unix=1003.0)
    assert gated["exposed"] == 12.0 and gated["gate_opened"] == 3.0 and list(gated)[:3] == [
        "total", "exposed", "gate_opened"]
    assert gpu_check.launch_phases(1000.0, 15.0, {"iterations": []}) is None
    summary = gpu_check.launch_summary({"eq-a-p1": phases, "predict-p1": {**phases, "total": 17.0}})
    assert summary["launches"] == 2 and summary["median_alone"]["total"] == 17.0
    assert summary["median_all"]["total"] == 16.0
    # the trainer's parts (startup.TRAINER_PARTS) follow its phase
    log["startup"]["trainer_parts"] = {"model": 0.25, "optimizer": 0.1, "data": 0.05}
    parts = gpu_check.launch_phases(1000.0, 15.0, log)
    assert list(parts)[7:10] == ["rank_trainer_model", "rank_trainer_optimizer", "rank_trainer_data"]
    assert parts["rank_trainer_model"] == 0.25
    del log["startup"]["trainer_parts"]
    # the rank's ending record splits `after`: the loop beyond its iterations, closing, the group's end, the exit
    log["ending"] = {"seconds": {"loop": 2.25, "closing": 0.25, "process_group": 0.5}, "ended_unix": 1013.0}
    split = gpu_check.launch_phases(1000.0, 15.0, log)
    assert {key: value for key, value in split.items() if key.startswith("after_")} == {
        "after_loop_outside_iterations": 0.25, "after_rank_closing": 0.25, "after_rank_process_group": 0.5,
        "after_rank_exit": 2.0}
    assert split["after"] == 3.0 and sum(v for k, v in split.items() if k.startswith("after_")) == 3.0


def test_ipc_rows_share_their_reference_and_ask_for_ipc(tmp_path, monkeypatch):
    """A `+ipc` row's P=2 V=2 run gets MEGATRON_APP_CUDA_IPC=1 (`+ipc-copy` also LEND=0) and is compared with its
    data row's P=1 run, launched once."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    calls = []

    def fake_train(self, name, pipeline, chunks, flags, iters, trace=False, extra_env=None):
        calls.append((name, extra_env))
        losses = [2.0, 1.5] if pipeline == 1 else [2.0, 1.5 + (1e-3 if "ipc-copy" in name else 0.0)]
        return {"rc": 0, "seconds": 1.0, "json": {"iterations": [{"loss": x} for x in losses]}, "tail": [],
                "ipc_fallback": "CUDA IPC to peer 1 is off (no CUDA)" if "+ipc-copy" in name else None}

    monkeypatch.setattr(gpu_check.Check, "train", fake_train)
    monkeypatch.setattr(gpu_check.Check, "corpus", lambda self: {"data_path": "d", "tokenizer_json": "t"})
    sizes = dataclasses.replace(gpu_check.CPU, rows=["balanced-fp32-dropout", "balanced-fp32-dropout+ipc",
                                                               "balanced-fp32-dropout+ipc-copy"])
    result = gpu_check.Check(tmp_path, sizes, sys.executable).equality()
    assert sorted(name for name, _ in calls) == ["eq-balanced-fp32-dropout+ipc-copy-p2v2",
                                                 "eq-balanced-fp32-dropout+ipc-p2v2", "eq-balanced-fp32-dropout-p1",
                                                 "eq-balanced-fp32-dropout-p2v2"]
    envs = dict(calls)
    assert envs["eq-balanced-fp32-dropout+ipc-p2v2"] == {"MEGATRON_APP_CUDA_IPC": "1"}
    assert envs["eq-balanced-fp32-dropout+ipc-copy-p2v2"] == {"MEGATRON_APP_CUDA_IPC": "1",
                                                              "MEGATRON_APP_CUDA_IPC_LEND": "0"}
    rows = result["rows"]
    assert rows["balanced-fp32-dropout"]["status"] == rows["balanced-fp32-dropout+ipc"]["status"] == "pass"
    assert rows["balanced-fp32-dropout+ipc"]["transport"] == "ipc (no fallback said)"
    assert rows["balanced-fp32-dropout+ipc-copy"]["status"] == "fail"       # 6.7e-4 over the CPU tolerance
    assert rows["balanced-fp32-dropout+ipc-copy"]["transport"].startswith("CUDA IPC to peer 1 is off")
    assert "transport" not in rows["balanced-fp32-dropout"]

def test_a_recompute_row_recomputes_at_p2v2_only_against_the_p1_run_without_it(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    calls = {}

    def fake_train(self, name, pipeline, chunks, flags, iters, trace=False, extra_env=None):
        calls[name] = flags
        return {"rc": 0, "seconds": 1.0, "json": {"iterations": [{"loss": 2.0}, {"loss": 1.5}]}, "tail": [],
                "ipc_fallback": None}

    monkeypatch.setattr(gpu_check.Check, "train", fake_train)
    monkeypatch.setattr(gpu_check.Check, "corpus", lambda self: {"data_path": "d", "tokenizer_json": "t"})
    sizes = dataclasses.replace(gpu_check.CPU, rows=["balanced-bf16-dropout", "balanced-bf16-dropout-recompute"])
    result = gpu_check.Check(tmp_path, sizes, sys.executable).equality()
    assert sorted(calls) == ["eq-balanced-bf16-dropout-p1", "eq-balanced-bf16-dropout-p2v2",
                             "eq-balanced-bf16-dropout-recompute-p2v2"]
    recomputing = [name for name, flags in calls.items() if "--recompute-granularity" in flags]
    assert recomputing == ["eq-balanced-bf16-dropout-recompute-p2v2"]
    assert calls[recomputing[0]][-len(gpu_check.RECOMPUTE_FLAGS):] == gpu_check.RECOMPUTE_FLAGS
    assert result["rows"]["balanced-bf16-dropout-recompute"]["status"] == "pass"


def test_a_curve_run_that_failed_is_its_own_row_and_the_other_size_still_fits(tmp_path, monkeypatch):
    """A failed launch (or a trace too thin to fit) fails its hidden size's row, not the step's other sizes."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    sizes = dataclasses.replace(gpu_check.CPU, curve_heads={32: 4, 48: 4})
    check = gpu_check.Check(tmp_path, sizes, sys.executable)
    failed = {"rc": 1, "json": None, "tail": ["megatron_app.train: error: out of memory"], "trace_dir": tmp_path}
    monkeypatch.setattr(check, "run", lambda spec: failed)
    result = check.curves()
    assert result["status"] == "fail"
    assert result["curves"]["h48"] == {"status": "fail", "run": "curve-h48",
                                       "error": "megatron_app.train: error: out of memory"}
    assert set(result["curves"]) == {"h32", "h48"}      # the first size's row is there too, not a stop
    text = gpu_check.write_text_report({"passed": False, "mode": "cpu", "seconds": 1.0, "launch": None,
                                         "steps": {"curves": {**result, "seconds": 0.1}}})
    assert "h48: fail: megatron_app.train: error: out of memory" in text


FAKE_LAUNCHER = """
import json, sys, time
from megatron_app.train.start_gate import wait_for_start_gate
from megatron_app.train.startup import StartupClock
log = sys.argv[sys.argv.index("--log-json") + 1]
clock = StartupClock()
time.sleep(0.3)                      # the imports
clock.mark("imports")
if wait_for_start_gate(poll_s=0.01):
    clock.mark("gate")
time.sleep(0.2)
for phase in ("process_group", "model_parallel", "trainer"):
    clock.mark(phase)
time.sleep(float(__import__("os").environ.get("FAKE_ITERATION_S", "0.3")))   # one iteration
json.dump({"startup": clock.report(), "iterations": [{"time_ms": 300.0}]}, open(log, "w"))
"""


def test_timed_runs_start_one_ahead_behind_a_gate_that_opens_when_their_turn_comes(tmp_path):
    """The timing steps' runs: while one runs, the next is started and waits at its start gate (its imports done,
    nothing past them); its gate opens when its step asks for it, and `exposed` counts only from there. A run no
    step takes is stopped at the end; a step asking for other flags than foreseen gets a fresh run."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    check = gpu_check.Check(tmp_path / "out", gpu_check.CPU, sys.executable)
    check.launcher = [sys.executable, str(fake)]
    spec = {name: gpu_check.RunSpec.of(name, 1, 1, ["--x", name], 1, trace=True) for name in ("a", "b", "c")}
    check.timed_plan = {name: (lambda name=name: spec[name]) for name in spec}

    first = check.train("a", 1, 1, ["--x", "a"], 1, trace=True)
    assert first["rc"] == 0 and "gate_opened" not in first["launch"]
    assert first["launch"]["exposed"] == first["launch"]["total"]
    ahead = check._ahead["b"]
    time.sleep(1.0)   # b is past its imports, at its gate, and stays there
    assert ahead.process.poll() is None and not (ahead.run_dir / "log.json").exists()
    second = check.train("b", 1, 1, ["--x", "b"], 1, trace=True)
    record = second["launch"]
    assert second["rc"] == 0 and record["gate_opened"] >= 1.0 and record["rank_gate"] >= 0.5
    assert record["exposed"] == pytest.approx(record["total"] - record["gate_opened"], abs=0.02)
    assert record["exposed"] < 1.5 and record["ahead_overlap"] == 0.0
    summary = gpu_check.launch_summary(check.launches)
    assert summary["started_ahead"] == 1 and summary["ahead_overlap_max"] == 0.0

    waiting = check._ahead["c"]       # started ahead, then asked for with other flags: stopped, run afresh
    third = check.train("c", 1, 1, ["--x", "other"], 1, trace=True)
    assert waiting.process.poll() is not None and third["rc"] == 0 and "gate_opened" not in third["launch"]
    assert not check._ahead           # c is the plan's last: nothing started after it

    check.start_ahead("b")            # a run that ran is not started again
    assert not check._ahead
    check.timed_plan["d"] = lambda: gpu_check.RunSpec.of("d", 1, 1, [], 1)
    check.start_ahead("d")            # one no step takes: close() stops it
    left = check._ahead["d"]
    check.close()
    assert left.process.poll() is not None and not check._ahead


def test_the_transport_step_checks_the_benchs_cuda_rows_as_the_cuda_test_did():
    """The pytest step leaves the bench's CUDA test to the transport step, which checks its full run the same way:
    the H200's rows pass; a row not bit-exact, or one that went another way than planned, fails it."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    document = json.loads((REPO / "docs/results/gpu/h200_2026-11-27/transport.json").read_text())
    assert len(document["cuda"]["rows"]) == 7 and gpu_check.cuda_bench_problems(document) == []
    assert gpu_check.cuda_bench_problems({"rows": []}) == []   # the CPU rehearsal's: no CUDA section
    rows = document["cuda"]["rows"]
    rows[0]["bit_exact"] = False
    rows[1]["ipc_path"] = "slots, registered (cuda ipc off: another PID namespace)"
    rows[2]["ours_path"] = "pinned staging"
    assert gpu_check.cuda_bench_problems(document) == [
        "65536 bytes not bit-exact", "1048576 bytes: ours went by pinned staging",
        "262144 bytes: ipc went by slots, registered (cuda ipc off: another PID namespace)"]


def test_a_stopped_check_leaves_no_launch_running(tmp_path, monkeypatch):
    """gpu_check's launches run in sessions of their own (so that one can be stopped whole), out of reach of a signal
    to gpu_check's group: close() (its SIGTERM/SIGINT handler calls it) stops the running ones and starts no more."""
    import threading

    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    monkeypatch.setenv("FAKE_ITERATION_S", "120")
    check = gpu_check.Check(tmp_path / "out", gpu_check.CPU, sys.executable)
    check.launcher = [sys.executable, str(fake)]
    results = []
    runner = threading.Thread(target=lambda: results.append(check.train("long", 1, 1, [], 1)))
    runner.start()
    deadline = time.monotonic() + 30
    while not check._live and time.monotonic() < deadline:
        time.sleep(0.05)
    (launch,) = check._live
    started = time.monotonic()
    check.close()
    runner.join(timeout=30)
    assert results and results[0]["rc"] != 0 and time.monotonic() - started < 15
    assert launch.process.poll() is not None
    with pytest.raises(RuntimeError, match="gpu_check is stopping: next not started"):
        check.train("next", 1, 1, [], 1)


@pytest.mark.slow
def test_gpu_check_stopped_by_sigterm_leaves_no_trainer_behind(tmp_path):
    """A runner's timeout (SIGTERM to gpu_check alone) while a timed run trains and the next waits at its gate:
    gpu_check exits and no process of either run is left."""
    import os
    import signal

    out = tmp_path / "out"
    check = subprocess.Popen([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--cpu", "--out", str(out),
                              "--steps", "prediction"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    ahead = out / "work" / "predict-p2v2"
    deadline = time.monotonic() + 240
    while not ahead.exists() and time.monotonic() < deadline:   # p1 runs, p2v2 started behind its gate
        time.sleep(0.2)
    assert ahead.exists()
    time.sleep(1.0)
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=60) == 128 + signal.SIGTERM

    def left() -> list:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(out) in cmdline:
                found.append(f"{pid}: {cmdline[:200]}")
        return found

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left()


def test_the_profiled_iteration_is_left_out_of_the_rows_figures(tmp_path, monkeypatch):
    """through_iteration cuts a trace after the last scored iteration: every figure of a prediction row reads it
    (span coverage, gaps, host-bound shares, the replay), so the profiled iteration after it counts in none."""
    from megatron_app.trace.reader import read_trace_dir
    from test_trace_synthetic import plan_greedy, write_plan

    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    plan = plan_greedy(2, 1, 2, forward_us=10, backward_us=20, iterations=3, iteration_offset=1)
    run = read_trace_dir(write_plan(tmp_path / "traces", plan))
    cut = gpu_check.through_iteration(run, 2)
    assert run.iterations() == [1, 2, 3] and cut.iterations() == [1, 2]
    assert all(e.iteration <= 2 for rank in cut.ranks for e in rank.events)
    assert len(gpu_check.replayed_errors(cut)) == 2 and set(gpu_check.span_coverage(cut, skip=0)) == {"pp0", "pp1"}


def test_a_broken_profile_summary_is_the_rows_note_not_the_steps_failure(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    profile = tmp_path / "work" / "predict-p1" / "profile"
    assert gpu_check.profile_summary(profile, tmp_path / "work")["error"].startswith("no profile in")
    profile.mkdir(parents=True)
    (profile / "rank0.1.ops.json").write_text('{"iterations": [15, 15], "operators": [{"name": "aten::mm"')
    assert gpu_check.profile_summary(profile, tmp_path / "work")["error"].startswith("rank0.1.ops.json: JSONDecodeError")
    (profile / "rank0.1.ops.json").write_text(json.dumps({"iterations": [15, 15], "operators": [
        {"name": "forward 0-0", "calls": 1, "self_host_us": 27000.0, "self_device_us": 0.0}]}))
    (profile / "rank0.1.pt.trace.json.gz").write_bytes(b"")
    summary = gpu_check.profile_summary(profile, tmp_path / "work")
    assert summary == {"iterations": [15, 15], "trace": "runs/predict-p1/profile/rank0.1.pt.trace.json.gz",
                       "operators": "runs/predict-p1/profile/rank0.1.ops.json",
                       "top_host_ms": [["forward 0-0", 27.0, 0.0]]}
