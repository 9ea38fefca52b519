"""One built graph executed from many threads at once, on their own streams or one shared stream,
with the plan's workspaces or the caller's: every result equals a single-threaded run."""
import threading

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import poisoned

pytestmark = pytest.mark.gpu
CUDA = "cuda"
THREADS, STEPS = 8, 50
INPUT_SETS = 2  # per thread, alternated: a result from another execute cannot pass as right


def _colsoftmax_rmsnorm():
    g = dg.Graph(name="colsoftmax_rmsnorm")
    x = g.tensor(name="x", dim=[2047, 1023])
    scale = g.tensor(name="scale", dim=[1, 1023])
    g.rmsnorm(g.softmax(x, axis=0), scale)[0].set_output(True)
    return g


def _split_layernorm():
    g = dg.Graph(name="split_layernorm")
    x = g.tensor(name="x", dim=[67, 30001])
    scale, bias = g.tensor(name="scale", dim=[1, 30001]), g.tensor(name="bias", dim=[1, 30001])
    y, mean, inv_variance = g.layernorm(g.mul(x, x), scale, bias)
    for tensor in (y, mean, inv_variance):
        tensor.set_output(True)
    return g


def _split_k_matmul():
    g = dg.Graph(name="split_k", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[129, 4096]), g.tensor(name="b", dim=[4096, 257])
    bias = g.tensor(name="bias", dim=[1, 257])
    g.gelu(g.add(g.matmul(a, b), bias)).set_output(True)
    return g


def _persistent_batched_matmul():
    g = dg.Graph(name="persistent", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[3, 1000, 512]), g.tensor(name="b", dim=[3, 512, 768])
    g.softmax(g.relu(g.matmul(a, b)), axis=2).set_output(True)
    return g


def _pointwise_chain():
    g = dg.Graph(name="pointwise_chain")
    x, w = g.tensor(name="x", dim=[513, 1027]), g.tensor(name="w", dim=[1, 1027])
    h = g.gelu(g.add(g.mul(x, w), x))
    total = g.reduction(h, "sum", [1])
    g.tanh(g.div(h, g.add(g.abs(total), g.exp(h)))).set_output(True)
    return g


GRAPHS = {"colsoftmax_rmsnorm": _colsoftmax_rmsnorm, "split_layernorm": _split_layernorm,
          "split_k_matmul": _split_k_matmul, "persistent_batched_matmul": _persistent_batched_matmul,
          "pointwise_chain": _pointwise_chain}
# the configs the graphs are built with where the model would choose others
OPTIONS = {"split_layernorm": dg.BuildOptions(row_mode="split"),
           "split_k_matmul": dg.BuildOptions(matmul_config=mm.MatmulConfig("split_k", 64, 64, 64, 4, 4, split_k=4)),
           "persistent_batched_matmul":
               dg.BuildOptions(matmul_config=mm.MatmulConfig("persistent", 128, 256, 64, 8, 3))}


def _random_inputs(g, generator):
    inputs = {}
    for tensor in g.inputs():
        values = torch.randn(tensor.dim, generator=generator)
        if tensor.name in ("b", "scale"):
            values = values / 16 if tensor.name == "b" else values.abs() + 0.5
        inputs[tensor.name] = values.to(CUDA, tensor.data_type.torch_dtype)
    return inputs


def _outputs(g):
    return {t.name: poisoned(t, CUDA) for t in g.outputs()}


def _single_threaded(g, input_sets):
    expected = []
    for inputs in input_sets:
        outputs = _outputs(g)
        g.execute({**inputs, **outputs})
        expected.append(outputs)
    torch.cuda.synchronize()
    return expected


def _hammer(g, input_sets, streams: str, caller_workspace: bool, steps: int) -> list:
    """Run THREADS threads of `steps` executes; returns (thread, step, outputs) of each."""
    results, errors = [], []
    size = g.plan.workspace_size(CUDA)
    barrier = threading.Barrier(THREADS)

    def work(thread):
        try:
            stream = torch.cuda.Stream() if streams == "own" else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                barrier.wait()
                for step in range(steps):
                    outputs = _outputs(g)
                    workspace = torch.empty(size, dtype=torch.uint8, device=CUDA) if caller_workspace else None
                    g.execute({**input_sets[thread][step % INPUT_SETS], **outputs}, workspace=workspace)
                    results.append((thread, step, outputs))
            stream.synchronize()
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    assert not errors, errors
    return results


def _mismatches(results, expected) -> list:
    wrong = []
    for thread, step, outputs in results:
        for name, out in outputs.items():
            want = expected[thread][step % INPUT_SETS][name]
            if not torch.equal(torch.nan_to_num(out), torch.nan_to_num(want)):
                wrong.append((thread, step, name, (out.double() - want.double()).abs().max().item()))
    return wrong


@pytest.fixture(params=sorted(GRAPHS))
def built(request):
    g = GRAPHS[request.param]().build(options=OPTIONS.get(request.param))
    assert g.plan.workspace_size(CUDA) > 0, f"{request.param}: no workspace, nothing shared to race on"
    return request.param, g


@pytest.mark.parametrize("streams,caller_workspace,steps", [("own", False, STEPS), ("shared", False, 20),
                                                           ("own", True, 20)])
def test_threads_and_streams_get_single_threaded_results(built, streams, caller_workspace, steps):
    name, g = built
    if name == "persistent_batched_matmul":
        launch = g.plan.launches[0]
        assert launch.config_text.startswith("persistent") and launch.global_scratch is not None
    if name == "split_layernorm":
        assert any("(split)" in launch.config_text for launch in g.plan.launches)
    generator = torch.Generator().manual_seed(7)
    input_sets = [[_random_inputs(g, generator) for _ in range(INPUT_SETS)] for _ in range(THREADS)]
    expected = [_single_threaded(g, sets) for sets in input_sets]
    results = _hammer(g, input_sets, streams, caller_workspace, steps)
    assert len(results) == THREADS * steps
    wrong = _mismatches(results, expected)
    print(f"{name} streams={streams} caller_workspace={caller_workspace}: "
          f"{len(wrong)} mismatches of {len(results)} executes")
    assert not wrong, wrong[:5]


def test_caller_workspace_on_the_gpu_is_checked():
    g = _colsoftmax_rmsnorm().build()
    inputs = _random_inputs(g, torch.Generator().manual_seed(3))
    size = g.plan.workspace_size(CUDA)
    assert size == g.plan.workspace_bytes
    bad = {"is on cpu": torch.empty(size, dtype=torch.uint8),
           "bytes": torch.empty(size - 1, dtype=torch.uint8, device=CUDA),
           "uint8": torch.empty(size, dtype=torch.float16, device=CUDA)}
    for message, workspace in bad.items():
        outputs = _outputs(g)
        with pytest.raises(dg.ExecutionError, match=message):
            g.execute({**inputs, **outputs}, workspace=workspace)
        torch.cuda.synchronize()
        assert all(torch.isnan(o).all() for o in outputs.values())
    workspace = torch.full((size,), 0xFF, dtype=torch.uint8, device=CUDA)
    outputs = _outputs(g)
    g.execute({**inputs, **outputs}, workspace=workspace)
    (expected,) = _single_threaded(g, [inputs])
    assert all(torch.equal(outputs[k], expected[k]) for k in outputs)
    assert not torch.all(workspace == 0xFF), "the workspace was used"
