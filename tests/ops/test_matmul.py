"""Matmul family on CPU (interpreter): layouts, batch broadcast, prologues, epilogues, extra
outputs, row exits, every variant, errors, autotune and its cache. On the GPU (marked gpu): bf16
and fp8 (the interpreter's bf16 dot is wrong), every variant at real tile sizes, TMA descriptors,
unaligned bindings, row exits and autotune."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check, poisoned

VARIANTS = {
    "tiled": mm.MatmulConfig("tiled", 32, 32, 16, 4, 2),
    "small_m": mm.MatmulConfig("small_m", 16, 32, 32, 4, 2),
    "split_k": mm.MatmulConfig("split_k", 32, 16, 16, 4, 2, split_k=3),
    "persistent": mm.MatmulConfig("persistent", 32, 32, 16, 4, 2),
    # column subtiles of 16 and TMA stores where the output qualifies (pointer stores elsewhere)
    "persistent_subtiled": mm.MatmulConfig("persistent", 32, 32, 16, 4, 2, epilogue_subtile=2, tma_store=True),
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    """One kernel variant, forced (forced(variant)) whatever the model would pick."""
    return request.param


def forced(variant: str, configs=VARIANTS) -> dg.BuildOptions:
    """Options running kernel variant `variant` (of `configs`) whatever the model would pick."""
    return dg.BuildOptions(matmul_config=configs[variant])


def _storage(shape, layout, dtype, device="cpu"):
    """A tensor of `shape` stored row-major, column-major (last two axes), row- or column-major
    inside a wider buffer (16-byte pitches: descriptors are legal at odd sizes), or strided."""
    rows, cols = shape[-2], shape[-1]
    if layout == "row":
        return torch.randn(shape, device=device).to(dtype)
    if layout == "col":
        return torch.randn(shape[:-2] + [cols, rows], device=device).to(dtype).transpose(-1, -2)
    pitch = -(-(max(rows, cols) + 1) // 64) * 64
    if layout == "padded_row":
        return torch.randn(shape[:-2] + [rows, pitch], device=device).to(dtype)[..., :cols]
    if layout == "padded_col":
        return torch.randn(shape[:-2] + [cols, pitch], device=device).to(dtype)[..., :rows].transpose(-1, -2)
    if layout == "offset_row":  # 16-byte pitch, base 4 bytes past alignment: no TMA on the GPU
        return torch.randn(shape[:-2] + [rows, pitch], device=device).to(dtype)[..., 1:cols + 1]
    return torch.randn(shape[:-2] + [rows * 2, cols * 2], device=device).to(dtype)[..., ::2, ::2]


def _graph(dtype=dg.float32, **kwargs):
    return dg.Graph(name="mm", io_data_type=dtype, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_layout,b_layout", [("row", "row"), ("col", "row"), ("row", "col"),
                                               ("padded_col", "padded_col"), ("padded_row", "padded_row"),
                                               ("offset_row", "padded_row"), ("sliced", "sliced")])
def test_layouts_every_variant(variant, dtype, a_layout, b_layout):
    a_t, b_t = _storage([37, 53], a_layout, dtype), _storage([53, 45], b_layout, dtype)
    g = _graph(dg.dtypes.from_torch(dtype))
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    g.matmul(a, b).set_output(True).set_name("c")
    g.build(options=forced(variant))
    expected = VARIANTS[variant].variant
    if expected == "persistent" and a_layout not in ("padded_row", "padded_col", "offset_row"):
        expected = "tiled"  # odd pitches: no tensor descriptor, the tiled kernel runs
    assert g.plan.launches[0].config_text.startswith(expected)
    check(g, {"a": a_t, "b": b_t}, dtype)


@pytest.mark.parametrize("a_shape,b_shape", [([3, 1, 19, 23], [4, 23, 17]), ([2, 19, 23], [23, 17]),
                                             ([19, 23], [2, 3, 23, 17])])
def test_broadcast_batch(variant, a_shape, b_shape):
    a_t, b_t = torch.randn(a_shape), _storage(b_shape, "col", torch.float32)
    g = _graph()
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    c = g.matmul(a, b).set_output(True)
    assert c.dim == torch.broadcast_shapes(a_t.shape[:-2], b_t.shape[:-2]) + (a_t.shape[-2], b_t.shape[-1])
    check(g, {"a": a_t, "b": b_t}, options=forced(variant))


def _problem(g) -> str:
    """The GEMM a built one-matmul graph poses: "batch B x MxNxK"."""
    reason = g.plan.launches[0].reason
    return reason[reason.index("batch"):].split(" fp32")[0]


def _storage_strided(shape, order):
    """A tensor of `shape` laid out with its axes nested as `order` (outermost first)."""
    return torch.randn([shape[i] for i in order]).permute([order.index(i) for i in range(len(shape))])


# (a's shape, a's axis order in memory, residual's shape, expected GEMM): the batches of a shared
# weight are one GEMM of batch x M rows where every operand's batch axes merge with its rows
FOLDS = [
    ([3, 5, 7], [0, 1, 2], [3, 5, 9], "batch 1 x 15x9x7"),
    ([2, 1, 3, 5, 7], [0, 1, 2, 3, 4], [2, 1, 3, 5, 9], "batch 1 x 30x9x7"),  # a size-1 axis between
    ([3, 1, 7], [0, 1, 2], [3, 1, 9], "batch 1 x 3x9x7"),  # M = 1: the batch stride is the row's
    ([3, 5, 7], [1, 0, 2], [3, 5, 9], "batch 3 x 5x9x7"),  # rows outside batches: no single stride
    ([3, 5, 7], [0, 1, 2], [1, 5, 9], "batch 3 x 5x9x7"),  # a residual shared by the batches
    ([3, 5, 7], [0, 2, 1], [3, 5, 9], "batch 3 x 5x9x7"),  # A column-major per batch: rows 1 apart, batches 35
    ([3, 5, 7], [2, 0, 1], [3, 5, 9], "batch 1 x 15x9x7"),  # A column-major over all batches' rows
]


@pytest.mark.parametrize("a_shape,order,residual_shape,expected", FOLDS)
def test_batches_of_a_shared_weight_fold_into_rows(variant, a_shape, order, residual_shape, expected):
    """y = silu(a @ w + bias) + residual with its row sum: the batched GEMM runs as one GEMM of
    batch x M rows where a's, the residual's, y's and the sums' batch axes merge with their rows;
    the numbers are the same either way."""
    g = _graph()
    a_t = _storage_strided(a_shape, order)
    w_t, bias_t, residual_t = torch.randn(7, 9), torch.randn(9), torch.randn(residual_shape)
    a, w = g.tensor_like(a_t, name="a"), g.tensor_like(w_t, name="w")
    bias, residual = g.tensor_like(bias_t, name="bias"), g.tensor_like(residual_t, name="residual")
    y = g.add(g.silu(g.add(g.matmul(a, w), bias)), residual).set_output(True).set_name("y")
    g.reduction(y, "sum", [len(a_shape) - 1]).set_output(True).set_name("rows")
    g.build(options=forced(variant))
    assert len(g.plan.groups) == 1 and _problem(g) == expected
    check(g, {"a": a_t, "w": w_t, "bias": bias_t, "residual": residual_t})


def test_batched_b_never_folds():
    g = _graph()
    a, b = g.tensor(name="a", dim=[3, 5, 7]), g.tensor(name="b", dim=[3, 7, 9])
    g.matmul(a, b).set_output(True).set_name("c")
    g.build()
    assert _problem(g) == "batch 3 x 5x9x7"
    check(g, {"a": torch.randn(3, 5, 7), "b": torch.randn(3, 7, 9)})


BIASES = {"row": [29, 1], "col": [1, 31], "full": [29, 31], "scalar": [1, 1]}
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "elu", "leaky_relu"]


@pytest.mark.parametrize("bias_kind", sorted(BIASES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_activation_epilogue(bias_kind, activation):
    g = _graph()
    a, b = g.tensor(name="a", dim=[29, 40]), g.tensor(name="b", dim=[40, 31])
    bias = g.tensor(name="bias", dim=BIASES[bias_kind])
    getattr(g, activation)(g.add(g.matmul(a, b), bias)).set_output(True).set_name("y")
    g.build()
    assert len(g.plan.launches) == 1
    check(g, {"a": torch.randn(29, 40), "b": torch.randn(40, 31), "bias": torch.randn(BIASES[bias_kind])})


def test_residual_scale_cast_and_extra_outputs(variant):
    """pre-activation and the fp32 product stored beside the fp16 result, one main kernel."""
    g = _graph()
    a, b = g.tensor(name="a", dim=[2, 33, 40]), g.tensor(name="b", dim=[40, 35])
    bias, residual = g.tensor(name="bias", dim=[1, 35]), g.tensor(name="residual", dim=[2, 33, 35])
    alpha = g.tensor(name="alpha", dim=[1, 1, 1])
    product = g.matmul(a, b).set_output(True).set_name("product")
    pre = g.add(product, bias).set_output(True).set_name("pre")
    y = g.add(g.mul(g.gelu(pre), alpha), residual)
    g.cast(y, data_type=dg.float16).set_output(True).set_name("y16")
    g.build(options=forced(variant))
    assert [l.group.kind for l in g.plan.launches].count("matmul") == len(g.plan.launches)
    assert len({id(l.group) for l in g.plan.launches}) == 1
    inputs = {"a": torch.randn(2, 33, 40), "b": torch.randn(40, 35), "bias": torch.randn(1, 35),
              "residual": torch.randn(2, 33, 35), "alpha": torch.tensor([[[0.7]]])}
    outputs = check(g, inputs, tolerance=2e-3)
    assert outputs["y16"].dtype == torch.float16


@pytest.mark.parametrize("mode", ["amax", "sum", "mean", "max", "norm2"])
def test_row_reduction_exit(variant, mode):
    """A reduction over N of an epilogue value rides the matmul: partials per N tile, one fold."""
    g = _graph()
    a, b = g.tensor(name="a", dim=[2, 37, 24]), g.tensor(name="b", dim=[24, 70])
    y = g.silu(g.matmul(a, b)).set_output(True).set_name("y")
    g.reduction(y, mode, [2]).set_output(True).set_name("row")
    g.build(options=forced(variant))
    assert len(g.plan.groups) == 1 and g.plan.groups[0].exits
    check(g, {"a": torch.randn(2, 37, 24), "b": torch.randn(24, 70)})


def test_row_exit_of_a_value_not_stored():
    g = _graph()
    a, b = g.tensor(name="a", dim=[20, 24]), g.tensor(name="b", dim=[24, 90])
    g.reduction(g.matmul(a, b), "amax", [1]).set_output(True).set_name("amax")
    g.build()
    assert len(g.plan.groups) == 1
    check(g, {"a": torch.randn(20, 24), "b": torch.randn(24, 90)})


def test_prologues_scale_cast_activation(variant):
    """A: per-column scale then cast to fp16; B: relu of an fp16 input. Odd K: padding past K must
    stay zero through the prologue (exp(0) = 1 would leak into the sum)."""
    g = _graph(dg.float16)
    x = g.tensor(name="x", dim=[27, 45], data_type=dg.float32)
    s = g.tensor(name="s", dim=[1, 45], data_type=dg.float32)
    w = g.tensor(name="w", dim=[45, 38])
    a = g.cast(g.exp(g.mul(x, s)), data_type=dg.float16)
    g.matmul(a, g.relu(w)).set_output(True).set_name("y")
    g.build(options=forced(variant))
    assert len(g.plan.launches) == (2 if variant == "split_k" else 1)
    assert g.plan.groups[0].prologue
    inputs = {"x": torch.randn(27, 45) * 0.5, "s": torch.rand(1, 45), "w": torch.randn(45, 38).half()}
    check(g, inputs, torch.float16)


def test_prologue_value_stored_by_its_own_kernel():
    g = _graph()
    x, w = g.tensor(name="x", dim=[17, 20]), g.tensor(name="w", dim=[20, 9])
    act = g.relu(x).set_output(True).set_name("act")
    g.matmul(act, w).set_output(True).set_name("y")
    g.build()
    assert [l.group.kind for l in g.plan.launches] == ["pointwise", "matmul"]
    check(g, {"x": torch.randn(17, 20), "w": torch.randn(20, 9)})


def test_tf32_is_opt_in():
    for allow, precision in ((False, "ieee"), (True, "tf32")):
        g = _graph(allow_tf32=allow)
        g.matmul(g.tensor(name="a", dim=[16, 16]), g.tensor(name="b", dim=[16, 16])).set_output(True)
        g.build()
        assert f'input_precision="{precision}"' in g.plan.launches[0].source_path.read_text()


def test_split_k_is_deterministic():
    g = _graph()
    a, b = g.tensor(name="a", dim=[20, 200]), g.tensor(name="b", dim=[200, 24])
    g.matmul(a, b).set_output(True).set_name("c")
    g.build(options=forced("split_k"))
    assert "SPLIT_K=3" in g.explain() and "combine" in g.explain()
    inputs = {"a": torch.randn(20, 200), "b": torch.randn(200, 24)}
    first = check(g, inputs)["c"]
    second = check(g, inputs)["c"]
    assert torch.equal(first, second)


def test_errors_are_typed_and_write_nothing():
    g = _graph()
    with pytest.raises(dg.ValidationError, match="inner dims"):
        g.matmul(g.tensor(name="a", dim=[4, 5]), g.tensor(name="b", dim=[6, 7]))
    with pytest.raises(dg.ValidationError, match="int32"):
        g.matmul(g.tensor(name="i", dim=[4, 5], data_type=dg.int32), g.tensor(name="f", dim=[5, 7]))
    with pytest.raises(dg.ValidationError, match="one value"):
        g.matmul(g.tensor(name="p", dim=[4, 5]), g.tensor(name="q", dim=[5, 7]),
                 scale_a=g.tensor(name="sa", dim=[1, 2]))
    with pytest.raises(dg.ValidationError, match="broadcast"):
        g.matmul(g.tensor(name="x3", dim=[2, 4, 5]), g.tensor(name="y3", dim=[3, 5, 7]))
    h = _graph()
    c = h.matmul(h.tensor(name="a", dim=[8, 5]), h.tensor(name="b", dim=[5, 7])).set_output(True)
    h.build()
    out = poisoned(c)
    with pytest.raises(dg.ExecutionError, match="shape"):
        h.execute({"a": torch.randn(8, 6), "b": torch.randn(5, 7), c: out})
    assert torch.isnan(out).all()


def test_explain_names_config_and_reason():
    g = _graph()
    g.matmul(g.tensor(name="a", dim=[64, 64]), g.tensor(name="b", dim=[64, 64])).set_output(True)
    g.build()
    text = g.explain()
    assert "config:" in text and "warps=" in text and "model rank 1 of" in text


def test_model_ranks_sensible_choices():
    """Big squares get big tiles, decode shapes get 16-row tiles, skinny outputs with long K split."""
    device = dg.target.H100

    def best(m, n, k, tma=True):
        problem = mm.MatmulProblem(1, m, n, k, "bf16", 2, 2, 2, tma, "row", "row")
        return mm.schedule(problem, device).config

    big = best(8192, 8192, 8192)
    assert big.block_m * big.block_n >= 128 * 128 and big.variant == "persistent"
    assert best(1, 4096, 4096).block_m == 16
    assert best(256, 256, 65536).split_k > 1
    square = mm.MatmulProblem(1, 4096, 4096, 4096, "bf16", 2, 2, 2, True, "row", "row")
    assert all(mm.programs_per_sm(c, square, device) >= 1 for c in mm.candidates(square, device))


AUTOTUNE_SCRIPT = textwrap.dedent("""
    import torch, dnngraph as dg
    g = dg.Graph(name="tune")
    a, b = g.tensor(name="a", dim=[24, 40]), g.tensor(name="b", dim=[40, 20])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    g.build(autotune=True)
    launch = g.plan.launches[0]
    y = torch.empty(24, 20)
    at, bt = torch.randn(24, 40), torch.randn(40, 20)
    g.execute({"a": at, "b": bt, "y": y})
    assert torch.allclose(y, torch.relu(at @ bt), atol=1e-4)
    print(launch.tuning.source, len(launch.tuning.timings), launch.tuning.chosen)
    print("why", launch.reason)
""")


def test_autotune_then_cache_in_a_new_process(tmp_path):
    env = {**os.environ, "DNNGRAPH_CACHE_DIR": str(tmp_path), "DNNGRAPH_AUTOTUNE_TOP": "2",
           "PYTHONPATH": os.getcwd()}
    first = subprocess.run([sys.executable, "-c", AUTOTUNE_SCRIPT], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("tuned 2 ")
    assert "[1/2]" in first.stderr and "[2/2]" in first.stderr  # progress
    second = subprocess.run([sys.executable, "-c", AUTOTUNE_SCRIPT], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("cache 2 ") and "timing" not in second.stderr
    assert first.stdout.split()[2:4] == second.stdout.split()[2:4]  # the same config
    assert "cached autotune result" in second.stdout


def test_autotune_survives_a_corrupt_cache(tmp_path, monkeypatch):
    from dnngraph.runtime.tuning_cache import TuningCacheWarning

    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "1")
    (tmp_path / "tuning.json").write_bytes(b"{\"format\": \"dnngraph-tun")
    g = _graph()
    g.matmul(g.tensor(name="a", dim=[16, 16]), g.tensor(name="b", dim=[16, 16])).set_output(True)
    with pytest.warns(TuningCacheWarning):
        g.build(autotune=True)
    assert g.plan.launches[0].tuning.source == "tuned"
    g.build(autotune=True)
    assert g.plan.launches[0].tuning.source == "cache"


@pytest.mark.parametrize("m,n,k", [(1, 45, 29), (37, 1, 29), (37, 45, 1), (1, 1, 70)])
def test_size_one_axes(variant, m, n, k):
    """Size-1 axes have stride 0 after broadcasting rules; dot tiles and stores stay full."""
    g = _graph()
    a, b = g.tensor(name="a", dim=[m, k]), g.tensor(name="b", dim=[k, n])
    bias = g.tensor(name="bias", dim=[1, n])
    g.relu(g.add(g.matmul(a, b), bias)).set_output(True).set_name("y")
    check(g, {"a": torch.randn(m, k), "b": torch.randn(k, n), "bias": torch.randn(1, n)}, options=forced(variant))


def test_bf16_on_the_interpreter():
    """The interpreter's tl.dot multiplied bf16 bit patterns (triton 3.6); runtime.py widens bf16
    dot operands to float32 (exact) when interpreting."""
    g = _graph(dg.bfloat16)
    a, b = g.tensor(name="a", dim=[2, 33, 40]), g.tensor(name="b", dim=[40, 27])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    gen = torch.Generator().manual_seed(3)
    check(g, {"a": torch.randn(2, 33, 40, generator=gen).bfloat16(), "b": torch.randn(40, 27, generator=gen).bfloat16()},
          torch.bfloat16)


# --- on the GPU: bf16 and fp8, every variant at real tile sizes, TMA, autotune -------------------
GPU_VARIANTS = {
    "tiled": mm.MatmulConfig("tiled", 128, 128, 64, 8, 3),
    "small_m": mm.MatmulConfig("small_m", 16, 64, 128, 4, 4),
    "split_k": mm.MatmulConfig("split_k", 64, 64, 64, 4, 4, split_k=4),
    "persistent": mm.MatmulConfig("persistent", 128, 256, 64, 8, 3),
    "persistent_subtiled": mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2, tma_store=True),
}


EPILOGUE_KNOBS = [mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, flatten=True, epilogue_subtile=2, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=4, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, tma_store=True),
                  mm.MatmulConfig("persistent", 256, 128, 64, 8, 4, epilogue_subtile=2, tma_store=True)]


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.fixture(params=sorted(GPU_VARIANTS))
def gpu_variant(request):
    """One kernel variant at real tile sizes, forced (forced(gpu_variant, GPU_VARIANTS)) whatever the
    model would pick."""
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", [("row", "row"), ("padded_col", "padded_col"), ("row", "col"),
                                     ("sliced", "row")])
def test_bf16_bias_gelu_every_variant(gpu_variant, layouts):
    m, n, k = 1000, 777, 1003
    a_t = _storage([m, k], layouts[0], torch.bfloat16, "cuda")
    b_t = _storage([k, n], layouts[1], torch.bfloat16, "cuda")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    bias = g.tensor(name="bias", dim=[1, n])
    pre = g.add(g.matmul(a, b), bias).set_output(True).set_name("pre")
    g.gelu(pre).set_output(True).set_name("y")
    check(g, {"a": a_t, "b": b_t, "bias": torch.randn(1, n, device="cuda").bfloat16()}, torch.bfloat16, "cuda",
          options=forced(gpu_variant, GPU_VARIANTS))


@pytest.mark.gpu
def test_model_choice_large_square_and_batched():
    for shape_a, shape_b in (([2048, 2048], [2048, 2048]), ([3, 1, 257, 512], [4, 512, 384])):
        g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
        a, b = g.tensor(name="a", dim=shape_a), g.tensor(name="b", dim=shape_b)
        g.silu(g.matmul(a, b)).set_output(True).set_name("y")
        inputs = {"a": torch.randn(shape_a).bfloat16(), "b": (torch.randn(shape_b) / 16).bfloat16()}
        check(g, _cuda(inputs), torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_persistent_tma_is_chosen_and_unaligned_bindings_fall_back():
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[4096, 4096]), g.tensor(name="b", dim=[4096, 4096])
    c = g.matmul(a, b).set_output(True).set_name("c")
    g.build()
    assert g.plan.launches[0].config_text.startswith("persistent")
    at, bt = torch.randn(4096, 4096).bfloat16().cuda(), (torch.randn(4096, 4096) / 64).bfloat16().cuda()
    check(g, {"a": at, "b": bt}, torch.bfloat16, "cuda")
    # the same values one element past alignment: the tiled alternative runs
    storage = torch.empty(4096 * 4096 + 8, dtype=torch.bfloat16, device="cuda")
    shifted = storage[1:1 + 4096 * 4096].view(4096, 4096)
    shifted.copy_(at)
    out = poisoned(c, "cuda")
    g.execute({"a": shifted, "b": bt, "c": out})
    ref = (at.float() @ bt.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1.6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("types", [(dg.float8_e4m3, dg.float8_e4m3), (dg.float8_e5m2, dg.float8_e5m2),
                                   (dg.float8_e4m3, dg.float8_e5m2)])
@pytest.mark.parametrize("m", [1, 300, 2048])
def test_fp8_with_per_tensor_scales(types, m):
    n, k = 1024, 2048
    a_t = (torch.randn(m, k, device="cuda") * 4).to(types[0].torch_dtype)
    b_t = (torch.randn(n, k, device="cuda") * 4).to(types[1].torch_dtype).t()  # K-major B, as fp8 GEMMs store it
    g = dg.Graph(name="fp8", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    sa = g.tensor(name="sa", dim=[1, 1], data_type=dg.float32)
    sb = g.tensor(name="sb", dim=[1, 1], data_type=dg.float32)
    y = g.matmul(a, b, scale_a=sa, scale_b=sb).set_output(True).set_name("y")
    g.reduction(y, "amax", [1]).set_output(True).set_name("amax")
    inputs = {"a": a_t, "b": b_t, "sa": torch.tensor([[0.05]], device="cuda"),
              "sb": torch.tensor([[0.02]], device="cuda")}
    check(g, inputs, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_fp16_and_tf32():
    for dtype, tf32 in ((dg.float16, False), (dg.float32, True), (dg.float32, False)):
        g = dg.Graph(name="mm", io_data_type=dtype, allow_tf32=tf32)
        a, b = g.tensor(name="a", dim=[513, 1000]), g.tensor(name="b", dim=[1000, 257])
        g.relu(g.matmul(a, b)).set_output(True).set_name("y")
        inputs = {"a": torch.randn(513, 1000).to(dtype.torch_dtype), "b": torch.randn(1000, 257).to(dtype.torch_dtype)}
        check(g, _cuda(inputs), dtype.torch_dtype if not tf32 else torch.float16, "cuda",
              tolerance=2e-3 if tf32 else None)


@pytest.mark.gpu
def test_row_exits_and_prologue_bf16(gpu_variant):
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[600, 1024], data_type=dg.float32)
    w = g.tensor(name="w", dim=[1024, 900])
    a = g.cast(g.mul(x, 0.5), data_type=dg.bfloat16)
    y = g.gelu_tanh(g.matmul(a, w)).set_output(True).set_name("y")
    g.reduction(y, "amax", [1]).set_output(True).set_name("amax")
    g.reduction(y, "sum", [1]).set_output(True).set_name("sum")
    inputs = {"x": torch.randn(600, 1024), "w": (torch.randn(1024, 900) / 32).bfloat16()}
    check(g, _cuda(inputs), torch.bfloat16, "cuda", options=forced(gpu_variant, GPU_VARIANTS))


@pytest.mark.gpu
@pytest.mark.parametrize("config", EPILOGUE_KNOBS, ids=lambda c: c.text.replace(" ", "_"))
def test_subtiled_tma_store_epilogue(config):
    """Batched bias + gelu + residual, the pre-activation stored in fp32 too, N ragged against the
    tile (1000 = 3 x 256 + 232): every output through descriptors, clipped at M and N; an output
    whose base is 4 bytes past alignment runs the tiled alternative."""
    options = dg.BuildOptions(matmul_config=config)
    m, n, k = 1000, 1000, 1024
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[2, m, k]), g.tensor(name="b", dim=[k, n])
    bias, residual = g.tensor(name="bias", dim=[1, n]), g.tensor(name="residual", dim=[2, m, n])
    pre = g.add(g.matmul(a, b), bias).set_output(True).set_name("pre").set_data_type(dg.float32)
    g.add(g.gelu(pre), residual).set_output(True).set_name("y")
    g.build(options=options)
    assert g.plan.launches[0].config_text.startswith(config.text)
    stores = g.plan.launches[0].source_path.read_text().count(".store([pid_m * BLOCK_M, start_n]")
    # the fp32 side output's staging buffer does not fit beside every tile's operand stages: it
    # keeps a pointer store there
    # (none under flatten, whose cross-tile pipeline needs shared memory of its own)
    stored = config.tma_store and not config.flatten
    assert stores % config.epilogue_subtile == 0 and (0 < stores <= 2 * config.epilogue_subtile) == stored
    inputs = {"a": torch.randn(2, m, k), "b": torch.randn(k, n) / 32, "bias": torch.randn(1, n),
              "residual": torch.randn(2, m, n)}
    inputs = {name: t.bfloat16().cuda() for name, t in inputs.items()}
    check(g, inputs, torch.bfloat16, "cuda")
    buffer = torch.full((2 * m * n + 2,), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = buffer[1:-1].view(2, m, n)
    pre_t = poisoned(next(t for t in g.outputs() if t.name == "pre"), "cuda")
    g.execute({**inputs, "y": y, "pre": pre_t})
    reference = g.reference({name: t.cpu() for name, t in inputs.items()})["y"]
    assert (y.double().cpu() - reference).norm() / reference.norm() < 1.6e-2
    assert torch.isnan(buffer[0]) and torch.isnan(buffer[-1])


@pytest.mark.gpu
def test_autotune_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "3")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[1024, 1024]), g.tensor(name="b", dim=[1024, 2048])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    g.build(autotune=True)
    record = g.plan.launches[0].tuning
    assert record.source == "tuned" and len(record.timings) == 3
    assert all(ms > 0 for _, _, ms in record.timings)
    inputs = {"a": torch.randn(1024, 1024).bfloat16(), "b": (torch.randn(1024, 2048) / 32).bfloat16()}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    g.build(autotune=True)
    assert g.plan.launches[0].tuning.source == "cache"


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 13, 1), (4, 5, 1), (13, 1, 16), (16, 13, 16), (3, 20, 7), (37, 3, 5)])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "padded_col"), ("sliced", "row")])
def test_axes_shorter_than_their_tile(m, n, k, layouts):
    """M or N below the block: wrapped tile indices carry no contiguity hints (they faulted)."""
    torch.manual_seed(m * 100 + n)
    a_t = _storage([3, m, k], layouts[0], torch.bfloat16, "cuda")
    b_t = _storage([k, n], layouts[1], torch.bfloat16, "cuda")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    c = g.tensor(name="c", dim=[1, 1, n])
    y = g.sigmoid(g.add(g.matmul(a, b), c)).set_output(True)
    g.reduction(y, "norm1", [2]).set_output(True)
    check(g, {"a": a_t, "b": b_t, "c": torch.randn(1, 1, n, device="cuda").bfloat16()}, torch.bfloat16,
          device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tiled", "small_m", "split_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k", [(37, 3, 1), (301, 203, 1), (301, 203, 37), (1001, 777, 64)])
def test_contiguous_m_and_n_axes_whose_size_splits_a_vector(variant, dtype, m, n, k):
    """An M-contiguous A (or N-contiguous B) whose size is no multiple of a 16-byte vector: the
    last tile's wrap falls mid-vector, so the contiguity hints must go (37 rows faulted)."""
    torch.manual_seed(m + n + k)
    io = dg.float32 if dtype == torch.float32 else dg.bfloat16
    for a_layout in ("col", "row"):
        a_t = _storage([m, k], a_layout, dtype, "cuda")
        b_t = _storage([k, n], "row", dtype, "cuda")
        g = dg.Graph(name="mm", io_data_type=io)
        a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
        g.matmul(a, b).set_output(True).set_data_type(dg.float16)
        check(g, {"a": a_t, "b": b_t}, torch.float16, "cuda", options=forced(variant, GPU_VARIANTS))
