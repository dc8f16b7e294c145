"""What runs on a rank, and the floors it shares with the builder and the commands.

The run path sits at this folder's root (launch -> train -> run_state, cudagraph, optim, data,
init, checkpoint, ...): titan-run and titan-verify import it to run, and nothing else does.
The floors are subpackages: common (torch-free: interrupts, progress, timings, safe files),
contract (the artifact format), store (content-addressed stores, the build cache among them)
and kernels (compiled fusion regions and kernel plans).
"""
