"""On a CUDA GPU: DeepSeek-V3's whole step, expert-parallel dispatch included, captures in a CUDA
graph and replays as the eager step does."""

from __future__ import annotations

import pytest
import torch

from deepseek_debug import CFG, debug_batch, debug_weights
from titan.builder.models.moe.expert_parallel import set_dispatch
from titan.builder.models.deepseek_v3.model import DeepSeekV3


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_step_captures_in_a_cuda_graph(dtype):
    """The whole step, dispatch included, captures in a CUDA graph (a host sync would abort the
    capture) and one replay equals one eager step: the loss and the MoE buffers (balancing bias,
    loads) exactly, the gradients to rounding (the CUDA attention backward accumulates
    atomically)."""
    cuda = torch.device("cuda")
    probe = (torch.zeros(8, 16, device=cuda, dtype=dtype), torch.zeros(2, 16, 16, device=cuda, dtype=dtype),
             torch.tensor([4, 8], device=cuda, dtype=torch.int32))
    try:  # aten's CUDA grouped GEMM: bfloat16 kernels; other dtypes may be missing or sync on the host
        torch._grouped_mm(*probe[:2], offs=probe[2])
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch._grouped_mm(*probe[:2], offs=probe[2])
    except RuntimeError as e:
        pytest.skip(f"this torch's CUDA grouped GEMM cannot run {dtype} in a CUDA graph: {e}")
    state, batch = debug_weights(), {k: v.to(cuda) for k, v in debug_batch().items()}

    def make() -> DeepSeekV3:
        model = DeepSeekV3(CFG)
        model.load_state_dict(state, strict=False)
        model.to(device=cuda, dtype=dtype)
        for moe in model.moe_layers():
            moe.expert_bias.data = moe.expert_bias.float()
        model.loss_scale = float(batch["tokens"].numel())
        set_dispatch(model, tokens=batch["tokens"].numel())
        return model

    def step(model: DeepSeekV3) -> torch.Tensor:
        loss = model(batch["tokens"], batch["labels"])
        loss.backward()
        return loss

    eager, captured = make(), make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocates the gradients), on both models alike
        for model in (eager, captured):
            step(model)
            for p in model.parameters():
                p.grad.zero_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step(captured)
    graph.replay()
    eager_loss = step(eager)
    torch.cuda.synchronize()
    assert torch.equal(captured_loss, eager_loss)
    for (name, a), b in zip(captured.named_buffers(), eager.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(captured.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"{name}: {m}")
