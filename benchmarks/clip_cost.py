"""What clipping by global norm costs a step: GlobalNormClip (runtime/grad_clip.py) over one
rank's gradients of an artifact, timed alone on the GPU (CUDA events, median of 50): with its multiplication, and without it
(as the captured update runs it, the one-kernel AdamW multiplying as it reads).

    python benchmarks/clip_cost.py ARTIFACT [--rank R]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from titan.runtime.contract.artifact import open_artifact
from titan.runtime.grad_clip import GlobalNormClip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    specs = open_artifact(args.artifact).rank_record(args.rank).params
    grads = [torch.randn(p.local_shape, device="cuda") for p in specs]
    clip = GlobalNormClip([{} for _ in specs], None, max_norm=1.0)  # one rank: the local work only
    numel = sum(g.numel() for g in grads)

    def timed(work) -> float:
        times = []
        for _ in range(60):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[10:])

    # The clip as the op-by-op path runs it (norm, then a pass multiplying every gradient), and
    # the norm alone: what is left when the one-kernel AdamW multiplies by the coefficient itself.
    print(f"clip: {len(grads)} gradients, {numel / 1e6:.0f} M elements: norm and multiply "
          f"{timed(lambda: clip(grads)):.3f} ms, norm alone (the multiply folded into AdamW) "
          f"{timed(lambda: clip.norm_and_coef(grads)):.3f} ms (medians of 50)")

if __name__ == "__main__":
    main()
