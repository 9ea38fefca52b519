"""Row kernels that walk blocks of rows: the persistent one-pass forward (layernorm's scale and
bias read after the reductions, the next rows' loads in flight) and the fused norm backward's
one-tile rows with the next blocks prefetched. Forced configs on small shapes, odd widths,
large means, NaN and infinite rows, strides, prologues and epilogues, all against float64 with
poisoned outputs; which configs the model gives at the benchmark shapes (built, not run)."""
import re

import pytest
import torch

import dnngraph as dg
from dnngraph import target as targets
from dnngraph.backends.triton.heuristics import rows as row_heuristics
from dnngraph.backends.triton.heuristics.pointwise import pow2_at_least
from dnngraph.runtime import plan_cache
from dnngraph.runtime.kernel_files import kernel_source
from helpers import check, run
from ops.test_norms import _feature_graph, _fused_backward, _fused_launches, _poison_rows, shifted

TOLERANCE = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _persistent(columns, programs, block_k=1, warps=4) -> dg.BuildOptions:
    """Options forcing the persistent one-pass kernel: `programs` walking rows `block_k` a trip."""
    config = row_heuristics.RowConfig("persistent", block_k, pow2_at_least(columns), warps, programs, 0.0)
    return dg.BuildOptions(row_config=config)


def _config_text(graph) -> str:
    return " | ".join(launch.config_text for launch in graph.plan.launches)


# --- persistent forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,programs,block_k", [((7, 1031), 3, 1), ((9, 65), 2, 4), ((2, 3, 33), 4, 2),
                                                    ((5, 1), 2, 1), ((1, 100), 3, 1)])
def test_persistent_forward(op, dtype, shape, programs, block_k):
    """Odd widths, rows that do not divide among the programs (and programs past the rows), a
    reduced axis of one element, one row."""
    g, inputs = _feature_graph(op, dtype, shape, bias=op == "layernorm")
    check(g, inputs, dtype, tolerance=TOLERANCE[dtype], options=_persistent(shape[-1], programs, block_k))
    assert f"grid={programs} " in _config_text(g) and "(persistent)" in _config_text(g)


@pytest.mark.parametrize("columns", [4097, 14337])
def test_persistent_forward_odd_wide_rows(columns):
    """The benchmark widths plus one (the last lane of a 8192 or 16384 tile masked), bf16."""
    g, inputs = _feature_graph("layernorm", torch.bfloat16, (3, columns))
    check(g, inputs, torch.bfloat16, options=_persistent(columns, 2, warps=16))


def test_persistent_forward_large_mean():
    """A mean of 1e4 against a spread of 0.1 in fp32: the two-pass statistics take back what
    the mean's rounding leaves, so mean and inv_variance hold to fp32 rounding of their own."""
    g = dg.Graph()
    x_t = 1e4 + 0.1 * torch.randn(6, 300)
    x, s, b = g.tensor_like(x_t, "x"), g.tensor(name="scale", dim=[1, 300]), g.tensor(name="bias", dim=[1, 300])
    y, mean, inv = g.layernorm(x, s, b)
    for out in (y, mean, inv):
        out.set_output(True)
    inputs = {x: x_t, s: shifted(1, 300), b: torch.randn(1, 300)}
    outputs = check(g, inputs, tolerance=1e-2, options=_persistent(300, 4))
    reference = g.reference(inputs)
    for name, limit in ((mean.name, 1e-6), (inv.name, 1e-4)):
        error = (outputs[name].double() - reference[name]).abs().max() / reference[name].abs().max()
        assert error < limit, (name, float(error))


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_persistent_forward_non_finite_rows(op):
    """Rows holding NaN, -inf and +inf next to finite rows, in the same program."""
    g, inputs = _feature_graph(op, torch.float32, (6, 40), bias=op == "layernorm")
    _poison_rows(inputs[next(t for t in inputs if t.name == "x")], 0)
    check(g, inputs, tolerance=1e-4, options=_persistent(40, 2))


def test_persistent_forward_strided_rows():
    """Batch dims stored transposed (rows not at one stride) and x read through a stride-2 view."""
    g = dg.Graph(io_data_type=dg.float16)
    x_t = shifted(4, 5, 2 * 70, dtype=torch.float16).transpose(0, 1)[..., ::2]
    x = g.tensor_like(x_t, "x")
    s, b = g.tensor(name="scale", dim=[1, 1, 70]), g.tensor(name="bias", dim=[1, 1, 70])
    for out in g.layernorm(x, s, b):
        out.set_output(True)
    inputs = {x: x_t, s: shifted(1, 1, 70, dtype=torch.float16), b: torch.randn(1, 1, 70).half()}
    check(g, inputs, torch.float16, tolerance=5e-3, options=_persistent(70, 3))


def test_persistent_forward_prologue_and_epilogue():
    """A residual add and a per-column shift before the norm (its statistics read the column
    operand: loaded before the reductions), gelu after it (scale and bias read after them)."""
    g = dg.Graph()
    x, r = g.tensor(name="x", dim=[11, 90]), g.tensor(name="residual", dim=[11, 90])
    shift, s, b = (g.tensor(name=n, dim=[1, 90]) for n in ("shift", "scale", "bias"))
    h = g.add(g.add(x, r), shift)
    y, _, _ = g.layernorm(h, s, b)
    g.gelu(y).set_output(True).set_name("out")
    inputs = {x: shifted(11, 90), r: torch.randn(11, 90), shift: torch.randn(1, 90), s: shifted(1, 90),
              b: torch.randn(1, 90)}
    check(g, inputs, options=_persistent(90, 3))
    assert len(g.plan.launches) == 1


def test_persistent_forward_needs_whole_rows():
    """A forced persistent config narrower than the row is a typed error naming the reason."""
    g, inputs = _feature_graph("layernorm", torch.float32, (4, 100))
    config = row_heuristics.RowConfig("persistent", 1, 64, 4, 2, 0.0)
    with pytest.raises(dg.UnsupportedError, match="whole rows"):
        g.build(options=dg.BuildOptions(row_config=config))


def _built(op, rows, columns, target):
    g, _ = _feature_graph(op, torch.bfloat16, (rows, columns), bias=op == "layernorm")
    g.build(options=dg.BuildOptions(target=target))
    return _config_text(g)


@pytest.mark.parametrize("target", [targets.H100, targets.H200], ids=["h100", "h200"])
def test_model_takes_persistent_rows_for_layernorm(target):
    """Layernorm (x, scale and bias along R) goes persistent at rows of 16384 lanes, one program
    per SM (PERSISTENT_MIN_ROW_VALUES: narrower rows measured no faster or slower); rmsnorm,
    softmax, narrower rows and rows too few to give each program two trips keep one row per
    program."""
    text = _built("layernorm", 4096, 14336, target)
    assert "(persistent)" in text and f"grid={target.sms} " in text and "num_warps=16" in text, text
    for op, rows, columns in (("rmsnorm", 4096, 14336), ("layernorm", 100, 4096), ("layernorm", 16384, 8192),
                              ("layernorm", 4096, 4096)):
        assert "(one_pass)" in _built(op, rows, columns, target), (op, rows, columns)
    g = dg.Graph(io_data_type=dg.bfloat16)
    g.softmax(g.tensor(name="x", dim=[4096, 14336]), axis=-1).set_output(True)
    g.build(options=dg.BuildOptions(target=target))
    assert "(one_pass)" in _config_text(g)


# --- fused backward: next row blocks prefetched -------------------------------------------------------
def _prefetch_count(graph) -> int:
    """Row blocks the fused kernel loads ahead (its slots in the generated source)."""
    source = kernel_source(graph.plan.launches[0].kernel)
    return len(set(re.findall(r"\w+_ahead(\d+) = tl\.load", source)))


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("values,expected", [(0, 0), (1, 1), (1 << 20, 2)])
@pytest.mark.parametrize("rows,columns,programs", [(200, 100, 2), (13, 257, 3), (3, 64, 5)])
def test_fused_backward_prefetch(monkeypatch, op, values, expected, rows, columns, programs):
    """No prefetch, one block and the most ahead: the same numbers, across trips, programs and
    the rows' end (blocks past a program's rows are masked); programs past the rows."""
    monkeypatch.setattr(row_heuristics, "FUSED_ROW_PREFETCH_VALUES", values)
    plan_cache.clear()  # the heuristics' constants are not in the plan key
    g, inputs = _fused_backward(op, shifted(rows, columns), torch.randn(rows, columns), shifted(1, columns),
                                torch.float32)
    check(g, inputs, tolerance=5e-5, options=dg.BuildOptions(norm_backward_programs=programs))
    assert _fused_launches(g) == ["fused", "combine"] and _prefetch_count(g) == expected


def test_fused_backward_prefetch_non_finite_bf16():
    """A NaN row and an infinite row among finite ones, bf16, two blocks ahead."""
    x_t = shifted(40, 96, dtype=torch.bfloat16)
    x_t[3, 5], x_t[17, 0] = float("nan"), float("inf")
    g, inputs = _fused_backward("layernorm_backward", x_t, torch.randn(40, 96).bfloat16(),
                                shifted(1, 96, dtype=torch.bfloat16), torch.bfloat16)
    check(g, inputs, torch.bfloat16, tolerance=2e-2, options=dg.BuildOptions(norm_backward_programs=3))
    assert _prefetch_count(g) == row_heuristics.FUSED_ROW_PREFETCH_MAX


@pytest.mark.parametrize("target", [targets.H100, targets.H200], ids=["h100", "h200"])
def test_fused_backward_prefetch_by_width(target):
    """Two row blocks ahead at 4096 lanes, one at 8192 (the model's configs, built, not run)."""
    from ops.test_norm_wide import _graph_at
    for columns, ahead in ((4096, 2), (8192, 1)):
        g = _graph_at("layernorm_backward", 4096, columns)
        g.build(options=dg.BuildOptions(target=target))
        assert _prefetch_count(g) == ahead, columns


@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
@pytest.mark.parametrize("prime", [False, True])
def test_chunked_backward_next_rows_primed(monkeypatch, op, prime):
    """The chunked form with and without the next row block's first chunks loaded during the
    dx walk: the same numbers across trips, programs (some past the rows) and ragged chunks."""
    monkeypatch.setattr(row_heuristics, "FUSED_LOOP_PRIME_NEXT_ROWS", prime)
    plan_cache.clear()  # the heuristics' constants are not in the plan key
    g, inputs = _fused_backward(op, shifted(23, 300), torch.randn(23, 300), shifted(1, 300), torch.float32)
    check(g, inputs, tolerance=5e-5, options=dg.BuildOptions(norm_backward_max_reduced=64, norm_backward_programs=5))
    source = kernel_source(g.plan.launches[0].kernel)
    assert "BLOCK_R=64" in g.plan.launches[0].config_text
    assert ("k_next_idx = k_start + BLOCK_K" in source) == prime


# --- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("op,shape,forced", [("layernorm", (4096, 14336), None), ("layernorm", (16384, 8192), 264),
                                             ("layernorm", (4096, 4097), 264), ("layernorm", (700, 14337), None),
                                             ("rmsnorm", (4096, 14336), 132), ("rmsnorm", (300, 8192), 264)])
def test_persistent_forward_gpu(op, shape, forced):
    """bf16 persistent rows against float64 on the GPU (the model's config, or one forced with
    that many programs at 16 warps), bitwise the same on a second run."""
    from ops.test_norms import _to_cuda
    g, inputs = _feature_graph(op, torch.bfloat16, shape, bias=op == "layernorm")
    inputs = _to_cuda(inputs)
    options = None if forced is None else _persistent(shape[-1], forced, warps=16)
    first = check(g, inputs, torch.bfloat16, device="cuda", reference_device="cuda", options=options)
    assert "(persistent)" in _config_text(g)
    again = run(g, inputs, "cuda")
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layernorm_backward", "rmsnorm_backward"])
def test_fused_backward_prefetch_strided_fp16_gpu(op):
    """fp16 rows read through a transposed batch layout, 4096 lanes (two blocks ahead)."""
    from ops.test_norms import _to_cuda
    x_t = shifted(16, 300, 4096, dtype=torch.float16).transpose(0, 1)
    g, inputs = _fused_backward(op, x_t, torch.randn(300, 16, 4096).half(), shifted(1, 1, 4096, dtype=torch.float16),
                                torch.float16)
    first = check(g, _to_cuda(inputs), torch.float16, device="cuda", reference_device="cuda", tolerance=5e-3)
    assert _fused_launches(g) == ["fused", "combine"] and _prefetch_count(g) == 2
    again = run(g, _to_cuda(inputs), "cuda")
    assert all(torch.equal(first[name], again[name]) for name in first)
