"""Whether the model titan-build picked by default can train on the host building it: the
default flavor is sized for GPUs (Llama 3 8B), and a user who left out --flavor on a laptop
should hear so before a run tries (issue 33)."""

from __future__ import annotations

from titan.runtime.contract.memory_estimate import GIB, PARAM_STATE_BYTES, gpu_memory, host_memory


def default_flavor_warning(spec) -> str | None:
    """One line when the spec's model (a default flavor) cannot train here: its parameters,
    gradients and AdamW state (16 bytes a parameter, fp32) exceed this host's memory, CPU-only
    host, or one rank's share exceeds a GPU's. None when it fits or nothing is known."""
    n_params = getattr(spec.cfg, "n_params", None)
    if n_params is None:
        return None
    layout = spec.layout
    per_rank = PARAM_STATE_BYTES * n_params / (layout.tp * layout.dp_shard * layout.ep)
    gpus = gpu_memory()
    fix = f"pass --flavor {spec.flavor} to build it for another host, or --flavor debug to train here"
    if gpus:
        if per_rank > min(gpus):
            return (f"--flavor defaults to {spec.flavor} ({n_params / 1e9:.1f}B parameters): about "
                    f"{per_rank / GIB:.0f} GIB per rank for parameters, gradients and AdamW state alone, more than "
                    f"a GPU here has ({min(gpus) / GIB:.0f} GIB); {fix}")
        return None
    memory = host_memory()
    if memory is None or per_rank * layout.world_size <= memory[0]:
        return None
    return (f"--flavor defaults to {spec.flavor} ({n_params / 1e9:.1f}B parameters): about {per_rank / GIB:.0f} GIB "
            f"per rank for parameters, gradients and AdamW state alone, and this host has no GPU and "
            f"{memory[0] / GIB:.0f} GIB; {fix}")
