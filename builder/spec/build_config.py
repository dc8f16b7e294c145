"""A build's configuration: every titan-build option, defined once.

cli/config_options.py makes each field a titan-build option (and a key of `--config job.toml`,
section [build]); the field's docstring is its help. builder/build.py's make_spec checks the
values that make the artifact. A config is data: it does no work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan.runtime.common.config_fields import setting


@dataclass(kw_only=True, slots=True)
class BuildConfig:
    model: str = "llama3"
    """Model family: llama3, deepseek_v3 or qwen3."""
    flavor: str | None = None
    """Model size: llama3: debug, 1B, 8B (default), 70B, 405B; deepseek_v3: debug, 16B (default), 671B, 16B-4L; qwen3: debug, 0.6B, 1.7B, 4B, 8B (default), 14B, 32B, debug-moe, 30B-A3B, 235B-A22B."""
    tp: int = setting(1, check="positive")
    """Tensor-parallel degree (with sequence parallel)."""
    dp_shard: int = setting(1, check="positive")
    """FSDP degree."""
    dp_replicate: int = setting(1, check="positive")
    """Replicated data-parallel degree."""
    ep: int = setting(1, check="positive")
    """Expert-parallel degree (mixture-of-experts models): routed experts split over this many ranks, which are data parallel for everything else."""
    etp: int = setting(1, check="positive")
    """Expert tensor-parallel degree (mixture-of-experts models): 1 (each routed expert whole on its --ep rank, replicated over tp) or the --tp degree (each routed expert's hidden width split over the tp ranks, which then route the whole sequence alike: expert memory / tp, for an all-gather and a reduce-scatter per MoE layer and tp times the all-to-all rows)."""
    pp: int = setting(1, check="positive")
    """Pipeline-parallel degree: the layers split into this many stages, one per pp coordinate (llama3; composes with --dp-replicate, --dp-shard and --tp); each stage is traced as a program of its own and the schedule is stored in the artifact (docs/pipeline.md)."""
    microbatches: int | None = setting(None, check="positive")
    """Micro-batches per step with --pp, each of --batch-size sequences (default: --pp)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"] | None = None
    """Pipeline schedule with --pp: gpipe (all forwards, then all backwards), 1f1b (default: at most pp - s micro-batches in flight on stage s), interleaved-1f1b (several stages per rank: a smaller bubble) or zbv (zero bubble, V-shaped: 2 stages per rank, the backward split into input and weight gradients, the weight part filling the bubble)."""
    pp_stages_per_rank: int | None = setting(None, check="positive")
    """Stages per pp rank with --pp-schedule interleaved-1f1b (default 2; rank r holds stages r, r + pp, ...); zbv holds 2 (stages r and 2 pp - 1 - r)."""
    pp_split: str | None = None
    """Transformer blocks per pipeline stage, comma-separated, e.g. 3,1 (default: balanced by cost, the embedding and the output counted)."""
    pp_plan: bool = False
    """Print the pipeline's stage split and each pp rank's actions, and exit (nothing is traced)."""
    batch_size: int | None = setting(None, check="positive")
    """Sequences per data-parallel rank in one micro-batch (default: 2 debug, 1 otherwise)."""
    seq_len: int | None = setting(None, check="seq_len")
    """Tokens per sequence (default: 128 debug, 8192 otherwise)."""
    dtype: Literal["bf16", "fp32"] | None = None
    """Compute dtype: bf16 (default; fp32 for the debug flavor) or fp32. Parameters and optimizer state stay fp32."""
    passes: str | None = None
    """Graph passes after partitioning, comma-separated, in order ('' for none; default: the numerics-preserving set). --list-passes shows them."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing: recompute block activations in the backward (full), or all but matmul/attention outputs (selective)."""
    fuse: Literal["regions", "blocks"] | None = setting(None, flag_value="blocks")
    """Fused kernels that titan-run generates on its GPU (faster; numerics differ from eager in the last bits): 'blocks' (a bare --fuse): all element-wise and reduction work between matmuls, attention and collectives; 'regions': only within RMSNorm, RoPE, SwiGLU and the loss."""
    moe_capacity: float | None = setting(None, check="positive_float")
    """Mixture of experts: size the token-dispatch buffers for this capacity factor (1.25: a quarter over the balanced load) instead of the dropless worst case. Still dropless: a step whose routing overflows a buffer is detected on the device and redone by the dropless program the artifact also carries (one scalar read per micro-batch)."""
    moe_drop: bool = False
    """With --moe-capacity: drop the assignments past a buffer's capacity instead of redoing the step (changes numerics; titan-verify needs --moe-drop to accept it)."""
    list_passes: bool = False
    """Describe the available passes and exit."""
    partitioner: Literal["min_cut", "default"] = "min_cut"
    """Forward/backward partitioner."""
    out: str | None = setting(None, check="path")
    """Output directory (default: artifacts/<name>, the name spelling out every non-default choice)."""
    replace: bool = False
    """Replace the artifact at --out even if it is of another build."""
    jobs: int | None = setting(None, check="positive")
    """Ranks traced in parallel (default: CPU count)."""
    cache_dir: str | None = setting(None, check="dir")
    """Build cache (default: $TITAN_CACHE_DIR or ~/.cache/titan)."""
    explain: bool = False
    """On a cache miss, list every factor that differs from the nearest entry."""
    kernels: bool = False
    """Also compile the fusion kernels on this host's GPU (one GPU of the kind the job will use) into the cache entry and the artifact, so that no rank compiles at start-up."""
    gpu: str | None = None
    """With --kernels: build them without a GPU, for this GPU model (h100, h200); needs the CUDA build of the torch release the GPU hosts run, and its triton (they install without a GPU)."""
    sign: str | None = setting(None, check="file")
    """Sign the artifact's manifest with this key file (made, mode 0600, if missing) instead of your own cache key: titan-run --trust KEYFILE then loads the compiled kernels it carries."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa (causal scaled-dot-product attention), or flex (FlexAttention, with --mask); every model."""
    mask: Literal["causal", "document"] = "causal"
    """Attention mask with --attention flex: causal, or document (each token attends to earlier tokens of its own document, found from --eos-id in each batch, inside the step)."""
    eos_id: int | None = setting(None, check="non_negative")
    """With --mask document: the token id that ends each document (titan-data prints it as 'separator id N')."""
    n_layers: int | None = setting(None, check="positive")
    """Transformer blocks (default: the flavor's)."""
    dim: int | None = setting(None, check="positive")
    """Model width (default: the flavor's)."""
    n_heads: int | None = setting(None, check="positive")
    """Attention (query) heads (default: the flavor's)."""
    n_kv_heads: int | None = setting(None, check="positive")
    """Key/value heads, llama3 and qwen3 (default: the flavor's)."""
    vocab_size: int | None = setting(None, check="positive")
    """Vocabulary: embedding rows and logits, e.g. your tokenizer's (default: the flavor's)."""
    ffn_dim: int | None = setting(None, check="positive")
    """Feed-forward hidden width, llama3 (default: derived from the width as Llama 3 does)."""

