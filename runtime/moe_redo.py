"""A bounded mixture-of-experts dispatch that stays dropless (titan-build --moe-capacity F).

The artifact's programs size every dispatch buffer for F times the balanced load; it also
carries the dropless programs (the default build's, buffers for the worst case). Each
micro-batch runs the bounded forward. Its MoE layers count on the device, summed over every
rank, the assignments that did not fit (their `dropped_tokens` buffers' new values): the step
has not overflowed when that count is 0, and then the bounded program's results are the
dropless ones bit for bit (every kept row meets the same kernels in the same order; the
dispatch only pads less). Otherwise the micro-batch is redone from the start by the dropless
program, from the same parameters and buffers: nothing was applied yet (the buffers take their
new values after the backward, the optimizer steps after every micro-batch), so no half step
exists to undo. The count is global, so every rank takes the same branch.

The cost: one scalar read on the host per micro-batch, after the forward (the one place the
step waits for the device), and on an overflow a second forward and the dropless backward
(the bounded backward is skipped). The dropless program's memory is needed while it runs.
A held-out batch needs no decision: its loss comes from the dropless forward cut down to its
loss (GraphProgram.forward_loss), which is what a redo would give.

Eager (CPU, --no-cuda-graphs): GraphProgram.forward_backward. Under CUDA graphs, the same pieces
(bounded forward with its count, bounded backward, dropless forward + backward) are three
captures sharing one memory pool: runtime/captured_redo.py.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from titan.runtime.contract.checks import ArtifactError
from titan.runtime.contract.rank_record import RankRecord


class OverflowRedo:
    """The dropless redo of one rank's bounded program, and how often it ran."""

    def __init__(self, record: RankRecord, dropless: RankRecord, forward: fx.GraphModule,
                 backward: fx.GraphModule, *, where: str):
        check_same_interface(record, dropless, where)
        self.forward, self.backward = forward, backward
        dropped = {b.fqn for b in record.buffers if b.metric == "dropped_tokens"}
        self.dropped_outputs = [i for i, fqn in enumerate(record.mutated_buffers) if fqn in dropped]
        if not self.dropped_outputs:
            raise ArtifactError(f"{where}: a bounded MoE program without dropped-token counts cannot detect an "
                                "overflow; rebuild it with titan-build")
        self.redone = 0
        """Micro-batches redone by the dropless program since the last metrics()."""
        self.overflow = 0
        """Assignments the bounded attempts of those micro-batches could not hold."""

    def overflow_count(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The assignments the bounded forward could not hold, summed over its MoE layers (a
        device scalar, global: the same on every rank), from the forward's outputs (its buffer
        updates first). Made on the device, so a CUDA graph can capture it."""
        return torch.stack([outputs[i] for i in self.dropped_outputs]).sum()

    def overflowed(self, count: torch.Tensor) -> bool:
        """Whether the bounded forward overflowed (`count`: its overflow_count): the micro-batch's
        one host read. Counted for the step's metrics."""
        over = int(count)
        if over:
            self.redone += 1
            self.overflow += over
        return over > 0

    def metrics(self) -> dict[str, int]:
        """The step's record: micro-batches redone dropless and the assignments that overflowed."""
        out = {"moe_redone": self.redone, "moe_overflow": self.overflow}
        self.redone = self.overflow = 0
        return out


def check_same_interface(record: RankRecord, dropless: RankRecord, where: str) -> None:
    """The redo program must take and give what the bounded one does: the same inputs
    (parameters, buffers, batch) in the same order and the same buffer updates."""
    same = (record.forward_inputs == dropless.forward_inputs and record.params == dropless.params
            and record.buffers == dropless.buffers and record.mutated_buffers == dropless.mutated_buffers)
    if not same:
        raise ArtifactError(f"{where}: its dropless redo program takes other inputs than its bounded program; "
                            "rebuild it with titan-build")


def redo_summary(records: list[dict]) -> str:
    """The run summary's sentence on capacity overflows ('' without a bounded dispatch)."""
    redone = [r["moe_redone"] for r in records if "moe_redone" in r]
    if not redone:
        return ""
    steps = sum(1 for n in redone if n)
    return (f"MoE capacity overflow: {steps} of {len(redone)} step(s) redone dropless "
            f"({sum(redone)} micro-batch(es))")
