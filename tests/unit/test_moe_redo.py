"""The decision of a bounded MoE dispatch (runtime/moe_redo.py), in process: a micro-batch is
redone exactly when the global dropped count of any MoE layer is not zero, the redo program
must take the bounded program's inputs, and the metrics and the run summary count what was
redone. (Through titan-build, titan-run and titan-verify: e2e/test_moe_capacity.py.)"""

from __future__ import annotations

import pytest
import torch

from conftest import param_spec
from titan.runtime.contract.rank_record import BufferSpec, GraphInput, RankRecord
from titan.runtime.moe_redo import OverflowRedo, redo_summary

BUFFERS = (BufferSpec(fqn="layers.1.moe.expert_bias", shape=(8,), dtype="float32"),
           BufferSpec(fqn="layers.1.moe.dropped_tokens", shape=(), dtype="int64", metric="dropped_tokens"),
           BufferSpec(fqn="layers.2.moe.dropped_tokens", shape=(), dtype="int64", metric="dropped_tokens"))


def _record(**changes) -> RankRecord:
    """One rank of a two-MoE-layer model: one parameter, three buffers the forward updates."""
    fields = dict(params=(param_spec("w", [8, 6], []),),
                  forward_inputs=(GraphInput(kind="param", fqn="w"), *(GraphInput(kind="buffer", fqn=b.fqn)
                                                                       for b in BUFFERS),
                                  GraphInput(kind="tokens"), GraphInput(kind="labels")),
                  static_input_indices=(0,), saved_activations=1, saved_bytes=64, backward_outputs=("w",),
                  bucket_plan=(), rank=None, coords=None, forward_graph="b" * 64, backward_graph="c" * 64,
                  buffers=BUFFERS, mutated_buffers=tuple(b.fqn for b in BUFFERS), model_plan=None)
    return RankRecord(**(fields | changes))


def _updates(*dropped: int) -> list[torch.Tensor]:
    return [torch.zeros(8), *(torch.tensor(n) for n in dropped)]


def _outputs(*dropped: int) -> list[torch.Tensor]:
    """A bounded forward's outputs: the buffer updates, then the loss and a saved activation."""
    return [*_updates(*dropped), torch.tensor(3.5), torch.ones(4)]


def test_a_micro_batch_is_redone_exactly_when_a_layer_dropped_and_the_metrics_count_it():
    redo = OverflowRedo(_record(), _record(), None, None, where="art rank 0")
    assert torch.equal(redo.overflow_count(_outputs(2, 5)), torch.tensor(7))  # the dropped counts only
    assert not redo.overflowed(redo.overflow_count(_outputs(0, 0)))
    assert redo.overflowed(redo.overflow_count(_outputs(0, 3))) and redo.overflowed(redo.overflow_count(_outputs(5, 0)))
    assert redo.metrics() == {"moe_redone": 2, "moe_overflow": 8}
    assert redo.metrics() == {"moe_redone": 0, "moe_overflow": 0}  # per step


@pytest.mark.parametrize("change", [
    dict(params=(param_spec("w", [8, 7], []),)),
    dict(mutated_buffers=tuple(b.fqn for b in reversed(BUFFERS))),
    dict(forward_inputs=_record().forward_inputs[::-1]),
])
def test_a_redo_program_with_other_inputs_is_refused(change):
    with pytest.raises(ValueError, match="art rank 0: its dropless redo program takes other inputs than its bounded "
                                         "program; rebuild it with titan-build"):
        OverflowRedo(_record(), _record(**change), None, None, where="art rank 0")


def test_a_bounded_program_without_dropped_counts_is_refused():
    plain = _record(buffers=BUFFERS[:1], mutated_buffers=(BUFFERS[0].fqn,),
                    forward_inputs=_record().forward_inputs[:2] + _record().forward_inputs[4:])
    with pytest.raises(ValueError, match="cannot detect an overflow"):
        OverflowRedo(plain, plain, None, None, where="art rank 0")


def test_the_run_summary_counts_the_redone_steps():
    records = [{"moe_redone": n} for n in (0, 2, 1, 0)]
    assert redo_summary(records) == "MoE capacity overflow: 2 of 4 step(s) redone dropless (3 micro-batch(es))"
    assert redo_summary([{"loss": 1.0}]) == ""
