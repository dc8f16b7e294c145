"""What clipping by global norm costs a step: GlobalNormClip (runtime/grad_clip.py) over one
rank's gradients of an artifact, timed alone on the GPU (CUDA events, median of 50).

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
    times = []
    for _ in range(60):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        clip(grads)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    numel = sum(g.numel() for g in grads)
    print(f"clip: {len(grads)} gradients, {numel / 1e6:.0f} M elements: {statistics.median(times[10:]):.3f} ms "
          f"(median of 50)")


if __name__ == "__main__":
    main()
