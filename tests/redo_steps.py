"""The captured overflow redo (runtime/captured_redo.py) against the eager one, step by step, in
this process on one rank: e2e/test_captured_redo.py runs it on the CPU with EagerReplays in
place of CUDA graphs, gpu/test_captured_redo_cuda.py with the CUDA graphs themselves.

Two programs of one artifact, from the same seed: `eager` steps with GraphProgram.step (the
--no-cuda-graphs path), `captured` with CapturedRedoStep. After each micro-batch their losses,
gradients and buffers must be equal bit for bit, and after each step (a plain SGD update, the
same on both) their parameters. On one rank a bounded dispatch either always overflows
(capacity below 1) or never does, so `force` also sends chosen micro-batches of the captured
program to the dropless branch: a micro-batch that did not overflow is the dropless one bit
for bit, so the forced redo must not change a bit either, and the run mixes both branches.
"""

from __future__ import annotations

import torch

from titan.runtime.captured_redo import CapturedRedoStep
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.data import SyntheticTokens
from titan.runtime.train import GraphProgram

LR = 1e-2


class EagerReplays:
    """What CapturedRedoStep needs of its CUDA graphs, on any device: a 'capture' runs the work
    once for its result's tensors and then undoes what the work did to the program's buffers
    (a capture records without running); a 'replay' runs the work again and copies what it
    returns into the first result's tensors, as a graph's replay rewrites its static outputs."""

    def __init__(self, program: GraphProgram):
        self.program = program

    def eagerly(self, work, *args):
        return work(*args)

    def settle(self) -> None:
        pass

    def capture(self, work, *args):
        before = {fqn: t.clone() for fqn, t in self.program.buffers.tensors.items()}
        result = work(*args)
        for fqn, t in self.program.buffers.tensors.items():
            t.copy_(before[fqn])
        static = _tensors(result)

        def replay():
            for into, fresh in zip(static, _tensors(work(*args))):
                into.copy_(fresh)
        return replay, result

    def close(self) -> None:
        pass


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def compare_captured_redo(artifact, *, device: torch.device, graphs=None, steps: int, micro_batches: int = 1,
                          force: set[int] = frozenset()) -> list[bool]:
    """Run both programs `steps` steps; assert every micro-batch and step equal; return, per
    micro-batch, whether the captured program took the dropless branch (the eager warm-up's
    first). `force`: indices into that list sent to the dropless branch whatever their count."""
    art = open_artifact(artifact)
    eager, captured = (GraphProgram(art, 0, device=device, mesh=None, seed=0, micro_batches=micro_batches)
                       for _ in range(2))
    step = CapturedRedoStep(captured, graphs=graphs if graphs is not None else EagerReplays(captured))
    decided, real = [], captured.redo.overflowed

    def overflowed(count: torch.Tensor) -> bool:
        over = real(count) or len(decided) in force
        decided.append(over)
        return over

    captured.redo.overflowed = overflowed
    m = art.manifest
    data = SyntheticTokens(vocab_size=m.vocab_size, batch_size=m.batch_size, seq_len=m.seq_len, seed=0, dp_rank=0)
    for s in range(steps):
        for mb in range(micro_batches):
            tokens, labels = (t.to(device) for t in data.batch(s * micro_batches + mb))
            losses = eager.step(tokens, labels), step(tokens, labels)
            where = f"step {s + 1} micro-batch {mb + 1}"
            assert torch.equal(*losses), f"{where}: loss {losses[0].item()} vs {losses[1].item()}"
            for (fqn, a), b in zip(eager.buffers.tensors.items(), captured.buffers.tensors.values()):
                assert torch.equal(a, b), f"{where}: buffer {fqn}"
            for spec, a, b in zip(eager.specs, eager.params, captured.params):
                assert torch.equal(a.grad, b.grad), f"{where}: gradient of {spec.fqn}"
        with torch.no_grad():
            for program in (eager, captured):
                for p in program.params:
                    p.sub_(LR * p.grad)
                    p.grad = None
        for spec, a, b in zip(eager.specs, eager.params, captured.params):
            assert torch.equal(a, b), f"after step {s + 1}: parameter {spec.fqn}"
    step.close()
    return decided
