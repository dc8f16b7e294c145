"""One pipeline stage of a decoder (builder/models/decoder.py's Decoder): blocks [start, stop) of
the model, with its embedding on the first stage and its final norm and output projection on the
last. The forward takes what the stage receives (tokens on the first stage, activations on the
others) and returns what it sends on (activations, or the last stage's logits): the module
torch.distributed.pipelining's PipelineStage runs, and what titan traces into a stage program
(the last stage with its labels, so with its loss).

With the document mask (the config's mask 'document', issue 31) every block masks attention to
each token's document, whose ids come from the micro-batch's tokens: a stage past the first,
which receives activations, also takes the micro-batch's tokens (`tokens`) and computes the ids
from them inside its step, as the whole model does (decoder.document_ids). Every pipeline rank
reads the step's micro-batches from its loader anyway (the last stage its labels), so the
boundaries are runtime data on every stage and nothing extra is sent between stages."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titan.builder.models.decoder import document_ids


class DecoderStage(nn.Module):
    """Blocks [start, stop) of `model` (the parameters are the model's own modules: same names).
    `seq_len`: the sequence length RoPE is computed for (default: the input's second dimension,
    which is only the whole sequence without tensor parallelism: sequence parallel shards the
    activations a stage receives); `loss_fn(logits, labels)`: the last stage's loss."""

    def __init__(self, model: nn.Module, start: int, stop: int, *, first: bool, last: bool,
                 seq_len: int | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.seq_len = seq_len
        self.loss_fn = loss_fn or mean_token_loss
        self.rope = model.rope  # the family's tables (Decoder.rope), as the whole model computes them
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(start, stop)})
        self.norm, self.output = (model.norm, model.output) if last else (None, None)
        self.eos_id = model.cfg.eos_id if getattr(model.cfg, "mask", "causal") == "document" else None
        """The token that ends each document (None: the causal mask, no document ids)."""

    @property
    def reads_tokens(self) -> bool:
        """Whether the forward takes the micro-batch's tokens besides the activations it receives
        (a stage past the first, under the document mask)."""
        return self.eos_id is not None and self.tok_embeddings is None

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """Activations on; the last stage's logits, or with `labels` its loss (what a stage
        program of the last stage computes). `tokens`: the micro-batch's tokens, where the
        document mask needs them (reads_tokens; the first stage's `h` is its tokens)."""
        documents = None
        if self.eos_id is not None:
            assert tokens is not None or self.tok_embeddings is not None, "the document mask needs the tokens"
            documents = document_ids(h if self.tok_embeddings is not None else tokens, self.eos_id)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = self.rope(self.seq_len or h.shape[1], h.device)
        for block in self.layers.values():
            h = block(h, cos, sin) if documents is None else block(h, cos, sin, documents=documents)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        return logits if labels is None else self.loss_fn(logits, labels)


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean next-token loss (the loss_fn a pipeline schedule is given)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
