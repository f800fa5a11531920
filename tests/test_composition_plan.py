"""The balanced composition planner (schedule/composition_plan.py), its cost model and the simulated rows."""

import pytest

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.schedule.composition import Composition, loader_composition
from megatron_app.schedule.composition_plan import (CompositionPlanner, balanced_groups, count_limit,
                                                    loader_peak_caps, valid_microbatch_counts)
from megatron_app.schedule.length_costs import LengthCostModel
from megatron_app.schedule.tasks import Kind
from megatron_app.sim.composition import (BALANCED_ROW, DP_BALANCED_ROW, PACKED_ROW, CompositionSimConfig,
                                          simulate_composition)
from megatron_app.schedule.iteration_plan import dp_balanced_packs
from megatron_app.sim.lengths import MicrobatchLengths

F, B = Kind.FORWARD, Kind.BACKWARD
# A long tail: mostly short documents, a few long ones (the copyright corpus's shape).
LONG_TAIL = (120, 300, 2048, 90, 410, 150, 1900, 260, 80, 700, 130, 95, 2048, 220, 310, 60,
             140, 480, 100, 1200, 75, 330, 210, 160, 88, 1500, 240, 115, 390, 70, 600, 180)


def _learnt_costs(V=2):
    """Costs of the simulator's 0.7x + 0.3x^2 model (x = tokens / 400) plus 0.4 ms a task, learnt from samples."""
    model = LengthCostModel()
    for kind, base in ((F, 0.010), (B, 0.020)):
        for chunk in range(V):
            for tokens, squared in ((100, 10_000), (800, 320_000), (2048, 4_194_304), (1500, 1_250_000)):
                x, q = tokens / 400, squared / 400 ** 2
                model.observe(kind, chunk, tokens, 4e-4 + base * (0.7 * x + 0.3 * q), squared)
    return model


def test_cost_model_learns_the_per_document_quadratic_term():
    model = _learnt_costs()
    # two documents of 500 packed cost less attention than one of 1000 (same tokens): 2 x 500^2 < 1000^2
    assert model.seconds(F, 0, 1000, 2 * 500 ** 2) < model.seconds(F, 0, 1000)
    x, q = 1000 / 400, 2 * 500 ** 2 / 400 ** 2
    assert model.seconds(F, 0, 1000, 2 * 500 ** 2) == pytest.approx(4e-4 + 0.010 * (0.7 * x + 0.3 * q), rel=1e-6)
    # a padded microbatch of one length is the special case squared = rows x length^2
    assert model.seconds(B, 1, 2 * 300, 2 * 300 ** 2) == pytest.approx(
        4e-4 + 0.020 * (0.7 * 1.5 + 0.3 * 2 * 0.75 ** 2), rel=1e-6)


def test_valid_counts_follow_megatrons_interleaving_rule():
    assert valid_microbatch_counts(4, 2, 20) == (4, 8, 12, 16, 20)      # default group size P: multiples of P
    assert valid_microbatch_counts(4, 1, 5) == (1, 2, 3, 4, 5)          # no interleaving: any count
    assert valid_microbatch_counts(4, 2, 13, microbatch_group_size=6) == (6, 10, 11, 12)
    for m in valid_microbatch_counts(4, 2, 40, microbatch_group_size=6):
        PipelineShape(4, 2, m, microbatch_group_size=6)


def test_balanced_groups_place_every_document_once_and_balance():
    weights = [len_ * (0.7 + 0.3 * len_ / 400) for len_ in LONG_TAIL]
    groups = balanced_groups(weights, 8)
    Composition(groups, packed=True).check(len(LONG_TAIL))
    loads = [sum(weights[d] for d in g) for g in groups]
    assert max(loads) <= 1.05 * max(max(weights), sum(weights) / 8)
    with pytest.raises(ScheduleConfigError):
        balanced_groups(weights, len(weights) + 1)


@pytest.mark.parametrize("P,V", [(4, 2), (2, 1)])
def test_planner_respects_cap_count_rule_and_is_deterministic(P, V):
    costs = _learnt_costs(V)
    planner = CompositionPlanner(P, V, final_evaluations=96)
    first = planner.plan(LONG_TAIL, 2, costs)
    assert first == planner.plan(LONG_TAIL, 2, costs)
    first.composition.check(len(LONG_TAIL))
    assert first.composition.packed
    assert first.num_microbatches in valid_microbatch_counts(P, V, len(LONG_TAIL))
    loader = loader_composition(len(LONG_TAIL), 2, packed=False)
    caps = loader_peak_caps(PipelineShape(P, V, 16), loader.microbatch_tokens(LONG_TAIL))
    assert first.caps == pytest.approx(caps)
    assert all(peak <= cap * (1 + 1e-9) for peak, cap in zip(first.peaks, caps))
    assert first.predicted_makespan < first.predicted_loader_makespan
    assert first.microbatch_tokens == first.composition.microbatch_tokens(LONG_TAIL)


def test_planner_works_from_the_prior_before_any_observation():
    composed = CompositionPlanner(4, 2, final_evaluations=32).plan(LONG_TAIL, 2, LengthCostModel())
    composed.composition.check(len(LONG_TAIL))


def test_counts_grow_from_the_loaders_by_at_most_doubling_the_most_run():
    assert [count_limit(16, run) for run in (0, 3, 16, 40)] == [16, 16, 32, 80]


def test_before_any_call_the_plan_keeps_to_the_loaders_count_and_then_at_most_doubles_it():
    """The prior (cost proportional to tokens) has no per-task cost: at P=2 V=2 every microbatch more shrinks the
    bubble for free, so unbounded the first plan forms one microbatch per document (an H200 ran 256 so, 20x its
    later iterations). Bounded by what calls ran, it keeps the loader's 16, then may reach 32, then 64."""
    lengths = LONG_TAIL * 2
    planner = CompositionPlanner(2, 2, final_evaluations=32)
    assert planner.plan(lengths, 4, LengthCostModel()).num_microbatches == len(lengths)
    counts = [planner.plan(lengths, 4, LengthCostModel(), microbatches_run=run).num_microbatches
              for run in (0, 16, 32)]
    assert counts == [16, 32, 64]
    # a replica given fewer documents than its loader share (a cross-replica plan): 3 documents in microbatches of
    # 2 make a loader count of 1, which P=2 V=2 does not accept; the smallest count it accepts is the bound then
    moved = planner.plan(LONG_TAIL[:3], 2, LengthCostModel(), caps=(1e9, 1e9), loader_makespan=1.0,
                         microbatches_run=0)
    assert moved.num_microbatches == 2


def test_loader_order_packing_meets_the_budget_and_a_valid_count():
    packs = dp_balanced_packs(LONG_TAIL, 2048, 1, valid_microbatch_counts(4, 2, len(LONG_TAIL)))
    composition = Composition(tuple(tuple(p) for p in packs), packed=True)
    composition.check(len(LONG_TAIL))
    assert composition.num_microbatches % 4 == 0
    assert all(t <= 2048 for t in composition.microbatch_tokens(LONG_TAIL))
    assert [p for g in composition.groups[:3] for p in g] == list(range(len([p for g in composition.groups[:3]
                                                                              for p in g])))   # loader order


def test_simulated_balanced_composition_beats_loader_packing_at_no_more_memory():
    lengths = MicrobatchLengths(corpus=LONG_TAIL * 4)
    config = CompositionSimConfig(4, 2, 16, 2, lengths, iterations=3)
    packed = simulate_composition(config, PACKED_ROW)
    dp_balanced = simulate_composition(config, DP_BALANCED_ROW)
    balanced = simulate_composition(config, BALANCED_ROW, planner_evaluations=96)
    assert balanced.makespan_us < 0.95 * packed.makespan_us
    assert balanced.makespan_us < dp_balanced.makespan_us
    assert balanced.peak_over_loader <= 1.0 + 1e-9
    assert balanced.padding_share == 0.0


def test_sim_cli_compares_compositions(tmp_path, capsys):
    from megatron_app.sim.cli import main

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{v}\n" for v in LONG_TAIL))
    assert main(["--pipeline_parallel", "2", "--model_chunks", "2", "--microbatches", "4", "--lengths-file",
                 str(lengths), "--documents-per-microbatch", "2", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert all(row in out for row in ("loader", "packed", "dp-balanced", "balanced"))
    assert main(["--pipeline_parallel", "2", "--microbatches", "4", "--documents-per-microbatch", "2"]) == 2


def test_a_spent_budget_still_screens_the_likeliest_count_besides_the_loaders():
    """Host-bound tasks (the H100's P=1 run: ~12 ms a task at any length) make few large microbatches fastest. A
    budget already spent when screening starts (short GPU iterations) once left only the loader's count screened;
    candidates are screened in order of a cheap estimate, so the likeliest one is screened too."""
    model = LengthCostModel()
    for kind, fixed in ((F, 0.012), (B, 0.012)):
        for tokens in (300, 700, 1000, 1500, 2200):
            model.observe(kind, 0, tokens, fixed + 1e-7 * tokens, tokens * 80)
    # 64 short documents, the loader's 16 microbatches of 4, one of 600 tokens in every fourth (padded to 2,400:
    # the memory cap lets a packed microbatch hold 2,400 tokens)
    lengths = tuple(600 if i % 16 == 0 else 40 + (7 * i) % 90 for i in range(64))
    planner = CompositionPlanner(1, 1, final_evaluations=8)
    unlimited = planner.plan(lengths, 4, model)
    spent = planner.plan(lengths, 4, model, stop=lambda loader_value: True)
    assert unlimited.composition.num_microbatches <= 5 < 16              # few microbatches: the fixed cost less often
    assert spent.composition.num_microbatches == unlimited.composition.num_microbatches
    assert spent.predicted_makespan == pytest.approx(unlimited.predicted_makespan) and not spent.packed_fallback
