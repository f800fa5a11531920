"""The trainer's side of --emulate-compute / --link-delay: emulated chunks built from its flags, its loss function,
and the link delays put around the runtime's transport (megatron_app.emulation does the emulating).

Composed microbatches (--emulate-lengths-file with --documents-per-microbatch K > 1 or --composition other than
loader): each iteration draws D x m x K documents from the lengths file with --seed as megatron_app.sim's composition rows
do (sim/composition.py), the runtime's agree_iteration_plan groups them (the global batch: D replicas' draws), the iteration runs that many microbatches, and
each task waits the simulator's cost of its microbatch's composition (sim.lengths.composed_cost_factor), with
activations of its tokens (one row packed, K rows of the longest document padded).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core import parallel_state

from megatron_app.devices import local_device
from megatron_app.emulation import EmulationSpec, SlowLink, TaskDurations, spec_from_args
from megatron_app.emulation.compute import EmulatedChunk, emulated_forward_step, emulated_microbatches
from megatron_app.emulation.link_delay import LinkDelay
from megatron_app.runtime import add_transport_wrapper, remove_transport_wrapper
from megatron_app.runtime.job import current_session
from megatron_app.runtime.layout import pipeline_group
from megatron_app.runtime.keyed_randomness import set_microbatch_documents
from megatron_app.runtime.next_call import CallPlan
from megatron_app.schedule import PipelineShape
from megatron_app.schedule.composition import LOADER
from megatron_app.schedule.iteration_plan import IterationPlan
from megatron_app.trace.model_shape import model_shape

from .flags import completed
from .forward_backward import with_call, with_told_lengths
from .step import loss_func


class ComputeEmulation:
    """What the trainer swaps in when emulating: chunks, data, forward_step, and the per-iteration hooks."""

    def __init__(self, args, spec: EmulationSpec, link_delays: Sequence[SlowLink] = ()):
        self.args = args = completed(args)
        self.spec = spec
        self.shape = PipelineShape(args.pipeline_parallel, args.model_chunks, args.num_microbatches,
                                   split_backward=bool(args.split_backward))
        slow = args.slow_replica == parallel_state.get_data_parallel_rank()
        self.durations = TaskDurations(spec, self.shape, factor=args.slow_factor if slow else 1.0)
        self.link_delay = LinkDelay(link_delays) if link_delays else None
        self.forward_step = self.trainer_forward_step
        self.documents_per_microbatch = int(args.documents_per_microbatch or 1)
        self.composition_name = args.composition
        self.composing = spec.lengths is not None and (self.documents_per_microbatch > 1
                                                      or self.composition_name != LOADER)
        self.planning_s: Dict[int, float] = {}
        self.plans: Dict[int, IterationPlan] = {}     # iteration (0-based) -> its plan; the current one only

    @staticmethod
    def trainer_forward_step(data_iterator, model: EmulatedChunk):
        """forward_step_func for emulated chunks, with the trainer's loss function."""
        return emulated_forward_step(data_iterator, model, loss_func)

    @classmethod
    def from_args(cls, args) -> Optional["ComputeEmulation"]:
        """None unless --emulate-compute was given (flags were validated by args.py)."""
        spec = spec_from_args(args)
        if spec is None:
            return None
        return cls(args, spec, [SlowLink.parse_delay(text) for text in completed(args).link_delay or ()])

    def build_chunks(self) -> List[EmulatedChunk]:
        from .model import build_transformer_config   # the config GPT chunks would get: same Megatron fields

        args = self.args
        config = build_transformer_config(args)
        if self.spec.cost_curves is not None and dist.get_rank() == 0:   # the same line on every rank: one says it
            self.spec.cost_curves.warn_model(model_shape(config, args.vocab_size))
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        chunks = []
        for chunk in range(args.model_chunks):
            vp_stage = chunk if args.model_chunks > 1 else None
            chunks.append(EmulatedChunk(
                config, self.durations, pp_rank, chunk,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage, vocab_size=args.vocab_size).to(local_device(args.device)))
        return chunks

    def data_iterators(self):
        """One iterator per chunk (every emulated chunk draws an item per microbatch)."""
        args = self.args
        iterators = [emulated_microbatches(args.num_microbatches, args.micro_batch_size, args.seq_length,
                                           args.vocab_size, args.iters, self.microbatch_lengths,
                                           self.microbatch_layouts if self.composing else None)
                     for _ in range(args.model_chunks)]
        return iterators[0] if args.model_chunks == 1 else iterators

    def microbatch_lengths(self, iteration: int):
        """Sequence length of each microbatch of `iteration` (0-based) under --emulate-lengths-file, else None."""
        return self.spec.microbatch_lengths(self.shape, iteration)

    def microbatch_layouts(self, iteration: int) -> List[Tuple[int, int]]:
        """(rows, sequence length) of each composed microbatch of `iteration`: one row of its documents packed, or
        one row per document padded to the longest."""
        plan, dp_rank = self.plans[iteration], parallel_state.get_data_parallel_rank()
        documents, composition = plan.replica_lengths(dp_rank), plan.replica(dp_rank).composition
        if composition.packed:
            return [(1, tokens) for tokens in composition.microbatch_tokens(documents)]
        return [(len(group), max(documents[p] for p in group)) for group in composition.groups]

    def compose(self, iteration: int) -> Tuple[int, CallPlan]:
        """Draw `iteration`'s global batch, plan it (a collective of the job), and set each task's
        wait from it; returns its microbatch count and this replica's share of the plan."""
        from megatron_app.runtime.composition import decide_iteration_plan
        from megatron_app.sim.composition import dp_balanced_token_budget

        K, lengths = self.documents_per_microbatch, self.spec.lengths
        replicas = parallel_state.get_data_parallel_world_size()
        batch = lengths.draw(self.args.num_microbatches * K * replicas, self.spec.seed, iteration)
        upcoming = None
        if getattr(self.args, "plan_ahead", False) and iteration + 1 < self.args.iters:
            upcoming = lengths.draw(self.args.num_microbatches * K * replicas, self.spec.seed, iteration + 1)
        began = time.perf_counter()
        plan = decide_iteration_plan(batch, K, self.composition_name,
                                     token_budget=dp_balanced_token_budget(lengths, K), next_lengths=upcoming)
        self.planning_s[iteration] = time.perf_counter() - began   # planning + broadcast, as this rank waits for it
        dp_rank = parallel_state.get_data_parallel_rank()
        self.plans = {iteration: plan}
        self.durations.compose(iteration, plan.microbatch_tokens(dp_rank), plan.microbatch_squared_tokens(dp_rank))
        set_microbatch_documents(plan.document_segments(dp_rank))   # keyed dropout, as the trainer's data side does
        return plan.replica(dp_rank).num_microbatches, CallPlan.of_replica(plan, dp_rank)

    def composition_report(self, iteration: int) -> Optional[dict]:
        """What `iteration` ran, for the log: microbatch count, tokens each, padding tokens, planning time (None when
        not composing)."""
        if iteration not in self.plans:
            return None
        return {**self.plans[iteration].report(parallel_state.get_data_parallel_rank()),
                "wait_for_plan_ms": self.planning_s.pop(iteration, 0.0) * 1e3}

    def begin_iteration(self, iteration: int, data_iterator):
        """Before forward_backward of `iteration` (0-based): the microbatch lengths (every rank draws the same ones;
        composed: plan them), carried to the call by its data iterator, and the link-delay windows restarted.
        Returns the call's microbatch count and the data iterator to pass it."""
        if self.composing:
            num_microbatches, call = self.compose(iteration)
            data_iterator = with_call(self.args.schedule, data_iterator, call)
        else:
            num_microbatches = self.args.num_microbatches
            data_iterator = with_told_lengths(self.args.schedule, data_iterator, self.microbatch_lengths(iteration))
        if self.link_delay is None:
            return num_microbatches, data_iterator
        if self.link_delay.transport is None:
            # Open the runtime's transport now (a collective: every rank is here together), so the first window
            # starts after it; the loss layer, registered earlier, stays the inner wrapper.
            add_transport_wrapper(self.link_delay.wrap)
            current_session().ensure_transport(dist.get_process_group_ranks(pipeline_group()))
        self.link_delay.begin_iteration()
        return num_microbatches, data_iterator

    def end_iteration(self) -> None:
        """Every rank ends an iteration together, as under Megatron's grad-norm all-reduce and in the simulator."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def close(self) -> None:
        if self.link_delay is not None:
            remove_transport_wrapper(self.link_delay.wrap)
            self.link_delay.close()
            self.link_delay = None
