"""torch.compile(backend="dnngraph", mode="reduce-overhead") on the GPU: every compiled forward
and backward graph recorded once as a CUDA graph and replayed; each replayed step matches eager
torch, batch-norm running statistics included, and dropout draws a new mask on every replay."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dnngraph import torch_backend  # (registers the name "dnngraph" for a checkout)
from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

STEPS = 4  # warm-up, recording, then replays


def _profiled(fn):
    """(fn(), the cudaGraphLaunch calls it made)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")


def _train_steps(model, forward, inputs, grads):
    """Per step: [output, input gradient, parameter gradients, buffers], copied out before the
    next step overwrites the trees' memory; and the CUDA-graph launches of the last step."""
    results, launches = [], 0
    for step, (x, g) in enumerate(zip(inputs, grads)):
        def run(x=x, g=g):
            torch.compiler.cudagraph_mark_step_begin()
            leaf = x.clone().requires_grad_()
            out = forward(model, leaf)
            out.backward(g)
            return out, leaf

        (out, leaf), launches = _profiled(run) if step == len(inputs) - 1 else (run(), 0)
        results.append([out.detach().clone(), leaf.grad.clone()] + [p.grad.clone() for p in model.parameters()]
                       + [b.clone() for b in model.buffers() if b.is_floating_point()])
        model.zero_grad()
    return results, launches


def _compare_replayed(model, forward, inputs, grads, tolerance):
    """Eager and reduce-overhead runs of the same steps from the same weights agree step by step;
    the last step replays CUDA graphs (forward and backward) and nothing was left unrecorded."""
    eager_model = copy.deepcopy(model)
    want, _ = _train_steps(eager_model, forward, inputs, grads)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, backend="dnngraph", dynamic=False, mode="reduce-overhead")
    got, launches = _train_steps(model, compiled, inputs, grads)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert launches >= 2, launches  # the forward's graph and the backward's
    for step, (mine, theirs) in enumerate(zip(got, want)):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            assert rel_err(a, b) < tolerance, (step, index, rel_err(a, b))


def test_replayed_cnn_training_steps_match_eager_with_batch_norm_statistics():
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(32, 24, 3, padding=1, stride=2, bias=False), torch.nn.BatchNorm2d(24),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(24 * 4 * 4, 10),
    ).to(device="cuda", memory_format=torch.channels_last)  # (no conv bias: a batch norm's mean takes it)
    # float32 (no TF32): in bf16 a rounding apart routes a max pool's gradient (ties at ReLU's zeros)
    # elsewhere, in eager as much as here
    inputs = [torch.randn(8, 16, 15, 15, device="cuda").to(memory_format=torch.channels_last) for _ in range(STEPS)]
    grads = [torch.randn(8, 10, device="cuda") for _ in range(STEPS)]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # eager's convolutions in float32 too
    try:
        _compare_replayed(model, lambda m, x: m(x), inputs, grads, 2e-2)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def test_replayed_llama_layer_training_steps_match_eager():
    from llama_layer import make_layer

    torch.manual_seed(6)
    layer, forward, _ = make_layer(256, 4, 2, 512, torch.bfloat16, "cuda")
    inputs = [torch.randn(2, 63, 256, device="cuda", dtype=torch.bfloat16) for _ in range(STEPS)]
    grads = [torch.randn(2, 63, 256, device="cuda", dtype=torch.bfloat16) for _ in range(STEPS)]
    _compare_replayed(layer, forward, inputs, grads, 3e-2)


@pytest.mark.parametrize("how", [{"mode": "reduce-overhead"}, {"options": {"cudagraphs": True}}])
def test_replayed_inference_returns_each_calls_result(how):
    """No-grad calls replay one recorded graph; each result (copied before the next call) is its
    own input's, not the last recorded one's."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 33)).cuda().half()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="dnngraph", dynamic=False, **how)
    with torch.no_grad():
        for step in range(STEPS):
            x = torch.randn(17, 64, device="cuda", dtype=torch.half)
            torch.compiler.cudagraph_mark_step_begin()
            got, launches = _profiled(lambda: compiled(x).clone())
            assert rel_err(got, model(x)) < 1e-2
    assert launches == 1 and not counters["inductor"]["cudagraph_skips"]


def test_replayed_dropout_draws_a_new_mask_per_step_and_the_backward_reads_it():
    p = 0.3

    def drop(x):
        return torch.nn.functional.dropout(x * 2.0, p=p, training=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(drop, backend="dnngraph", dynamic=False, mode="reduce-overhead")
    x = torch.randn(64, 257, device="cuda") + 3.0  # no zeros: a zero output is a dropped element
    masks = []
    for step in range(STEPS):
        torch.compiler.cudagraph_mark_step_begin()
        leaf = x.clone().requires_grad_()
        out = compiled(leaf)
        out.backward(torch.ones_like(out))
        kept = out.detach() != 0
        torch.testing.assert_close(out.detach()[kept], (x * 2.0 / (1 - p))[kept])
        torch.testing.assert_close(leaf.grad, kept.float() * 2.0 / (1 - p))
        assert abs(kept.float().mean().item() - (1 - p)) < 0.03
        masks.append(kept.clone())
    assert not counters["inductor"]["cudagraph_skips"]
    assert all(not torch.equal(masks[i], masks[i + 1]) for i in range(STEPS - 1))


def test_a_graph_reading_a_cpu_tensor_runs_without_replay_and_stays_right():
    """A CPU scalar read by the graph: nothing is recorded (a CPU op would run only while
    recording), every call reads the scalar's current value, and the skip is counted."""
    scale = torch.tensor(1.0)

    def scaled(x):
        return torch.relu(x) * scale + 1.0

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(scaled, backend="dnngraph", dynamic=False, mode="reduce-overhead")
    x = torch.randn(33, 65, device="cuda")
    for step in range(STEPS):
        scale.fill_(step + 2.0)
        torch.compiler.cudagraph_mark_step_begin()
        torch.testing.assert_close(compiled(x).clone(), scaled(x))
    assert counters["inductor"]["cudagraph_skips"] >= 1
