"""Which transformer blocks each pipeline stage holds: balanced by cost, or as the user says.

A stage's cost is the training FLOPs per token of what it runs: its blocks (6 per parameter for
forward and backward, plus attention's 12 x width x sequence), the first stage's embedding
(a lookup and its gradient's scatter-add, 2 x width) and the last stage's norm, output
projection and loss (6 x width x vocabulary, a few blocks' worth at Llama-3 widths). The split is
the contiguous one whose costliest stage is cheapest: the pipeline runs at its slowest stage's pace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class StageCosts:
    """Training FLOPs per token of the pieces a stage can hold (and their parameters, for the
    memory report)."""

    block: tuple[float, ...]
    """Each transformer block's."""
    embedding: float
    """The first stage's embedding."""
    head: float
    """The last stage's final norm, output projection and loss."""
    block_params: tuple[int, ...] = ()
    """Each block's parameter count."""
    embedding_params: int = 0
    """The embedding's."""
    head_params: int = 0
    """The final norm's and the output projection's."""
    block_expert_params: tuple[int, ...] = ()
    """Of each block's parameters, its routed experts' (split over ep x dp-shard ranks, the rest
    over tp x dp-shard); empty: none."""

    def stage(self, start: int, stop: int, *, first: bool, last: bool) -> float:
        return sum(self.block[start:stop]) + first * self.embedding + last * self.head

    def stage_params(self, start: int, stop: int, *, first: bool, last: bool) -> int:
        return sum(self.block_params[start:stop]) + first * self.embedding_params + last * self.head_params

    def stage_expert_params(self, start: int, stop: int) -> int:
        return sum(self.block_expert_params[start:stop])


def dense_decoder_costs(cfg, seq_len: int) -> StageCosts:
    """Costs of a dense decoder whose config gives dim, vocab_size, n_layers and n_params
    (untied embedding and output, as Llama 3)."""
    embedding, head = cfg.vocab_size * cfg.dim, cfg.vocab_size * cfg.dim + cfg.dim
    per_block = (cfg.n_params - embedding - head) // cfg.n_layers
    return StageCosts(block=(6 * per_block + 12 * cfg.dim * seq_len,) * cfg.n_layers,
                      embedding=2 * cfg.dim, head=6 * cfg.vocab_size * cfg.dim,
                      block_params=(per_block,) * cfg.n_layers, embedding_params=embedding, head_params=head)


def decoder_costs(*, dim: int, vocab_size: int, seq_len: int, attention_width: int,
                  blocks: list[tuple[int, int, int]]) -> StageCosts:
    """Costs of a decoder with untied embedding and output whose blocks may differ (dense, or a
    mixture of experts): each block given as (parameters, parameters a token runs through: a MoE
    block's attention, router, shared experts and top-k routed experts, its routed experts'
    parameters). Attention adds 6 x sequence x `attention_width` (the query/key plus value widths
    of all heads) per token."""
    attention = 6 * seq_len * attention_width
    return StageCosts(block=tuple(6 * active + attention for _, active, _ in blocks), embedding=2 * dim,
                      head=6 * vocab_size * dim, block_params=tuple(total for total, _, _ in blocks),
                      embedding_params=vocab_size * dim, head_params=vocab_size * dim + dim,
                      block_expert_params=tuple(routed for _, _, routed in blocks))


def balanced_split(costs: StageCosts, stages: int) -> tuple[int, ...]:
    """Layer counts per stage (each at least one) minimising the costliest stage (exact dynamic
    programming over the cut points; ties are broken the same way every time)."""
    n = len(costs.block)
    assert 1 <= stages <= n
    inf = float("inf")
    # best[s][i]: the costliest stage's cost when stages 0..s-1 hold blocks 0..i-1; cut[s][i]: where stage s-1 starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(i - 1, s - 2, -1):
                worst = max(best[s - 1][j], costs.stage(j, i, first=s == 1, last=s == stages and i == n))
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return tuple(reversed(counts))


def parse_split(text: str, *, stages: int, n_layers: int) -> tuple[int, ...]:
    """`--pp-split 3,2,2,1`: layer counts per stage; ValueError names what is wrong."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-split {text!r}: give one layer count per stage, comma-separated (e.g. 3,1)") from None
    if len(counts) != stages:
        raise ValueError(f"--pp-split {text!r} gives {len(counts)} stage(s); the pipeline has {stages}")
    if min(counts) < 1:
        raise ValueError(f"--pp-split {text!r}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise ValueError(f"--pp-split {text!r} holds {sum(counts)} layers; the model has {n_layers}")
    return counts


def layer_spans(counts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Layer counts -> each stage's [start, stop)."""
    spans, start = [], 0
    for count in counts:
        spans.append((start, start + count))
        start += count
    return tuple(spans)
