"""One rank (of 2, P=2) calling forward_backward_app the way Megatron-LM's training.py does, for V=1 and V=2.

Each call passes exactly the keyword set of one call site: train_step and evaluate in megatron/training/training.py
of megatron-core 0.16.1 and of 0.19 (the names are listed below, the values are ours). Also records the contract
rules: both-or-neither for p2p_communicator/pg_collection, adjust_tensor_shapes_fn, multi-module collections,
checkpoint_activations_microbatch. Writes contract_rank<R>.json into argv[1].
"""

import json
import os
import sys

import torch

# The keywords of each forward_backward_func(...) call in megatron/training/training.py.
CALL_SITES = {
    "0.16 train_step": ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                        "micro_batch_size", "decoder_seq_length", "forward_only", "adjust_tensor_shapes_fn",
                        "force_all_reduce"),
    "0.16 evaluate": ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                      "micro_batch_size", "decoder_seq_length", "forward_only"),
    "0.19 train_step": ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                        "micro_batch_size", "decoder_seq_length", "forward_only", "adjust_tensor_shapes_fn",
                        "force_all_reduce", "p2p_communicator", "pg_collection"),
    "0.19 evaluate": ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                      "micro_batch_size", "decoder_seq_length", "forward_only", "adjust_tensor_shapes_fn",
                      "pg_collection", "p2p_communicator"),
}
PARTIAL_CHECKPOINTS = 1

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])


def layout_flags(V):
    return ["--pipeline_parallel", "2", "--model_chunks", str(V), "--iters", "12", "--no-trace", "--schedule", "app",
            "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "4"]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, f"not one line: {text!r}"
    return f"{type(exc).__name__}: {text}"


def run_layout(V, report):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_app.train.args import parse_args
    from megatron_app.train.init import init_model_parallel
    from megatron_app.train.loop import build_trainer
    from megatron_app.train.step import forward_step

    init_model_parallel(1, 2, V, "cpu")
    args = parse_args(layout_flags(V))
    trainer = build_trainer(args)
    config = trainer.chunks[0].config
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    p2p_communicator = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
    shape_calls = []

    def adjust_tensor_shapes_fn(recv_shapes, send_shapes):
        shape_calls.append([list(map(list, recv_shapes)), list(map(list, send_shapes))])
        return recv_shapes, send_shapes

    values = {
        "forward_step_func": forward_step, "data_iterator": trainer.data_iterator, "model": trainer.chunks,
        "num_microbatches": args.num_microbatches, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "decoder_seq_length": None, "force_all_reduce": False,
        "adjust_tensor_shapes_fn": None, "p2p_communicator": p2p_communicator, "pg_collection": pg_collection,
    }
    func = get_forward_backward_func()
    results = {}
    for site, names in CALL_SITES.items():
        trainer.optimizer.zero_grad(set_to_none=True)
        forward_only = site.endswith("evaluate")
        kwargs = {name: values[name] for name in names if name != "forward_only"}
        kwargs["forward_only"] = forward_only
        losses = func(**kwargs)
        grads = sum(p.grad is not None for c in trainer.chunks for p in c.parameters())
        results[site] = {"losses": len(losses), "params_with_grad": grads}
    report[f"V{V}"] = results

    rules = {}
    for name, kwargs in (("only p2p_communicator", {"p2p_communicator": p2p_communicator}),
                         ("only pg_collection", {"pg_collection": pg_collection})):
        try:
            func(**{**{k: values[k] for k in CALL_SITES["0.16 evaluate"] if k != "forward_only"},
                    "forward_only": True, **kwargs})
            rules[name] = "accepted"
        except ValueError as exc:
            rules[name] = one_line(exc)
    try:
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:
        rules["multi-module"] = "not in this megatron-core"
    else:
        multi = MultiModuleProcessGroupCollection(module_pgs={"llm": pg_collection}, language_model_module_name="llm")
        try:
            func(**{**{k: values[k] for k in CALL_SITES["0.16 evaluate"] if k != "forward_only"},
                    "forward_only": True, "pg_collection": multi, "p2p_communicator": p2p_communicator})
            rules["multi-module"] = "accepted"
        except ValueError as exc:
            rules["multi-module"] = one_line(exc)
    try:
        func(**{**{k: values[k] for k in CALL_SITES["0.16 evaluate"] if k != "forward_only"}, "forward_only": True,
                "adjust_tensor_shapes_fn": adjust_tensor_shapes_fn})
        rules["adjust_tensor_shapes_fn"] = {"accepted": True, "calls": shape_calls}
    except ValueError as exc:
        rules["adjust_tensor_shapes_fn"] = {"accepted": False, "error": one_line(exc)}

    # checkpoint_activations_microbatch as the forward step sees it, per (chunk, microbatch)
    seen = {}

    def forward_step_with_checkpoint_flag(data_iterator, model, checkpoint_activations_microbatch):
        from megatron.core.utils import get_attr_wrapped_model

        chunk = get_attr_wrapped_model(model, "vp_stage") or 0
        microbatch = get_attr_wrapped_model(model, "decoder").layers[0].current_microbatch  # set by forward_step
        seen[f"{chunk}:{microbatch}"] = checkpoint_activations_microbatch
        return forward_step(data_iterator, model)

    config.num_microbatches_with_partial_activation_checkpoints = PARTIAL_CHECKPOINTS
    trainer.optimizer.zero_grad(set_to_none=True)
    func(**{**{k: values[k] for k in CALL_SITES["0.16 train_step"] if k != "forward_only"}, "forward_only": False,
            "forward_step_func": forward_step_with_checkpoint_flag})
    config.num_microbatches_with_partial_activation_checkpoints = None
    rules["checkpoint_activations_microbatch"] = seen
    report[f"V{V} rules"] = rules
    parallel_state.destroy_model_parallel()


def main():
    import megatron_app
    from megatron_app.megatron_compat import megatron_core_version
    from megatron_app.runtime import shutdown as runtime_shutdown
    from megatron_app.train.init import init_distributed, shutdown

    init_distributed("cpu")
    megatron_app.install(schedule="app", policy="dfc", timeout_s=60)
    report = {"megatron_core": str(megatron_core_version())}
    with torch.random.fork_rng():
        for V in (1, 2):
            run_layout(V, report)
            runtime_shutdown()
    with open(os.path.join(out_dir, f"contract_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    megatron_app.uninstall()
    shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
