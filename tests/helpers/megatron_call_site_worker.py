"""One rank of a Megatron-style training step that goes through megatron_app.install().

Imports get_forward_backward_func the way Megatron-LM's training.py does (before install runs), then trains with
whatever that call site returns. Modes (argv[1]):
  train      install, check the call site now returns ours, run train + eval steps, uninstall, check restored
  idle       rank 0 sleeps before its first forward of the 3rd step; rank 1 reports CPU used while it waits
  die        rank 1 exits abruptly inside step 2; rank 0 must fail with an error naming rank 1
"""

import json
import os
import sys
import time

from megatron.core.pipeline_parallel import get_forward_backward_func  # Megatron-LM's call site, pre-install

import megatron_app
from megatron_app.train.args import parse_args
from megatron_app.train.init import init_distributed, init_model_parallel, shutdown
from megatron_app.train.loop import build_trainer
from megatron_app.train.step import forward_step

mode, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
IDLE_S = 2.0


def run_step(trainer, forward_step_func, forward_only=False):
    args = trainer.args
    trainer.optimizer.zero_grad(set_to_none=True)
    forward_backward_func = get_forward_backward_func()
    return forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=trainer.data_iterator, model=trainer.chunks,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=forward_only)


def write(name, payload):
    with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(payload, f)


def main():
    from megatron.core.pipeline_parallel import schedules
    from megatron_app.runtime import MEGATRON_ENTRY_POINTS

    originals = (schedules.forward_backward_no_pipelining, schedules.forward_backward_pipelining_without_interleaving,
                 schedules.forward_backward_pipelining_with_interleaving)
    args = parse_args(["--pipeline_parallel", "2", "--iters", "4", "--no-trace", "--schedule", "app"])
    init_distributed("cpu")
    init_model_parallel(1, 2, 1, "cpu")
    megatron_app.install(schedule="app", policy="dfc", timeout_s=60)
    report = {"ours_after_install": get_forward_backward_func() is MEGATRON_ENTRY_POINTS[
        "forward_backward_pipelining_without_interleaving"]}
    trainer = build_trainer(args)

    if mode == "train":
        losses = run_step(trainer, forward_step)
        trainer.optimizer.step()
        evaluation = run_step(trainer, forward_step, forward_only=True)
        report["train_losses"] = len(losses)
        report["eval_losses"] = len(evaluation)
        report["grads_after_eval"] = any(p.grad is not None for c in trainer.chunks for p in c.parameters())
        megatron_app.uninstall()
        report["restored"] = (schedules.forward_backward_no_pipelining,
                              schedules.forward_backward_pipelining_without_interleaving,
                              schedules.forward_backward_pipelining_with_interleaving) == originals
        report["megatron_after_uninstall"] = get_forward_backward_func() is originals[1]
        write("train", report)
    elif mode == "idle":
        cpu_times = []
        for step in range(3):
            delayed = step == 2

            def slow_forward_step(data_iterator, model, delayed=delayed):
                if delayed and rank == 0 and not slow_forward_step.slept:
                    slow_forward_step.slept = True
                    time.sleep(IDLE_S)
                return forward_step(data_iterator, model)

            slow_forward_step.slept = False
            cpu0, wall0 = time.process_time(), time.monotonic()
            run_step(trainer, slow_forward_step)
            cpu_times.append((time.process_time() - cpu0, time.monotonic() - wall0))
        write("idle", {"cpu_wall": cpu_times, "idle_s": IDLE_S})
    elif mode == "die":
        def dying_forward_step(data_iterator, model):
            dying_forward_step.calls += 1
            if rank == 1 and dying_forward_step.calls == 10:   # inside the second step
                os._exit(3)
            return forward_step(data_iterator, model)

        dying_forward_step.calls = 0
        for _ in range(3):
            run_step(trainer, dying_forward_step)
    megatron_app.runtime.shutdown()
    shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
