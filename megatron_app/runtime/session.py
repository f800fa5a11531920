"""A job's open runtime session: the transports, the tracer, the policies, the learnt costs and the call counters.

Opened by the job (job.py) on its first forward_backward call (every rank makes that call at the same time, so the
collectives here — agreeing on a job id, measuring the clock offset — are safe), closed by shutdown() or at exit.
Each call is served on its own pipeline group: one transport per group, keyed by the group's ranks, opened the
first time a call uses the group (all its members make that call) and closed with the session.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import socket
import statistics
import time
import uuid
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_app.megatron_compat import megatron_core_version
from megatron_app.say import say

from .decide_once import decide_once
from .layout import data_parallel_rank, pipeline_ranks
from .settings import AppConfigError, AppSettings

if TYPE_CHECKING:   # the annotation's name only: the transport package loads the compiled core
    from megatron_app.transport.protocol import PipelineTransport

_JOB_ID_ENV = "MEGATRON_APP_JOB_ID"

# wrapper(transport, pipeline global ranks) -> transport: how layers above the runtime (the loss layer, link-delay
# emulation) put themselves around the transport the session opens, applied in the order they were added.
TransportWrapperFactory = Callable[["PipelineTransport", List[int]], "PipelineTransport"]

MAX_JOB_ID_CHARS = 63   # what every backend's wire format and shared-memory name take


def agree_on_job_id(requested: Optional[str]) -> str:
    """One job id for all ranks: the setting, else $MEGATRON_APP_JOB_ID, else rank 0's random pick."""
    job_id = requested or os.environ.get(_JOB_ID_ENV)
    if job_id:
        return re.sub(r"[^A-Za-z0-9_-]", "_", job_id)
    return decide_once(lambda start: uuid.uuid4().hex[:12], distributed=True)[0]


def transport_job_id(job_id: str, group_ranks: Tuple[int, ...], default_group: Optional[Tuple[int, ...]]) -> str:
    """The id a pipeline group's transport names its shared memory and rendezvous keys with: the job's own for
    parallel_state's pipeline group (`default_group`; names as with one group per job), else the job's with a digest
    of the group's ranks, so that two groups' transports in one process never share a name, and every member of a
    group, which sees the same parallel_state, derives the same one."""
    if group_ranks == default_group:
        return job_id
    digest = hashlib.sha256(f"{job_id}|{','.join(map(str, group_ranks))}".encode()).hexdigest()[:8]
    return f"{job_id[:MAX_JOB_ID_CHARS - 10]}-p{digest}"


def _parallel_state_pipeline_ranks() -> Optional[Tuple[int, ...]]:
    return pipeline_ranks()     # no communicator, no collection: parallel_state's group


class RuntimeSession:
    def __init__(self, settings: AppSettings, transport_wrappers: Sequence[TransportWrapperFactory] = ()):
        self.settings = settings
        self.transport_wrappers = transport_wrappers   # the job's list: wrappers added later apply too
        self.job_id: Optional[str] = None
        self._transports: Dict[Tuple[int, ...], object] = {}   # pipeline group's ranks (sorted) -> its transport
        self.tracer = None
        self._policies = {}         # kept across calls so learning policies (adaptive) remember task durations
        self.training_calls = 0     # forward_backward calls with backward (trace iterations)
        self.calls = 0              # all calls, evaluation included (message tags)
        self.last_iteration_s: Optional[float] = None   # wall time of the last training call
        # What an iteration spends outside the pipeline (data-parallel reduction, optimizer step, loss, the plan's
        # agreement), the last few iterations' (the rank that plans predicts their median); perf_counter seconds.
        # The first training call's is kept apart (its optimizer step creates the optimizer's state: 65 ms against
        # 6 ms later on an H200) and used only until a later one is seen, as the learnt task costs treat warm-up.
        self.last_call_start: Optional[float] = None
        self._outside_pipeline = collections.deque(maxlen=5)
        self._outside_warmup: Optional[float] = None
        self.last_planning_s: Optional[float] = None    # its planning time (pipeline rank 0, planning policies)
        self._closed = False
        self._announced = False
        self._shared_costs = None   # one learnt cost model per process, across calls of any microbatch count
        # The last training call's pipeline time (before the data-parallel reduction) and what its plan predicted
        # for this replica at nominal speed: (nominal predicted s or None, measured s).
        self.last_pipeline: Optional[tuple] = None
        self.replica_speeds = None  # iteration_plan.ReplicaSpeeds on the rank that plans, once replicas are seen
        self.prediction_error = None   # iteration_plan.PredictionError, with it
        self.plan_ahead = None      # plan_ahead.PlanAhead on the rank that plans, once a loop plans ahead
        # The most microbatches a training call has run: this rank's own, and on the rank that plans every rank's
        # (gathered with the measurements); `balanced` grows its count from it (composition_plan.count_limit).
        self.microbatches_run = 0

    def shared_costs(self):
        """The learnt task costs (length_costs.LengthCostModel) every planning policy of this process shares: a
        policy is cached per PipelineShape, which includes the microbatch count, so the costs live here."""
        if self._shared_costs is None:
            from megatron_app.schedule.length_costs import LengthCostModel

            self._shared_costs = LengthCostModel()
        return self._shared_costs

    def observe_outside_pipeline(self, now_s: float, slowest_pipeline_s: float) -> None:
        """At the next plan's agreement: the time since the last training call began, less the slowest replica's
        pipeline time in it, is what that iteration spent outside the pipeline so far."""
        if self.last_call_start is None:
            return
        seconds = max(0.0, now_s - self.last_call_start - slowest_pipeline_s)
        if self._outside_warmup is None:
            self._outside_warmup = seconds
        else:
            self._outside_pipeline.append(seconds)

    @property
    def outside_pipeline_s(self) -> Optional[float]:
        """The median of the last few after the first (an evaluation between two training calls lengthens one,
        which the median leaves out); the first alone until a second is seen; None before one."""
        if self._outside_pipeline:
            return statistics.median(self._outside_pipeline)
        return self._outside_warmup

    @property
    def plans_calls(self) -> bool:
        """This process runs a policy that plans each call (`planned`) with the default cap: the iteration plan
        may then order fixed microbatches too (iteration_plan.PlanRequest.plan_order). The same on every rank."""
        return self.settings.memory_cap is None and any(
            getattr(policy, "plans_iterations", False) for policy in self._policies.values())

    def record_pipeline_time(self, call_plan, seconds: float) -> None:
        self.last_pipeline = (None if call_plan is None else call_plan.nominal_predicted_s, seconds)

    def announce_once(self, what: str) -> None:
        """One line per rank on stderr the first time the schedule runs, so a user sees the plugin is active."""
        if not self._announced:
            self._announced = True
            say(f"megatron_app: {what}")

    def planning_budget_s(self) -> Optional[float]:
        """Time a planning policy may spend on the next call: a share of the last call (None before one ran)."""
        if self.last_iteration_s is None:
            return None
        return self.settings.planning_share * self.last_iteration_s

    def planning_stop(self, started: float):
        """stop(predicted_s) for a search that began at perf_counter() `started`: past a share of the last call or of
        the call being planned, whichever is smaller (lengths change from call to call, so a short iteration after a
        long one would otherwise spend far more than its share). None before a call ran: the whole search."""
        budget = self.planning_budget_s()
        if budget is None:
            return None
        share = self.settings.planning_share
        return lambda predicted_s: time.perf_counter() - started > min(budget, share * predicted_s)

    def policy_for(self, shape, rank: int, memory_cap):
        from megatron_app.schedule import make_policy

        from megatron_app.schedule import POLICIES

        name = self.settings.policy_name
        # Only the options the policy declares (settings.validate refused a set option it does not take).
        factor = self.settings.memory_factor if name in POLICIES and POLICIES[name].takes("memory_factor") else None
        key = (name, shape, rank, memory_cap, factor)
        if key not in self._policies:
            if self.settings.action_lists is not None:     # schedule "file"
                from megatron_app.schedule.action_lists import make_action_list_policy

                self._policies[key] = make_action_list_policy(shape, rank, self.settings.action_lists, memory_cap)
            else:
                self._policies[key] = make_policy(name, shape, rank, memory_cap=memory_cap, memory_factor=factor)
                if getattr(self._policies[key], "plans_iterations", False):
                    self._policies[key].costs = self.shared_costs()
        return self._policies[key]

    def policies_in_use(self):
        """The policy objects this process has run (one per shape and rank), e.g. to read a plan."""
        return list(self._policies.values())

    def serve_call(self, placement, forward_only: bool, num_microbatches: int):
        """(policy, transport, tracer or None when not traced) for one call of this rank (call_setup.RankPlacement);
        the transport and the tracer open on the first call that needs them."""
        self.agree_on_layout(placement)
        shape, pp_rank = placement.shape, placement.pp_rank
        policy = self.policy_for(shape, pp_rank, None if forward_only else self.settings.memory_cap)
        self.announce_once(f"rank {dist.get_rank()} (pipeline rank {pp_rank}): schedule policy={policy.name} "
                           f"P={shape.num_stages} V={shape.num_chunks} memory_cap={policy.memory_cap} "
                           f"(megatron-core {megatron_core_version()})")
        transport = self.ensure_transport(placement.pp_global)
        tracer = None
        if not forward_only:
            tp_group = placement.tp_group
            tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
            dp_rank = data_parallel_rank(placement.pg_collection)
            tracer = self.ensure_tracer(pp_rank, tp_rank, dp_rank, shape.num_stages, shape.num_chunks,
                                        num_microbatches, placement.model)
        return policy, transport, tracer

    def agree_on_layout(self, placement) -> None:
        """Raises the call's refusal of a misbuilt model (call_setup.check_chunk_layout) on every rank that would
        otherwise wait for the refusing one and die of a closed connection: at a pipeline group's first call, before
        the first collective that needs them all (the job id's, still to be agreed: the whole job; else the group's
        transport rendezvous: the group), the ranks share their refusals, and each ends with one line. Later calls
        refuse on the rank itself."""
        refusal = placement.layout_refusal
        key = tuple(sorted(placement.pp_global))
        if len(key) > 1 and key not in self._transports:
            group = None if self._job_id_to_agree() else placement.pp_group
            told = [None] * dist.get_world_size(group)
            dist.all_gather_object(told, None if refusal is None else str(refusal), group=group)
            ranks = range(len(told)) if group is None else dist.get_process_group_ranks(group)
            refusing = [(rank, text) for rank, text in zip(ranks, told) if text is not None]
            if refusal is None and refusing:
                rank, text = refusing[0]
                raise AppConfigError(f"rank {dist.get_rank()}: stopped at the first call: rank {rank} refused its "
                                     f"model: {text}")
        if refusal is not None:
            raise refusal

    def _job_id_to_agree(self) -> bool:
        return self.job_id is None and not (self.settings.job_id or os.environ.get(_JOB_ID_ENV))

    def ensure_transport(self, pp_global_ranks: List[int]):
        """The transport of the pipeline group with these global ranks (None for a group of one), opened now if this
        is the group's first call: every member of the group is in that call, so the rendezvous is safe."""
        key = tuple(sorted(pp_global_ranks))
        if len(key) < 2:
            return None
        if key not in self._transports:
            from megatron_app.transport import open_transport

            self.job_id = self.job_id or agree_on_job_id(self.settings.job_id)
            me = dist.get_rank()
            # Per link: shm on this host, rdma or tcp across hosts ($MEGATRON_APP_TRANSPORT forces one); the
            # job's own store carries host identities and listening addresses.
            store = dist.distributed_c10d._get_default_store()
            transport = open_transport(store, me, dist.get_world_size(),
                                       transport_job_id(self.job_id, key, _parallel_state_pipeline_ranks()),
                                       [r for r in key if r != me], master_addr=os.environ.get("MASTER_ADDR"),
                                       timeout_s=self.settings.timeout_s)
            for wrap in self.transport_wrappers:
                transport = wrap(transport, list(pp_global_ranks))
            self._transports[key] = transport
        return self._transports[key]

    @property
    def transports(self) -> list:
        """The open transports, one per pipeline group this process has called in."""
        return list(self._transports.values())

    def ensure_tracer(self, pp_rank: int, tp_rank: int, dp_rank: int, P: int, V: int, m: int, model=None):
        if self.tracer is None:
            from megatron_app.trace import TraceMeta, Tracer

            from .clock_offset import measure_clock_offset

            enabled = self.settings.trace_dir is not None
            offset = (measure_clock_offset(trust_shared_clock=True)
                      if enabled and dist.get_world_size() > 1 else 0.0)
            meta = TraceMeta(dist.get_rank(), pp_rank, tp_rank, dp_rank, pipeline_parallel=P, model_chunks=V,
                             microbatches=m, policy=self.settings.policy_name, host=socket.gethostname(),
                             source="runtime", clock_offset_us=offset,
                             extra={"torch": torch.__version__, "links": self._link_backends(), "model": model})
            self.tracer = Tracer(self.settings.trace_dir or ".", meta, enabled=enabled)
        return self.tracer

    def _link_backends(self):
        """{peer rank: 'shm'|'tcp'|'rdma'} of this rank's transports, recorded in the trace header."""
        return {str(peer): transport.backend_of(peer) for transport in self._transports.values()
                for peer in transport.peers}

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self.plan_ahead is not None:
            self.plan_ahead.close()
        if self.tracer is not None:
            self.tracer.close()
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()
