"""One rank of 8 (gloo, CPU) making the calls of Megatron-Core's own schedule unit tests
(tests/unit_tests/pipeline_parallel/test_schedules.py, Megatron-LM core_v0.19.0) against megatron_app.install():
the function get_forward_backward_func picks, the forward-only losses without pipelining (T=2), with 1F1B (T=2 P=4)
and interleaved (P=4 V=2, even and uneven chunks), each with an explicit ProcessGroupCollection + P2PCommunicator
from a HyperCommGrid, and the refusals. Each refusal is made twice, to Megatron's own function and to ours, and both
exceptions are recorded. The values are the unit tests' except: CPU tensors, and the embedding groups left None
(a forward-only call does not use them). Writes schedule_tests_rank<R>.json into argv[1].
"""

import copy
import json
import os
import sys
import traceback
import types

import torch
import torch.distributed as dist

SEQ, MBS, HIDDEN = 512, 8, 256
out_dir = sys.argv[1]
rank = int(os.environ["RANK"])


def loss_step(data_iterator, model):
    """The unit tests' forward step for pipelined layouts: a random activation; the loss is the rank's number."""
    here = int(os.environ["LOCAL_RANK"])

    def loss_func(output_tensor):
        return here, {"loss_reduced": here}

    return torch.rand(SEQ, MBS, HIDDEN), loss_func


def linear_step(data_iterator, model):
    """The unit tests' forward step without pipelining: the model's own output."""
    here = int(os.environ["LOCAL_RANK"])

    def loss_func(output_tensor):
        return here, {"loss_reduced": here}

    return model(torch.ones(1, 4)), loss_func


def linear(in_features, config, model_type="unit-test", vp_stage=None):
    model = torch.nn.Linear(in_features, 1)
    model.model_type = model_type
    model.set_input_tensor = lambda tensor: None
    model.config = config
    if vp_stage is not None:
        model.vp_stage = vp_stage
    return model


def pipeline_config(**extra):
    from megatron.core import ModelParallelConfig

    config = ModelParallelConfig(pipeline_model_parallel_size=4, sequence_parallel=False,
                                 pipeline_dtype=torch.float, **extra)
    config.hidden_size = HIDDEN
    return config


def with_config(model, **changes):
    """A model like `model` whose config differs by `changes` (set after construction, as a caller could)."""
    other = copy.copy(model)
    other.config = copy.copy(model.config)
    for name, value in changes.items():
        setattr(other.config, name, value)
    return other


def is_last_stage(pp_group):
    return dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1


def losses(store, pp_group=None):
    return {"last_stage": pp_group is None or is_last_stage(pp_group),
            "losses": [entry["loss_reduced"] for entry in store]}


def grid_groups(shape, config):
    """The unit tests' explicit groups: a HyperCommGrid over (tp, cp, pp, dp), its pipeline group's communicator and
    a ProcessGroupCollection (embedding groups None: only finalize_model_grads reads them)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid(shape, ["tp", "cp", "pp", "dp"])
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = grid.create_pg("tp")
    pg_collection.cp = grid.create_pg("cp")
    pg_collection.pp = grid.create_pg("pp")
    pg_collection.embd = None
    pg_collection.pos_embd = None
    pg_collection.dp_cp = grid.create_pg(["dp", "cp"])
    return P2PCommunicator(pp_group=pg_collection.pp, config=config), pg_collection


def outcome(call):
    """What a call raised: its class and their bases, its message, where it was raised; None if it returned."""
    from megatron_app.train.cpu_compat import CudaDeviceToCpu

    try:
        with CudaDeviceToCpu():   # Megatron's interleaved schedule allocates on "cuda" before its count checks
            call()
    except Exception as error:  # noqa: BLE001 - the exception is the result
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return {"type": type(error).__name__, "classes": [k.__name__ for k in type(error).__mro__],
                "message": str(error), "raised_in": [os.path.basename(frame.filename), frame.name]}
    return None


class Refusals:
    """Each case made to Megatron's function (the original install() keeps) and to ours, in that order."""

    def __init__(self, originals, ours):
        self.originals, self.ours, self.cases = originals, ours, {}

    def case(self, name, function, **kwargs):
        self.cases[name] = {
            "function": function,
            "megatron": outcome(lambda: self.originals[function](**kwargs)),
            "ours": outcome(lambda: self.ours[function](**kwargs)),
        }


NO_PIPELINING = "forward_backward_no_pipelining"
ONE_CHUNK = "forward_backward_pipelining_without_interleaving"
INTERLEAVED = "forward_backward_pipelining_with_interleaving"


def without_pipelining(report, refusals, entry_points):
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_app.train.init import init_model_parallel

    init_model_parallel(2, 1, 1, "cpu")
    report["selection"]["T=2 P=1"] = get_forward_backward_func() is entry_points[NO_PIPELINING]
    config = ModelParallelConfig(pipeline_model_parallel_size=1)
    model = linear(4, config)
    base = dict(forward_step_func=linear_step, data_iterator=range(0, 100), model=[model], num_microbatches=4,
                seq_length=None, micro_batch_size=None, forward_only=True)
    func = get_forward_backward_func()
    report["calls"]["no pipelining T=2"] = losses(func(**base))
    p2p_communicator, pg_collection = grid_groups([2, 1, 1, 4], config)
    report["calls"]["no pipelining, explicit groups"] = losses(func(**base, pg_collection=pg_collection))
    alone = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
    report["calls"]["no pipelining, p2p_communicator alone (unused)"] = losses(func(**base, p2p_communicator=alone))

    refusals.case("no pipelining: two model chunks", NO_PIPELINING, **{**base, "model": [model, model]})
    refusals.case("no pipelining: two data iterators", NO_PIPELINING,
                  **{**base, "data_iterator": [range(0, 100), range(0, 100)]})
    refusals.case("no pipelining: adjust_tensor_shapes_fn", NO_PIPELINING, **base,
                  adjust_tensor_shapes_fn=lambda recv, send: (recv, send))
    refusals.case("no pipelining: pg_collection without tp", NO_PIPELINING, **base,
                  pg_collection=types.SimpleNamespace(cp=pg_collection.cp))
    parallel_state.destroy_model_parallel()


def one_chunk_pipeline(report, refusals, entry_points):
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from megatron_app.train.init import init_model_parallel

    init_model_parallel(2, 4, 1, "cpu")
    report["selection"]["T=2 P=4"] = get_forward_backward_func() is entry_points[ONE_CHUNK]
    # The unit test's other layouts, by get_forward_backward_func's own arguments (no new parallel_state).
    report["selection"]["P=4 V=2"] = get_forward_backward_func(4, 2) is entry_points[INTERLEAVED]
    report["selection"]["P=2 V=4"] = get_forward_backward_func(2, 4) is entry_points[INTERLEAVED]
    report["selection"]["P=1"] = get_forward_backward_func(1, None) is entry_points[NO_PIPELINING]
    config = pipeline_config()
    config.finalize_model_grads_func = finalize_model_grads
    model = linear(4, config)
    base = dict(forward_step_func=loss_step, data_iterator=None, model=[model], num_microbatches=MBS,
                seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    default = get_forward_backward_func()(**base)
    report["calls"]["1F1B T=2 P=4"] = losses(default, pp_group)
    p2p_communicator, pg_collection = grid_groups([2, 1, 4, 1], config)
    explicit = schedules.forward_backward_pipelining_without_interleaving(
        p2p_communicator=p2p_communicator, pg_collection=pg_collection, **base)
    report["calls"]["1F1B T=2 P=4, explicit groups"] = losses(explicit, pg_collection.pp)
    report["1F1B explicit equals default"] = explicit == default

    refusals.case("1F1B: two model chunks", ONE_CHUNK, **{**base, "model": [model, model]})
    refusals.case("1F1B: two data iterators", ONE_CHUNK, **{**base, "data_iterator": [None, None]})
    refusals.case("1F1B: overlap_p2p_comm", ONE_CHUNK, **{**base, "model": [with_config(model, overlap_p2p_comm=True)]})
    refusals.case("1F1B: p2p_communicator alone", ONE_CHUNK, **base, p2p_communicator=p2p_communicator)
    refusals.case("1F1B: pg_collection alone", ONE_CHUNK, **base, pg_collection=pg_collection)
    refusals.case("1F1B: a communicator without config", ONE_CHUNK, **base, pg_collection=pg_collection,
                  p2p_communicator=types.SimpleNamespace(pp_group=pg_collection.pp))
    # 0.16 asserts the groups (tp missing); from 0.17 anything but a ProcessGroupCollection is a TypeError first.
    refusals.case("1F1B: a pg_collection of another type without tp", ONE_CHUNK, **base,
                  p2p_communicator=p2p_communicator, pg_collection=types.SimpleNamespace(cp=pg_collection.cp))
    refusals.case("1F1B: two model chunks before the groups", ONE_CHUNK, **{**base, "model": [model, model]},
                  p2p_communicator=p2p_communicator)
    parallel_state.destroy_model_parallel()


def interleaved_pipeline(report, refusals, entry_points):
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_app.runtime import current_job
    from megatron_app.train.init import init_model_parallel

    init_model_parallel(1, 4, 2, "cpu")
    report["selection"]["T=1 P=4 V=2"] = get_forward_backward_func() is entry_points[INTERLEAVED]
    func = get_forward_backward_func()
    config = pipeline_config(virtual_pipeline_model_parallel_size=2)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    model = linear(4, config, ModelType.encoder_or_decoder)
    uneven = [linear(4, config, ModelType.encoder_or_decoder, vp_stage=0),
              linear(8, config, ModelType.encoder_or_decoder, vp_stage=1)]
    data = [range(0, 100), range(0, 100)]
    base = dict(forward_step_func=loss_step, data_iterator=data, model=[model, model], num_microbatches=MBS,
                seq_length=SEQ, micro_batch_size=MBS, decoder_seq_length=256, forward_only=True)
    # Megatron's two unit tests: losses, then pytest.raises(RuntimeError) for 7 microbatches (with two data
    # iterators; the uneven one with one), then losses again.
    for name, chunks, iterators in (("interleaved P=4 V=2", [model, model], data),
                                    ("uneven interleaved P=4 V=2", uneven, data[:1])):
        report["calls"][name] = losses(func(**{**base, "model": chunks}), pp_group)
        refusals.case(f"{name}: 7 microbatches, {len(iterators)} data iterator(s)", INTERLEAVED,
                      **{**base, "model": chunks, "data_iterator": iterators, "num_microbatches": 7,
                         "decoder_seq_length": 512})
        report["calls"][name + ", after the refusal"] = losses(
            func(**{**base, "model": chunks, "decoder_seq_length": SEQ}), pp_group)

    p2p_communicator, pg_collection = grid_groups([1, 1, 4, 2], config)
    report["pipeline groups"] = {"parallel_state": dist.get_process_group_ranks(pp_group),
                                 "grid": dist.get_process_group_ranks(pg_collection.pp)}
    report["calls"]["interleaved P=4 V=2, explicit groups"] = losses(
        func(**base, pg_collection=pg_collection, p2p_communicator=p2p_communicator), pg_collection.pp)
    report["calls"]["interleaved P=4 V=2, parallel_state's groups again"] = losses(func(**base), pp_group)
    report["open transports"] = len(current_job().session.transports)

    refusals.case("interleaved: group size above the microbatches", INTERLEAVED,
                  **{**base, "model": [with_config(model, microbatch_group_size_per_vp_stage=9)] * 2})
    refusals.case("interleaved: group size below the pipeline", INTERLEAVED,
                  **{**base, "model": [with_config(model, microbatch_group_size_per_vp_stage=2)] * 2})
    refusals.case("interleaved: fewer microbatches than stages, one chunk", INTERLEAVED,
                  **{**base, "model": [model], "data_iterator": [range(0, 100)], "num_microbatches": 3})
    refusals.case("interleaved: adjust_tensor_shapes_fn", INTERLEAVED, **base,
                  adjust_tensor_shapes_fn=lambda recv, send: (recv, send))
    refusals.case("interleaved: model chunks as a tuple", INTERLEAVED, **{**base, "model": (model, model)})
    refusals.case("interleaved: a chunk that is no Module", INTERLEAVED, **{**base, "model": [model, object()]})
    refusals.case("interleaved: one data iterator, not a list", INTERLEAVED, **{**base, "data_iterator": data[0]})
    refusals.case("interleaved: overlap_p2p_comm with batch_p2p_comm", INTERLEAVED,
                  **{**base, "model": [with_config(model, overlap_p2p_comm=True, batch_p2p_comm=True)] * 2})
    refusals.case("interleaved: p2p_communicator alone", INTERLEAVED, **base, p2p_communicator=p2p_communicator)
    refusals.case("interleaved: pg_collection alone", INTERLEAVED, **base, pg_collection=pg_collection)
    refusals.case("interleaved: groups before adjust_tensor_shapes_fn", INTERLEAVED, **base,
                  p2p_communicator=p2p_communicator, adjust_tensor_shapes_fn=lambda recv, send: (recv, send))
    refusals.case("interleaved: adjust_tensor_shapes_fn before the counts", INTERLEAVED,
                  **{**base, "num_microbatches": 7}, adjust_tensor_shapes_fn=lambda recv, send: (recv, send))
    refusals.case("interleaved: pg_collection without tp", INTERLEAVED, **base, p2p_communicator=p2p_communicator,
                  pg_collection=types.SimpleNamespace(cp=pg_collection.cp))
    # 0.16 asserts embd first (AssertionError); from 0.17 only tp and cp are asked for, and the count refuses.
    without_embd = types.SimpleNamespace(**{name: getattr(pg_collection, name)
                                            for name in ("tp", "cp", "pp", "pos_embd", "dp_cp")})
    refusals.case("interleaved: pg_collection without embd, 7 microbatches", INTERLEAVED,
                  **{**base, "num_microbatches": 7}, p2p_communicator=p2p_communicator, pg_collection=without_embd)
    parallel_state.destroy_model_parallel()


def main():
    from megatron.core.pipeline_parallel import schedules

    import megatron_app
    from megatron_app.megatron_compat import megatron_core_version
    from megatron_app.train.init import init_distributed

    init_distributed("cpu")
    names = (NO_PIPELINING, ONE_CHUNK, INTERLEAVED)
    originals = {name: getattr(schedules, name) for name in names}
    megatron_app.install(timeout_s=120)
    ours = {name: getattr(schedules, name) for name in names}   # what Megatron's module holds after install()
    report = {"megatron_core": str(megatron_core_version()), "selection": {}, "calls": {},
              "installed": all(ours[name] is not originals[name] for name in names)}
    refusals = Refusals(originals, ours)
    for phase in (without_pipelining, one_chunk_pipeline, interleaved_pipeline):
        phase(report, refusals, ours)
    report["refusals"] = refusals.cases
    megatron_app.runtime.shutdown()
    megatron_app.uninstall()
    with open(os.path.join(out_dir, f"schedule_tests_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
