"""The pipeline's stage split and schedule (builder/spec/stage_split.py, pipeline_order.py) and
their record in the artifact (runtime/contract/pipeline_schedule.py): the compute order is
torch.distributed.pipelining's own, the record proves a step complete and deadlock-free, and a
hostile record is one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                   ScheduleZBVZeroBubble, _add_send_recv)

from titan.builder.models.llama3.config import FLAVORS
from titan.builder.spec.pipeline_order import interleaved_rounds, pipeline_schedule
from titan.builder.spec.stage_split import balanced_split, dense_decoder_costs, layer_spans, parse_split
from titan.runtime.contract.checks import ArtifactCheckError
from titan.runtime.contract.pipeline_schedule import COMPUTE, Action, PipelineSchedule

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _torch_order(schedule: str, stages: int, microbatches: int) -> dict[int, list[str]]:
    """torch's per-rank compute actions (its schedule IR without idle steps and gradient
    reductions), from the schedule class's own generator."""
    state = SimpleNamespace(_num_stages=stages, _n_microbatches=microbatches)
    order = TORCH_SCHEDULES[schedule]._get_pipeline_order(state)
    return {rank: [str(a) for a in actions if a is not None and a.computation_type.value in ("F", "B")]
            for rank, actions in order.items()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 7), (8, 16)])
def test_each_ranks_compute_order_is_torch_pipelinings(schedule, stages, microbatches):
    record = pipeline_schedule(schedule, spans=layer_spans((1,) * stages), microbatches=microbatches)
    ours = {r: [str(a) for a in actions if a.kind in ("F", "B")] for r, actions in enumerate(record.actions)}
    theirs = _torch_order(schedule, stages, microbatches)
    if schedule == "1f1b":
        # torch's 1F1B IR numbers the last rank's forwards from 1 (it has no warm-up forward, and the
        # IR increments before its first use), while its runtime runs micro-batch 0 first: the
        # runtime's order is compared in tests/e2e/test_pipeline_bitwise.py; here the IR's is shifted back.
        shifted = [Action.parse(a, "torch") for a in theirs[stages - 1]]
        theirs[stages - 1] = [str(Action(a.stage, a.kind, a.microbatch - (a.kind == "F"))) for a in shifted]
    assert ours == theirs


@pytest.mark.parametrize("pp, per_rank, microbatches", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 5), (4, 2, 4),
                                                        (4, 2, 6), (4, 3, 12), (8, 2, 16)])
def test_each_ranks_interleaved_order_is_torch_pipelinings(pp, per_rank, microbatches):
    record = pipeline_schedule("interleaved-1f1b", spans=layer_spans((1,) * (pp * per_rank)),
                               microbatches=microbatches, stages_per_rank=per_rank)
    rounds, per_round = interleaved_rounds(pp, microbatches)
    # The schedule's own generator, for each rank (it reads these attributes of the schedule).
    state = SimpleNamespace(n_local_stages=per_rank, pp_group_size=pp, _n_microbatches=microbatches,
                            number_of_rounds=rounds, microbatches_per_round=per_round)
    for rank in range(pp):
        theirs = [str(a) for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)
                  if a is not None]
        assert [str(a) for a in record.actions[rank] if a.kind in ("F", "B")] == theirs
        assert {a.stage for a in record.actions[rank]} == set(range(rank, pp * per_rank, pp))


@pytest.mark.parametrize("pp, microbatches", [(2, 1), (2, 2), (2, 4), (2, 5), (3, 2), (3, 5), (3, 9), (4, 7),
                                               (4, 8), (8, 15), (8, 32)])
def test_each_ranks_zbv_order_and_transfers_are_torch_pipelinings(pp, microbatches):
    record = pipeline_schedule("zbv", spans=layer_spans((1,) * (2 * pp)), microbatches=microbatches,
                               stages_per_rank=2)
    # The schedule's own generator, for each rank (it reads these attributes of the schedule).
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=2 * pp)
    compute = {r: ScheduleZBVZeroBubble._calculate_single_rank_operations(state, r) for r in range(pp)}
    # And torch's lowering of it to transfers (the one ScheduleZBVZeroBubble runs).
    full = _add_send_recv({r: list(a) for r, a in compute.items()}, stage_to_rank=lambda s: record.stage_rank[s],
                          num_stages=2 * pp)
    for rank in range(pp):
        assert [str(a) for a in record.actions[rank] if a.kind in COMPUTE] == [str(a) for a in compute[rank] if a]
        assert [str(a) for a in record.actions[rank]] == [str(a) for a in full[rank]]
        # The V: rank r holds stages r and 2 pp - 1 - r, and runs I and W for each, never B.
        assert {a.stage for a in record.actions[rank]} == {rank, 2 * pp - 1 - rank}
        assert {a.kind for a in record.actions[rank] if a.kind in COMPUTE} == {"F", "I", "W"}
    # The turn of the V (stages pp - 1 and pp, both on rank pp - 1) hands over in memory.
    assert not any(a.kind.startswith(("SEND", "RECV")) and a.stage in (pp - 1, pp) and
                   (a.stage, a.kind) in ((pp - 1, "SEND_F"), (pp, "RECV_F"), (pp, "SEND_B"), (pp - 1, "RECV_B"))
                   for a in record.actions[pp - 1])
    assert PipelineSchedule.from_json(record.to_json(), "x", n_layers=2 * pp, pp=pp) == record


def _zbv(change) -> dict:
    d = pipeline_schedule("zbv", spans=layer_spans((1,) * 4), microbatches=2, stages_per_rank=2).to_json()
    change(d)
    return d


@pytest.mark.parametrize("change, message", [
    # W before its I; W with no I at all; B where the schedule splits the backward.
    (lambda d: _swap(d["actions"][0], "3I0", "3W0"), "rank 0 runs 3W0 before 3I0"),
    (lambda d: d["actions"][0].remove("3I1"), "rank 0 runs 3SEND_B1 before 3I1"),
    (lambda d: d["actions"][0].remove("0W1"), "rank 0 never runs 0W1"),
    (lambda d: d["actions"][0].__setitem__(d["actions"][0].index("3I0"), "3B0"), "which stage 3 has no use for"),
    # I where B would be: after its forward and the gradient it needs (here handed over in memory
    # by stage 2's I on the same rank).
    (lambda d: _swap(d["actions"][1], "1I0", "2I0"), "rank 1 runs 1I0 before 2I0"),
    (lambda d: _swap(d["actions"][1], "2F0", "1F0"), "rank 1 runs 2F0 before 1F0"),
    # No transfer between the stages at the turn of the V.
    (lambda d: d["actions"][1].insert(d["actions"][1].index("1F0") + 1, "1SEND_F0"), "which stage 1 has no use for"),
    (lambda d: d.__setitem__("stage_rank", [0, 1, 0, 1]), r"is not zbv's placement of 4 stages on 2 pp ranks "
                                                          r"\(\[0, 1, 1, 0\]\)"),
    # Receives in another order than the sends (causal, and tags would match them; NCCL would not).
    (lambda d: _swap(d["actions"][1], "1RECV_F0", "1RECV_F1"), "in another order than it sends"),
])
def test_a_zbv_record_with_a_misplaced_split_backward_is_one_line(change, message):
    _refused(_zbv(change), message)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 4), (4, 8)])
def test_micro_batches_in_flight_are_all_of_them_in_gpipe_and_the_stages_ahead_in_1f1b(stages, microbatches):
    spans = layer_spans((2,) * stages)
    gpipe, one_f_one_b = (pipeline_schedule(s, spans=spans, microbatches=microbatches) for s in ("gpipe", "1f1b"))
    assert [gpipe.in_flight(s) for s in range(stages)] == [microbatches] * stages
    assert [one_f_one_b.in_flight(s) for s in range(stages)] == [min(stages - s, microbatches) for s in range(stages)]
    assert [one_f_one_b.rank_in_flight(r) for r in range(stages)] == [one_f_one_b.in_flight(s) for s in range(stages)]
    # Interleaved, two stages per rank: a rank holds at least what its fullest stage does at its
    # peak, and not more than their peaks together (they peak at different times).
    interleaved = pipeline_schedule("interleaved-1f1b", spans=layer_spans((1,) * 2 * stages), microbatches=microbatches,
                                    stages_per_rank=2)
    for r in range(stages):
        peaks = [interleaved.in_flight(r), interleaved.in_flight(r + stages)]
        assert max(peaks) <= interleaved.rank_in_flight(r) <= sum(peaks)
    if (stages, microbatches) == (2, 4):
        # Rank 0 runs 0F0 0F1 2F0 2F1 0F2 before 2B0 comes back: 5 held.
        assert [interleaved.rank_in_flight(r) for r in range(2)] == [5, 3]


def test_a_record_reads_back_what_was_written():
    record = pipeline_schedule("1f1b", spans=((0, 3), (3, 5), (5, 6)), microbatches=4)
    assert PipelineSchedule.from_json(record.to_json(), "x", n_layers=6, pp=3) == record


def _mutated(change, schedule: str = "1f1b") -> dict:
    d = pipeline_schedule(schedule, spans=((0, 2), (2, 4)), microbatches=2).to_json()
    change(d)
    return d


def _swap(actions: list, a: str, b: str) -> None:
    i, j = actions.index(a), actions.index(b)
    actions[i], actions[j] = actions[j], actions[i]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["actions"][0].insert(0, "0F9"), "micro-batch out of range"),
    (lambda d: d["actions"][1].append("1F0"), "runs 1F0 twice"),
    (lambda d: d["actions"][1].remove("1SEND_B1"), "never runs 1SEND_B1"),
    (lambda d: d["actions"][0].append("0RECV_F0"), "has no use for"),
    (lambda d: d["actions"][0].append("1F0"), "a stage it does not hold"),
    (lambda d: d["actions"][0].__setitem__(0, "0F0; rm -rf"), "is not a pipeline action"),
    (lambda d: d["actions"][1].__setitem__(1, {"F": 0}), "is not a pipeline action"),
    (lambda d: _swap(d["actions"][1], "1F0", "1RECV_F0"), "runs 1F0 before 1RECV_F0"),
    # Rank 1 takes micro-batch 1 first, and rank 0 sends it only once micro-batch 0's gradient is
    # back: each waits for the other.
    (lambda d: (_swap(d["actions"][1], "1RECV_F0", "1RECV_F1"), _swap(d["actions"][1], "1F0", "1F1"),
                _swap(d["actions"][1], "1B0", "1B1"), _swap(d["actions"][1], "1SEND_B0", "1SEND_B1"),
                d["actions"][0].remove("0SEND_F1"), d["actions"][0].insert(d["actions"][0].index("0B0") + 1,
                                                                            "0SEND_F1")), "deadlocks"),
    (lambda d: d["stage_layers"].__setitem__(1, [3, 4]), "consecutive, non-empty"),
    (lambda d: d["stage_layers"].__setitem__(1, [2, 3]), "the model has 4"),
    (lambda d: d.__setitem__("schedule", "zb-h1"), "unknown schedule"),
    (lambda d: d.__setitem__("schedule", "zbv"), "zbv cannot place 2 stages on 2 pp ranks"),
    (lambda d: d.__setitem__("microbatches", 1 << 40), "microbatches"),
    (lambda d: d["actions"].append([]), "one list per pipeline rank"),
    (lambda d: d["actions"][0].extend(["0F0"] * (1 << 20)), "more than"),
    (lambda d: d.pop("stage_rank"), "needs exactly"),
    (lambda d: d.__setitem__("stage_rank", [1, 1]), r"stage_rank \[1, 1\] is not 1f1b's placement of 2 stages on 2 pp "
                                                    r"ranks \(\[0, 1\]\)"),
    (lambda d: d["actions"][1].__setitem__(d["actions"][1].index("1B0"), "1I0"), "runs 1I0, which stage 1 has no use"),
])
def test_a_record_titan_build_would_not_write_is_one_line(change, message):
    _refused(_mutated(change), message)


def _refused(record: dict, message: str) -> None:
    with pytest.raises(ArtifactCheckError, match=message) as info:
        PipelineSchedule.from_json(record, "pipeline", n_layers=4, pp=2)
    assert "\n" not in str(info.value) and str(info.value).endswith("rebuild the artifact with titan-build")


def test_a_short_record_claiming_a_huge_step_is_refused_before_its_sets_are_made():
    d = pipeline_schedule("gpipe", spans=layer_spans((1,) * 200), microbatches=1).to_json()
    d["microbatches"] = 4096
    with pytest.raises(ArtifactCheckError, match="200 stages x 4096 micro-batches need 4,898,816 actions"):
        PipelineSchedule.from_json(d, "pipeline", n_layers=200, pp=200)


def test_a_rank_that_receives_in_another_order_than_its_peer_sends_is_refused():
    # Causal and deadlock-free with tagged messages, but NCCL matches messages by order alone.
    def take_micro_batch_1_first(d):
        d["actions"][1][:4] = ["1RECV_F1", "1F1", "1RECV_F0", "1F0"]
    _refused(_mutated(take_micro_batch_1_first, "gpipe"), "receives from pp rank 0 in another order than it sends")


def test_the_balanced_split_counts_the_output_and_the_embedding():
    # Llama 3 8B at seq 8192: the output projection costs about 1.8 blocks, so the last of 4 stages
    # gets the fewest layers.
    costs = dense_decoder_costs(FLAVORS["8B"], 8192)
    counts = balanced_split(costs, 4)
    assert sum(counts) == 32 and counts[-1] == min(counts) == 6 and balanced_split(costs, 4) == counts
    spans = layer_spans(counts)
    stage_costs = [costs.stage(a, b, first=s == 0, last=s == 3) for s, (a, b) in enumerate(spans)]
    # No single layer moved between neighbours lowers the costliest stage.
    for s in range(3):
        for moved in ((1, -1), (-1, 1)):
            other = list(counts)
            other[s] += moved[0]
            other[s + 1] += moved[1]
            if min(other) < 1:
                continue
            alt = [costs.stage(a, b, first=i == 0, last=i == 3) for i, (a, b) in enumerate(layer_spans(tuple(other)))]
            assert max(alt) >= max(stage_costs)
    # The memory report's parameter counts: the stages hold the whole model once.
    assert sum(costs.stage_params(a, b, first=s == 0, last=s == 3) for s, (a, b) in enumerate(spans)) == \
        FLAVORS["8B"].n_params
    # Equal blocks and no head: an even split.
    assert balanced_split(type(costs)(block=(1.0,) * 8, embedding=0.0, head=0.0), 4) == (2, 2, 2, 2)


@pytest.mark.parametrize("text, message", [("3,x", "comma-separated"), ("2,1,1", "gives 3 stage"),
                                           ("4,0", "at least one layer"), ("3,2", "holds 5 layers")])
def test_a_split_given_by_hand_is_checked(text, message):
    assert parse_split("3,1", stages=2, n_layers=4) == (3, 1)
    with pytest.raises(ValueError, match=message):
        parse_split(text, stages=2, n_layers=4)
