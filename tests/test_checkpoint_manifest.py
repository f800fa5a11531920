"""Which checkpoint --load finds, and which it refuses: a save only counts once its manifest is written, and a
checkpoint of another layout or model shape is refused with both layouts named (before any rank starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_app.train.args import UsageError, parse_args
from megatron_app.train.checkpoint_manifest import (
    ARCHITECTURE_DEFAULTS, MANIFEST, TRACKER, CheckpointError, check_compatible, commit, find_checkpoint, iteration_dir,
    manifest_for, rank_file_name)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUT = dict(pipeline_parallel=2, model_chunks=2, tensor_parallel=1, data_parallel=1)
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=256)
TRAINING = dict(global_batch_size=8, micro_batch_size=2, seed=7, iters=20, data_path=None)


def _args(**overrides):
    return SimpleNamespace(**{**LAYOUT, **MODEL, **TRAINING, **overrides})


def _save(save_dir, iteration, args=None, commit_it=True):
    """What save_checkpoint leaves on disk, without the model: rank files, then (if committed) the manifest."""
    args = args or _args()
    directory = iteration_dir(str(save_dir), iteration)
    os.makedirs(directory, exist_ok=True)
    files = [rank_file_name(p, t) for p in range(args.pipeline_parallel) for t in range(args.tensor_parallel)]
    for name in files:
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(b"rank state")
    if commit_it:
        commit(str(save_dir), manifest_for(args, iteration, iteration * args.global_batch_size, files))
    return directory


def test_the_tracker_names_the_latest_committed_checkpoint(tmp_path):
    assert find_checkpoint(str(tmp_path)) is None  # nothing saved yet: a fresh start
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    found = find_checkpoint(str(tmp_path))
    assert (found.iteration, found.consumed_samples) == (20, 160)
    assert found.manifest["layout"] == LAYOUT and \
        found.manifest["model"] == {**MODEL, "precision": "fp32", **ARCHITECTURE_DEFAULTS,
                                    "untie_embeddings_and_output_weights": False}   # tied now, untied before recorded
    assert found.manifest["files"] == ["model_optim_rng_pp000_tp00.pt", "model_optim_rng_pp001_tp00.pt"]
    assert (tmp_path / TRACKER).read_text().strip() == "20"
    # --load may also name one iteration's directory.
    assert find_checkpoint(iteration_dir(str(tmp_path), 10)).iteration == 10
    assert not [p for p in tmp_path.rglob("*.tmp*")]


def test_an_unfinished_save_is_never_loaded(tmp_path):
    _save(tmp_path, 10)
    unfinished = _save(tmp_path, 15, commit_it=False)  # crashed after writing rank files, before the manifest
    assert find_checkpoint(str(tmp_path)).iteration == 10
    with pytest.raises(CheckpointError, match="has no manifest.json: its save never finished"):
        find_checkpoint(unfinished)
    # A commit with a rank file missing is refused, so the tracker cannot point at it.
    os.remove(os.path.join(unfinished, rank_file_name(1, 0)))
    with pytest.raises(CheckpointError, match="rank files missing: model_optim_rng_pp001_tp00.pt"):
        commit(str(tmp_path), manifest_for(_args(), 15, 120, [rank_file_name(0, 0), rank_file_name(1, 0)]))
    assert find_checkpoint(str(tmp_path)).iteration == 10


def test_damaged_manifests_and_trackers_are_named(tmp_path):
    directory = _save(tmp_path, 10)
    manifest = json.loads(open(os.path.join(directory, MANIFEST)).read())
    manifest["schema"] = "megatron_app.checkpoint/2"
    open(os.path.join(directory, MANIFEST), "w").write(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="has schema 'megatron_app.checkpoint/2'"):
        find_checkpoint(str(tmp_path))
    open(os.path.join(directory, MANIFEST), "w").write("{truncated")
    with pytest.raises(CheckpointError, match="is not a megatron_app checkpoint manifest"):
        find_checkpoint(str(tmp_path))
    (tmp_path / TRACKER).write_text("latest")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        find_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="is not a directory"):
        find_checkpoint(str(tmp_path / "absent"))
    # Megatron-LM's `--save DIR --load DIR`: a first run finds nothing there yet and starts fresh
    assert find_checkpoint(str(tmp_path / "absent"), save_dir=str(tmp_path / "." / "absent")) is None
    with pytest.raises(CheckpointError, match="is not a directory"):
        find_checkpoint(str(tmp_path / "absent"), save_dir=str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("overrides, fragment", [
    ({"model_chunks": 1}, "was saved with pipeline_parallel=2 model_chunks=2 tensor_parallel=1 but this run has "
                          "pipeline_parallel=2 model_chunks=1 tensor_parallel=1"),
    ({"pipeline_parallel": 4}, "but this run has pipeline_parallel=4 model_chunks=2 tensor_parallel=1"),
    ({"tensor_parallel": 2}, "but this run has pipeline_parallel=2 model_chunks=2 tensor_parallel=2"),
    ({"hidden_size": 64}, "has hidden_size=32 but this run has --hidden-size 64"),
    ({"seq_length": 64}, "has seq_length=32 but this run has --seq-length 64"),
    ({"vocab_size": 512}, "has vocab_size=256 but this run has --vocab-size 512"),
    ({"data_path": ["/data/other"]}, "was trained with --data-path (mock data) but this run has --data-path "
                                     "/data/other; resume with the same, or pass --allow-data-change-on-resume"),
    ({"variable_seq_lengths": True}, "was trained with --variable-seq-lengths off but this run has "
                                     "--variable-seq-lengths on; resume with the same, or pass "
                                     "--allow-data-change-on-resume"),
    ({"synthetic_microbatches": "/plans/sweep.json"}, "was trained with no --synthetic-microbatches but this run has "
                                                      "--synthetic-microbatches /plans/sweep.json; resume with the "
                                                      "same, or pass --allow-data-change-on-resume"),
    ({"iters": 10}, "is at iteration 10, and --iters is 10: nothing left to train"),
    ({"precision": "bf16"}, "was trained in fp32 but this run has --bf16; resume in fp32"),
])
def test_incompatible_checkpoints_are_refused(tmp_path, overrides, fragment):
    _save(tmp_path, 10)
    with pytest.raises(CheckpointError) as info:
        check_compatible(find_checkpoint(str(tmp_path)), _args(**overrides))
    assert fragment in str(info.value)


def test_another_data_path_is_refused_naming_both_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _save(tmp_path, 10, _args(data_path=["0.3", "corpus/a", "0.7", "corpus/b"]))
    found = find_checkpoint(str(tmp_path))
    # The same files named relative to the same directory, or absolute: the same data.
    check_compatible(found, _args(data_path=["0.3", str(tmp_path / "corpus/a"), "0.7", "corpus/b"]))
    with pytest.raises(CheckpointError) as info:
        check_compatible(found, _args(data_path=["0.5", "corpus/a", "0.5", "corpus/b"]))
    assert f"--data-path 0.3 {tmp_path}/corpus/a 0.7 {tmp_path}/corpus/b but this run has " \
           f"--data-path 0.5 {tmp_path}/corpus/a 0.5 {tmp_path}/corpus/b" in str(info.value)
    check_compatible(found, _args(data_path=["corpus/c"], variable_seq_lengths=True,
                                  allow_data_change_on_resume=True))


def test_other_data_parallel_sizes_and_batch_settings_may_resume(tmp_path):
    _save(tmp_path, 10)
    check_compatible(find_checkpoint(str(tmp_path)), _args(data_parallel=2, global_batch_size=16, seed=1))


def _flags(load_dir, P=2, V=2):
    return ["--pipeline_parallel", str(P), "--model_chunks", str(V), "--num-layers", "4", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
            "--iters", "20", "--load", str(load_dir)]


def test_flag_check_refuses_another_layout_before_ranks_start(tmp_path):
    _save(tmp_path, 10)
    args = parse_args(_flags(tmp_path), environ={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert args.load == str(tmp_path)
    with pytest.raises(UsageError, match="model_chunks=2 .* but this run has .*model_chunks=1"):
        parse_args(_flags(tmp_path, V=1), environ={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})

    env = dict(os.environ, WORLD_SIZE="2", PYTHONPATH=REPO, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "megatron_app.train", *_flags(tmp_path, V=1), "--check-config"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_app.train: error: checkpoint "), result.stderr
    assert "pipeline_parallel=2 model_chunks=2 tensor_parallel=1" in lines[0]
    assert "pipeline_parallel=2 model_chunks=1 tensor_parallel=1" in lines[0]
