"""One rank of an equality run: train a few iterations under each schedule in turn, in one process group.

Launched by tests/test_pipeline_equality.py through torchrun. For every schedule it rebuilds the model (same seed,
so the same initial weights), trains --iters iterations, dumps the first iteration's gradients by global parameter
name and, on the rank that reports losses, writes the per-iteration losses.
"""

import argparse
import json
import os
import shlex
import sys

import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline_parallel", type=int, required=True)
    parser.add_argument("--model_chunks", type=int, default=1)
    parser.add_argument("--tensor_parallel", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--schedules", required=True, help="comma list of SCHEDULE[:POLICY]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--dropout", type=float, default=0.0, help="--hidden-dropout and --attention-dropout")
    parser.add_argument("--extra", default="", help="more trainer flags for every schedule, one string")
    parser.add_argument("--tell-lengths", action="store_true",
                        help="before each step, tell the schedule uneven microbatch lengths (a planning policy then "
                             "reorders the microbatches: the losses must not change)")
    parser.add_argument("--compositions", default="",
                        help="comma list: run every schedule once per composition (--variable-seq-lengths): loader, "
                             "packed, or regrouped / regrouped-padded (this test's own grouping, injected through "
                             "composed_data.plan_global_batch); outputs are named SCHEDULE_COMPOSITION")
    parser.add_argument("--precision-report", action="store_true",
                        help="after each run write precision_NAME_rankR.json: the dtypes of the model's parameters, "
                             "their main_grad, the optimizer's main parameters and its state; the loss scale and the "
                             "skipped iterations")
    opts = parser.parse_args()

    from megatron_app.train.args import parse_args
    from megatron_app.train.forward_backward import close_schedule
    from megatron_app.train.init import init_distributed, init_model_parallel, shutdown
    from megatron_app.train.loop import build_trainer, train_step

    init_distributed("cpu")
    init_model_parallel(opts.tensor_parallel, opts.pipeline_parallel, opts.model_chunks, "cpu")
    runs = [(spec, composition) for spec in opts.schedules.split(",") for composition in opts.compositions.split(",")]
    for spec, composition in runs:
        schedule, _, policy = spec.partition(":")
        name = spec.replace(":", "-") + (f"_{composition}" if composition else "")
        file_flags = []
        if schedule.startswith("file="):      # file=PATH: that schedule file's action lists
            file_flags, schedule, name = ["--schedule-file", schedule[len("file="):]], "app", "file"
        flags = ["--pipeline_parallel", str(opts.pipeline_parallel), "--model_chunks", str(opts.model_chunks),
                 "--tensor_parallel", str(opts.tensor_parallel), "--iters", str(opts.iters),
                 "--schedule", schedule, *(["--policy", policy or "dfc"] if schedule == "app" and not file_flags
                                           else []), *file_flags,
                 "--dump-grads", os.path.join(opts.out, f"grads_{name}")]
        flags += ["--trace-dir", opts.trace_dir] if opts.trace_dir else ["--no-trace"]
        flags += ["--hidden-dropout", str(opts.dropout), "--attention-dropout", str(opts.dropout)]
        flags += shlex.split(opts.extra)
        flags += ["--composition", "loader" if composition.startswith("regrouped") else composition] if composition \
            else []
        args = parse_args(flags)
        if composition.startswith("regrouped"):
            import megatron_app.train.composed_data as composed_data

            composed_data.plan_global_batch = regrouped_composition(packed=composition == "regrouped")
        trainer = build_trainer(args)
        losses, steps = [], []
        if opts.tell_lengths:
            # This test's uneven lengths must be the ones used (the trainer tells none for packed data; make sure).
            import megatron_app.train.loop as train_loop

            train_loop.with_told_lengths = lambda schedule, data_iterator, lengths: data_iterator
        for it in range(1, opts.iters + 1):
            if opts.tell_lengths and schedule == "app":
                from megatron_app.runtime import set_microbatch_lengths

                m = args.num_microbatches
                set_microbatch_lengths([1 + (37 * (i + it) ** 2) % 97 for i in range(m)])
            losses.append(train_step(trainer, it))
            steps.append({"lr": trainer.last_lr, **trainer.optimizer.report()})
            if trainer.last_plan is not None and dist.get_rank() == 0:
                with open(os.path.join(opts.out, f"plans_{name}.jsonl"), "a") as f:
                    f.write(json.dumps(trainer.last_plan.report(0)) + "\n")
            if opts.tell_lengths and schedule == "app":
                from megatron_app.runtime.job import current_session

                orders = [list(p.current_plan.start_order) for p in current_session().policies_in_use()
                          if hasattr(p, "current_plan")]
                with open(os.path.join(opts.out, f"plans_{name}_rank{dist.get_rank()}.jsonl"), "a") as f:
                    f.write(json.dumps(orders) + "\n")
        if opts.precision_report:
            with open(os.path.join(opts.out, f"precision_{name}_rank{dist.get_rank()}.json"), "w") as f:
                json.dump(precision_report(trainer), f)
        if losses[0] is not None and trainer.reporter.enabled:
            with open(os.path.join(opts.out, f"losses_{name}.json"), "w") as f:
                json.dump(losses, f)
            with open(os.path.join(opts.out, f"steps_{name}.json"), "w") as f:   # each step's lr, grad norm
                json.dump(steps, f)
        dist.barrier()
    close_schedule(schedule)
    shutdown(destroy_process_group=True)


def precision_report(trainer) -> dict:
    """The set of dtypes of each kind of tensor that mixed precision keeps (strings, e.g. ["torch.bfloat16"])."""
    optimizer = trainer.optimizer
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    state = [value for per_param in optimizer.optimizer.state.values() for key, value in per_param.items()
             if key in ("exp_avg", "exp_avg_sq")] if hasattr(optimizer, "main_params") else []
    kinds = {"model_params": params, "main_grads": [getattr(p, "main_grad", None) for p in params],
             "main_params": getattr(optimizer, "main_params", []), "optimizer_state": state}
    report = {kind: sorted({str(t.dtype) if t is not None else "None" for t in tensors}) for kind, tensors in
              kinds.items()} | {"count": {kind: len(tensors) for kind, tensors in kinds.items()}}
    return report | (optimizer.report() if hasattr(optimizer, "report") else {})


def regrouped_composition(packed: bool):
    """Not the loader's groups: documents in a strided order, in fewer microbatches of uneven sizes (1 to 4
    documents), their count still a multiple of P (Megatron's interleaving rule, schedule/shape.py)."""
    import math

    from megatron_app.schedule.composition import Composition
    from megatron_app.schedule.iteration_plan import IterationPlan, ReplicaPlan

    def plan(args, lengths, samples, upcoming=None, groups=None):
        n, P = len(lengths), args.pipeline_parallel
        stride = next(s for s in range(5, n + 5) if math.gcd(s, n) == 1)
        order = [(stride * i + 3) % n for i in range(n)]
        m = P * max(1, n // (2 * P) - 1)
        sizes = [1] * m
        for j in range(n - m):
            sizes[(7 * j) % m] += 1
        groups, start = [], 0
        for size in sizes:
            groups.append(tuple(order[start:start + size]))
            start += size
        composition = Composition(tuple(groups), packed)
        assert composition.groups != tuple(tuple(range(k, k + args.micro_batch_size))
                                           for k in range(0, n, args.micro_batch_size))
        plan = IterationPlan("regrouped", tuple(lengths), tuple(samples),
                             (ReplicaPlan(tuple(range(n)), composition),))
        plan.check()
        return plan     # compose_global_batch hands the call its share with the data

    return plan


if __name__ == "__main__":
    sys.exit(main())
