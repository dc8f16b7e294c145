"""Compiled kernels for fusion regions: compiling a region on the GPU (fusion), the kernel plan
that replays its launches without inductor (kernel_plan), and the recorder that makes a plan
from a compiled region (plan_recorder). The only part of the runtime that may import
torch._inductor, and only when an artifact has regions to compile."""
