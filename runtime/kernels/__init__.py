"""Compiled kernels for fusion regions: compiling a region on the GPU (fusion), the kernel plan
that replays its launches without inductor (kernel_plan), and the recorder that makes a plan
from a compiled region (plan_recorder); FlexAttention's fused kernels on GPUs, compiled and
carried the same way (flex_kernels, from the graphs of flex_graphs, reading the block mask of
flex_block_mask). The only part of the runtime that may import torch._inductor, and only when
an artifact has regions to compile."""
