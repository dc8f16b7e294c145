"""One rank of tests/e2e/test_kernels_in_background.py: a job whose first rank waits for kernels
compiled in the background (runtime/kernels/background.py) while the other waits for nothing.

argv: ARTIFACT STORE (the worker's kernel store). Trains with the wait (a plain SGD update, op by
op): rank 0's "kernels" come from a real compile-worker process given no job (it starts, imports
and answers, as a worker does), so the job switches at a step it cannot know in advance; after
the switch it trains two more steps. Then as many steps from the same seed without the wait.
Prints one JSON line: the losses of both runs (float.hex), the step each rank's wait ended at,
and whether rank 0's worker was done when it did.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import torch
import torch.distributed as dist

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.data import SyntheticTokens
from titan.runtime.kernels.background import KernelsInBackground, KernelWait
from titan.runtime.kernels.compile_workers import Workers
from titan.runtime.kernels.fusion import KernelSources
from titan.runtime.train import GraphProgram

CPU = torch.device("cpu")
LR = 1e-2


def train(program: GraphProgram, data, steps: int | None, *, until_switch: bool = False) -> tuple[list[str], int | None]:
    losses, switched_at, step = [], None, 0
    deadline = time.monotonic() + 240
    while (steps is not None and step < steps) or (until_switch and (switched_at is None or step < switched_at + 2)):
        step += 1
        pending = program.kernels_pending
        tokens, labels = data.batch(step - 1)
        loss = program.step(tokens, labels)
        if pending and not program.kernels_pending:
            switched_at = step
        with torch.no_grad():
            for p in program.params:
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item().hex())
        assert time.monotonic() < deadline, "the wait never ended"
    return losses, switched_at


def main() -> None:
    artifact, store = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    art = open_artifact(artifact)
    mesh = art.layout.build_mesh("cpu")

    def program() -> GraphProgram:
        return GraphProgram(art, rank, device=CPU, mesh=mesh, seed=0)

    def data(p: GraphProgram) -> SyntheticTokens:
        m = art.manifest
        return SyntheticTokens(vocab_size=m.vocab_size, batch_size=m.batch_size, seq_len=m.seq_len, seed=0,
                               dp_rank=m.layout.dp_rank(p.coords))

    waiting = program()
    mine = None
    if rank == 0:
        worker = subprocess.Popen([sys.executable, "-m", "titan.runtime.kernels.compile_workers"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        payload = msgpack.packb({"device": "cpu", "store": store, "jobs": []}, use_bin_type=True)
        mine = KernelsInBackground((waiting.forward, waiting.backward), CPU, KernelSources(device=CPU),
                                   Workers([worker], [payload], jobs=0))
    waiting.kernel_wait = KernelWait(mine, CPU)
    assert waiting.kernels_pending  # rank 1 too: a peer waits
    installed = []
    waiting.on_kernels = installed.append
    losses, switched_at = train(waiting, data(waiting), None, until_switch=True)
    reference = program()
    expected, _ = train(reference, data(reference), len(losses))
    print(json.dumps({"rank": rank, "reference": expected, "losses": losses, "switched_at": switched_at,
                      "installed": len(installed), "worker_done": mine is None or mine.workers.done()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
