"""titan-export: a titan checkpoint as a Hugging Face model directory (single process, no GPU)."""

from __future__ import annotations

from pathlib import Path

import click

from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath


@click.command(cls=Command)
@click.argument("checkpoint", type=NonEmptyPath(file_okay=False))
@click.option("--hf", "out", required=True, type=NonEmptyPath(file_okay=False),
              help="New directory for config.json + model.safetensors.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]),
              help="Element type of the written weights (the checkpoint holds fp32).")
def main(checkpoint, out, dtype):
    """Write CHECKPOINT (a --checkpoint-dir, for its latest step, or one step-N directory) in
    Hugging Face's layout (LlamaForCausalLM, DeepseekV3ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)."""
    from titan.runtime.checkpoint_dirs import resolve_checkpoint

    out = Path(out)
    if out.exists():
        raise ValueError(f"--hf {out} already exists; choose a new directory (titan-export never overwrites)")
    step_dir = resolve_checkpoint(checkpoint, flag="titan-export", step_dir_ok=True)  # before torch is imported
    from titan.runtime.checkpoint import load_full, read_state
    from titan.runtime.contract.hf_record import RECORD, hf_record
    from titan.runtime.hf_weights import export_hf

    description = read_state(step_dir)
    # Buffers a checkpoint of the model holds (a MoE balancing bias) are exported with the weights.
    held = frozenset(hf_record(description, "titan-export").names) if description.get(RECORD) else frozenset()
    description, tensors = load_full(step_dir, float_buffers=held)
    export_hf(out, description, tensors, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    click.echo(f"wrote {out} ({len(tensors)} tensors, {dtype}) from {step_dir} (step {description['step']})")


if __name__ == "__main__":
    main()
