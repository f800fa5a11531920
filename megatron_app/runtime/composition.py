"""agree_iteration_plan: the plan of the next forward_backward call, decided on one rank and the same on every rank.

A collective of the whole job (every rank of every tensor-, data-, context- and pipeline-parallel group calls it at the
same point, before the forward_backward call it plans, with the same global batch). The job's first rank runs
schedule/iteration_plan.plan_iteration with the costs its `planned` policy has learnt (the prior before any call),
within the planning budget, and broadcasts the IterationPlan; nothing another rank computes for itself enters it, so
no clock or learnt cost can make ranks disagree. With data parallelism under `balanced`, every rank's last pipeline
time (measured before the data-parallel reduction) goes to that rank first, which learns each replica's speed from
it (iteration_plan.ReplicaSpeeds) and gives a slower replica proportionally less work. This rank's replica's share
(next_call.CallPlan: tokens, squared tokens, the order and warm-ups, the documents' layout, the prediction) goes to
the forward_backward call it plans with that call's data (decide_iteration_plan, then next_call.with_call_plan: the
trainer, wrap_data_iterator), or waits on the job for the next call (agree_iteration_plan, for a loop passing
iterators of its own); that call must run the replica's microbatch count.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_app.schedule.composition import BALANCED, PLANNED_COMPOSITIONS
from megatron_app.schedule.planned import DEFAULT_MEMORY_FACTOR
from megatron_app.schedule.iteration_plan import (IterationPlan, PipelineSpec, PlanRequest, PredictionError,
                                                  ReplicaSpeeds, plan_iteration)

from .decide_once import decide_once
from .job import AppJob, current_job
from .layout import JobLayout, job_layout  # noqa: F401 (JobLayout: the layout's type, read by tests)
from .next_call import CallPlan
from .plan_ahead import PlanAhead


def _gather_measurements(session, layout: JobLayout):
    """On the job's first rank: replica -> (its last plan's nominal prediction, its slowest rank's pipeline time),
    from every rank's last training call not yet reported (None elsewhere): a measurement is learnt from once, also
    when an evaluation plans between two training calls. The task durations every other rank measured since its
    last report join the first rank's cost model (each under its pipeline rank: the stages differ), and the most
    microbatches any rank's training call ran its session.microbatches_run."""
    costs = session.shared_costs()
    mine = (layout.dp_rank, session.last_pipeline, costs.take_unreported(), session.microbatches_run)
    session.last_pipeline = None
    if not layout.distributed or dist.get_world_size() == 1:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    for _, _, samples, _ in gathered[1:]:     # the first rank's own are in its model already
        costs.observe_reported(samples)
    session.microbatches_run = max(run for *_, run in gathered)
    times = {}
    for replica, last, _, _ in gathered:
        if last is None:
            continue
        predicted, seconds = last
        previous = times.get(replica)
        times[replica] = (predicted, seconds if previous is None else max(previous[1], seconds))
    return times


def agree_iteration_plan(lengths: Sequence[int], micro_batch_size: int, composition: str, *, pg_collection=None,
                         job: Optional[AppJob] = None, **options) -> IterationPlan:
    """decide_iteration_plan (``options``: its keyword arguments), for a loop that passes forward_backward iterators
    of its own: this rank's replica's share waits on the job for its next forward_backward call, and its documents'
    layout goes to keyed dropout. (The trainer and wrap_data_iterator hand the share to the call with its data
    instead: next_call.with_call_plan.)"""
    job = job or current_job()
    plan = decide_iteration_plan(lengths, micro_batch_size, composition, pg_collection=pg_collection, job=job,
                                 **options)
    call = CallPlan.of_replica(plan, job_layout(pg_collection).dp_rank)
    job.next_call.expect(call)
    if job.keyed_randomness is not None and call.document_segments is not None:
        job.keyed_randomness.set_microbatch_documents(call.document_segments)
    return plan


def decide_iteration_plan(lengths: Sequence[int], micro_batch_size: int, composition: str, *,
                          document_ids: Optional[Sequence[int]] = None, token_budget: Optional[int] = None,
                          pg_collection=None, job: Optional[AppJob] = None,
                          next_lengths: Optional[Sequence[int]] = None,
                          next_document_ids: Optional[Sequence[int]] = None,
                          microbatch_group_size: Optional[int] = None,
                          groups: Optional[Sequence[Sequence[int]]] = None) -> IterationPlan:
    """The next call's IterationPlan for the whole global batch (``lengths``: every document, loader order), the
    same on every rank. The caller hands this rank's replica's share (CallPlan.of_replica) to the call it plans.

    next_lengths (and next_document_ids): the global batch of the call after, known early (an index): `balanced`
    then plans it in a worker process while this call trains (plan_ahead.py) and the next call adopts that plan
    when it is ready, planning in line when it is late. Planning time on the critical path is then about nil.

    microbatch_group_size: the model config's microbatch_group_size_per_vp_stage (None: Megatron's default, P); with
    several chunks it bounds the microbatch counts the call accepts, so the plan chooses among those.

    groups: with composition `packed` and one replica, the microbatches themselves (positions in ``lengths``), as
    the trainer's --synthetic-microbatches gives them; the planned policy still orders and predicts them."""
    job = job or current_job()
    session = job.session
    layout = job_layout(pg_collection)
    pipeline = PipelineSpec(layout.num_stages, layout.num_chunks, split_backward=session.settings.split_backward,
                            microbatch_group_size=microbatch_group_size,
                            memory_factor=session.settings.memory_factor or DEFAULT_MEMORY_FACTOR)
    request = PlanRequest(tuple(int(v) for v in lengths), composition, micro_batch_size, pipeline,
                          num_replicas=layout.num_replicas,
                          document_ids=None if document_ids is None else tuple(int(i) for i in document_ids),
                          token_budget=token_budget,
                          groups=None if groups is None else tuple(tuple(int(p) for p in g) for g in groups))
    request.check()     # on every rank: a bad request fails where it is made, not in a broadcast
    plans_order = session.plans_calls
    measured = (_gather_measurements(session, layout) if composition in PLANNED_COMPOSITIONS or plans_order
                else None)

    ahead = composition in PLANNED_COMPOSITIONS and next_lengths is not None

    def decide(start: float) -> IterationPlan:
        speeds, min_gain = None, 0.0
        if measured:
            if session.replica_speeds is None or session.replica_speeds.num_replicas != layout.num_replicas:
                session.replica_speeds = ReplicaSpeeds(layout.num_replicas)
                session.prediction_error = PredictionError()
            for replica, (predicted, seconds) in sorted(measured.items()):
                session.replica_speeds.observe(replica, predicted, seconds)
            # the slowest replica's time is the iteration's: that is what the plan's prediction must get right
            predicted = max((p for p, _ in measured.values() if p is not None), default=None)
            slowest = max(s for _, s in measured.values())
            session.prediction_error.observe(predicted, slowest)
            session.observe_outside_pipeline(start, slowest)
            if composition == BALANCED and session.settings.replica_speeds:
                speeds = session.replica_speeds.speeds()
            min_gain = session.prediction_error.relative
        planned = None if session.plan_ahead is None else session.plan_ahead.take(request)
        if planned is not None:
            plan = replace(planned[0], planned_ahead=True, planner_s=planned[1])
        else:
            plan = plan_iteration(replace(request, replica_speeds=speeds, min_gain=min_gain, plan_order=plans_order,
                                          microbatches_run=session.microbatches_run),
                                  session.shared_costs(), stop=session.planning_stop(start))
            plan = replace(plan, planner_s=time.perf_counter() - start)
        if ahead:
            if session.plan_ahead is None:
                session.plan_ahead = PlanAhead()
            upcoming = replace(request, lengths=tuple(int(v) for v in next_lengths), replica_speeds=speeds,
                               min_gain=min_gain, microbatches_run=session.microbatches_run,
                               document_ids=None if next_document_ids is None
                               else tuple(int(i) for i in next_document_ids))
            session.plan_ahead.submit(upcoming, session.shared_costs())
        planning_s = time.perf_counter() - start      # what the call waited for, every rank told
        outside = session.outside_pipeline_s
        return replace(plan, planning_s=planning_s, outside_pipeline_s=None if outside is None else outside + planning_s)

    plan, seconds = decide_once(decide, layout.distributed)
    if seconds:
        session.last_planning_s = seconds
    return plan
