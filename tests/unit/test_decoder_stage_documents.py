"""Pipeline stages under FlexAttention's document mask (builder/models/decoder_stage.py, issue 31):
a stage past the first takes the micro-batch's tokens beside the activations it receives and
computes the document ids from them, so a Llama 3 model's stages run one after another compute
exactly (torch.equal) the whole model's loss and gradients; a stage's traced program computes
exactly what the stage does. (Trained through titan's pipeline against torch.distributed.pipelining:
e2e/test_pipeline_flex.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan.builder.models.decoder import ScaledTokenLoss
from titan.builder.models.decoder_stage import DecoderStage
from titan.builder.models.llama3.config import FLAVORS
from titan.builder.models.llama3.model import Llama3
from titan.builder.trace.stage_trace import trace_stage
from titan.runtime.contract.graph_decode import load_graph

EOS = 511
CFG = dataclasses.replace(FLAVORS["debug"], n_layers=3, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512,
                          attention="flex", mask="document", eos_id=EOS)
ROWS, SEQ = 2, 16
SPANS = ((0, 1), (1, 2), (2, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens with separators at other places in each row, and labels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOS, (ROWS, SEQ), generator=g)
    for row in range(ROWS):
        tokens[row, torch.randperm(SEQ, generator=g)[:3]] = EOS
    return tokens, torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)


def _model(cfg=CFG) -> Llama3:
    torch.manual_seed(0)
    model = Llama3(cfg)
    model.loss_scale = float(ROWS * SEQ)
    return model


def _stages(model: Llama3) -> list[DecoderStage]:
    return [DecoderStage(model, a, b, first=a == 0, last=b == CFG.n_layers, loss_fn=ScaledTokenLoss(model.loss_scale))
            for a, b in SPANS]


def _pipelined(model: Llama3, tokens: torch.Tensor, labels: torch.Tensor, *, give_tokens: bool = True):
    """The loss and gradients of the stages run in turn, each later stage given the tokens."""
    model.zero_grad()
    first, *later = _stages(model)
    h = first(tokens)
    for stage in later:
        h = stage(h, tokens=tokens if give_tokens else None, labels=labels if stage.output is not None else None)
    h.backward()
    return h.detach(), [p.grad.clone() for p in model.parameters()]


def test_stages_run_in_turn_compute_exactly_the_whole_models_masked_loss_and_gradients():
    tokens, labels = _batch(1)
    model = _model()
    assert [s.reads_tokens for s in _stages(model)] == [False, True, True]
    loss, grads = _pipelined(model, tokens, labels)
    model.zero_grad()
    whole = model(tokens, labels)
    whole.backward()
    assert torch.equal(loss, whole.detach())
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    # The mask is in effect: the causal model's loss on the same weights and tokens is another.
    causal = _model(dataclasses.replace(CFG, mask="causal", eos_id=None))
    assert not torch.equal(causal(tokens, labels), whole)


def test_a_later_stage_without_the_tokens_is_refused():
    tokens, labels = _batch(1)
    with pytest.raises(AssertionError, match="the document mask needs the tokens"):
        _pipelined(_model(), tokens, labels, give_tokens=False)


def test_a_later_stages_traced_program_computes_exactly_what_the_stage_does():
    """The last stage's program takes (activations, tokens, labels): the ids come from the tokens
    inside the graph, so other boundaries need no new trace."""
    with torch.device("meta"):
        meta = Llama3(CFG)
    model = _model()
    stage = _stages(model)[2]
    program = trace_stage(DecoderStage(meta, *SPANS[2], first=False, last=True), inputs=("activations", "tokens", "labels"),
                          micro_batch=(ROWS, SEQ), dim=CFG.dim)
    named = dict(stage.named_parameters())
    fw = load_graph(program.forward, device=torch.device("cpu"), groups={})
    h = torch.randn(ROWS, SEQ, CFG.dim, generator=torch.Generator().manual_seed(3))
    for seed in (1, 2):  # other boundaries, the same graph
        tokens, labels = _batch(seed)
        with torch.no_grad():
            loss, *_ = fw(*(named[p].detach() for p in program.params), h, tokens, labels)
            assert torch.equal(loss, stage(h, tokens=tokens, labels=labels))
