"""Feature-norm backward (layernorm, rmsnorm) over rows wider than one tile: two kernels, the
chunked fused dx + dscale/dbias kernel and the combine of its partials; the fused configs the
heuristics give across row shapes; layernorm's forward at wide one-pass rows (the two sums, at
the warps measured for them); the GPU at the benchmark shapes."""
import re

import pytest
import torch

import dnngraph as dg
from dnngraph import target as targets
from dnngraph.backends.triton.heuristics import rows as row_heuristics
from dnngraph.backends.triton.heuristics.pointwise import pow2_at_least
from helpers import check, run
from ops.test_norms import _feature_graph, _fused_backward, _fused_launches, _to_cuda, shifted
from ops.test_norms import check_non_finite_feature_norm

CUDA = "cuda"
OPS = ["layernorm_backward", "rmsnorm_backward"]
TOLERANCE = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _chunked(max_reduced=None, programs=None) -> dg.BuildOptions:
    """Options whose one-tile limit is `max_reduced` (chunks of that width on wider rows)."""
    more = {} if max_reduced is None else {"norm_backward_max_reduced": max_reduced}
    return dg.BuildOptions(norm_backward_programs=programs, **more)


def _block_r(graph) -> int:
    """BLOCK_R of the fused kernel of a built norm backward."""
    return int(re.search(r"BLOCK_R=(\d+)", graph.plan.launches[0].config_text).group(1))


def _backward(op, rows, columns, dtype=torch.float32, has_dbias=True):
    return _fused_backward(op, shifted(rows, columns, dtype=dtype), torch.randn(rows, columns).to(dtype),
                           shifted(1, columns, dtype=dtype), dtype, has_dbias=has_dbias)


@pytest.mark.parametrize("op,dtype", [("layernorm_backward", torch.bfloat16)])
def test_wide_rows_are_two_kernels_by_default(op, dtype):
    """5 x 14335 with the model's config: the chunked fused kernel (BLOCK_R below the row) and
    the combine, against float64 with poisoned outputs (rmsnorm, fp32 and fp16 run below on
    narrower chunks: the interpreter's time, most of it the combine's 1792 programs)."""
    g, inputs = _backward(op, 5, 14335, dtype)
    check(g, inputs, dtype, tolerance=TOLERANCE[dtype])
    assert _fused_launches(g) == ["fused", "combine"]
    assert _block_r(g) < 14335


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,max_reduced", [((21, 1000), 128), ((1, 700), 128), ((20, 129), 128),
                                               ((16, 257), 64), ((3, 33), 16)])
@pytest.mark.parametrize("programs", [None, 3])
def test_chunked_odd_shapes(op, shape, max_reduced, programs):
    """Odd widths (a last chunk of one column), one row, rows fewer than programs."""
    g, inputs = _backward(op, *shape)
    check(g, inputs, tolerance=5e-5, options=_chunked(max_reduced, programs))
    assert _fused_launches(g) == ["fused", "combine"] and _block_r(g) == max_reduced


@pytest.mark.parametrize("op", OPS)
def test_chunked_strides_fp16(op):
    """Batch dims stored transposed, dy a slice of a wider buffer (padded row stride), the scale
    a strided slice; fp16."""
    x_t = shifted(9, 4, 301, dtype=torch.float16).transpose(0, 1)
    dy_t = torch.randn(4, 9, 320).to(torch.float16)[:, :, 7:308]
    scale_t = shifted(1, 1, 602, dtype=torch.float16)[:, :, ::2]
    g, inputs = _fused_backward(op, x_t, dy_t, scale_t, torch.float16)
    check(g, inputs, torch.float16, tolerance=5e-3, options=_chunked(64, 3))
    assert _fused_launches(g) == ["fused", "combine"] and _block_r(g) == 64


@pytest.mark.parametrize("op", OPS)
def test_chunked_nan_and_inf_rows(op):
    """A NaN in x and an inf in dy: those rows' dx and every dscale are what float64 gives."""
    x_t, dy_t = shifted(37, 300), torch.randn(37, 300)
    x_t[5, 290] = float("nan")
    dy_t[9, 3] = float("inf")
    g, inputs = _fused_backward(op, x_t, dy_t, shifted(1, 300))
    outputs = check(g, inputs, tolerance=5e-5, options=_chunked(64))
    dscale = next(v for k, v in outputs.items() if k.endswith("dscale"))
    assert torch.isnan(dscale).all()


def test_chunked_rmsnorm_without_dbias():
    g, inputs = _backward("rmsnorm_backward", 37, 333, has_dbias=False)
    outputs = check(g, inputs, tolerance=5e-5, options=_chunked(128))
    assert len(outputs) == 2 and _fused_launches(g) == ["fused", "combine"]


def test_chunked_epilogues():
    """dx plus a residual cast to bf16 in the fused kernel; dscale plus another gradient and
    dbias cast in the combine."""
    g = dg.Graph()
    shape = (13, 150)
    x, dy = g.tensor(name="x", dim=list(shape)), g.tensor(name="dy", dim=list(shape))
    residual = g.tensor(name="residual", dim=list(shape))
    s, other = g.tensor(name="scale", dim=[1, 150]), g.tensor(name="other_dscale", dim=[1, 150])
    m, i = (g.tensor(name=n, dim=[13, 1], data_type=dg.float32) for n in ("mean", "inv"))
    dx, dscale, dbias = g.layernorm_backward(dy, x, s, m, i)
    g.cast(g.add(dx, residual), dg.bfloat16).set_output(True)
    g.add(dscale, other).set_output(True)
    g.cast(dbias, dg.float16).set_output(True)
    inputs = {x: shifted(*shape), dy: torch.randn(*shape), residual: torch.randn(*shape), s: shifted(1, 150),
              other: torch.randn(1, 150), m: torch.randn(13, 1), i: torch.rand(13, 1) + 0.5}
    check(g, inputs, tolerance=2e-2, options=_chunked(32))
    assert _fused_launches(g) == ["fused", "combine"]


def test_rows_past_the_register_budget_fall_back():
    """Column sums of more chunks than a program unrolls: the separate dx and dscale/dbias
    kernels, still right."""
    g, inputs = _backward("layernorm_backward", 3, 100)
    check(g, inputs, tolerance=5e-5, options=_chunked(4))
    assert "fused" not in _fused_launches(g) and len(g.plan.launches) >= 2


def test_benchmark_shapes_build_two_kernels():
    """Every benchmark shape (built, not run) is the fused kernel and its combine."""
    for op in OPS:
        for rows, columns in ((4096, 4096), (4096, 8192), (4096, 14336), (16384, 8192)):
            g = _graph_at(op, rows, columns)
            g.build()
            assert _fused_launches(g) == ["fused", "combine"], (op, rows, columns)


def _graph_at(op, rows, columns):
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, dy = g.tensor(name="x", dim=[rows, columns]), g.tensor(name="dy", dim=[rows, columns])
    s = g.tensor(name="scale", dim=[1, columns])
    stats = [g.tensor(name=n, dim=[rows, 1], data_type=dg.float32)
             for n in (("mean", "inv") if op == "layernorm_backward" else ("inv",))]
    extra = {} if op == "layernorm_backward" else {"has_dbias": True}
    for out in getattr(g, op)(dy, x, s, *stats, **extra):
        out.set_output(True)
    return g


# --- the heuristics' fused configs ---------------------------------------------------------------
SHAPES = [(rows, columns) for rows in (1, 3, 16, 4096, 65536)
          for columns in (1, 64, 100, 1024, 4096, 4097, 8192, 14335, 14336, 16384)]


def _geometry(rows, columns):
    operands = [(0, dg.bfloat16, (columns, 1), False), (1, dg.bfloat16, (columns, 1), True)]
    return row_heuristics.geometry((rows, columns), (1,), operands, 0)


@pytest.mark.parametrize("target", [targets.H100, targets.H200], ids=["h100", "h200"])
@pytest.mark.parametrize("accumulators", [1, 2])
def test_fused_configs_are_sane(target, accumulators):
    """Short rows, odd widths, few and many rows: a config whose programs cover the rows at most
    once each and fill the SMs where there are rows enough; a one-tile row or chunks whose
    column sums fit the registers; the widest rows fall back (None) only past that budget."""
    for rows, columns in SHAPES:
        config = row_heuristics.fused_norm_backward(_geometry(rows, columns), accumulators, 6, target)
        assert config is not None, (rows, columns)
        blocks = -(-rows // config.block_k)
        assert 1 <= config.splits <= blocks and config.splits <= 2 * target.sms, (rows, columns, config)
        if blocks >= target.sms:
            assert config.splits >= target.sms, (rows, columns, config)
        assert config.block_r == pow2_at_least(config.block_r) and config.estimate_us > 0
        if config.block_r < columns:  # chunked: the column sums of every chunk in registers
            chunks = -(-columns // config.block_r)
            threads = config.num_warps * 32
            assert chunks <= row_heuristics.FUSED_MAX_CHUNKS
            assert accumulators * chunks * config.block_r <= row_heuristics.FUSED_COLUMN_VALUES * threads
        else:
            assert config.block_r <= row_heuristics.FUSED_MAX_REDUCED
    wide = row_heuristics.fused_norm_backward(_geometry(4096, 14336), accumulators, 6, target)
    assert wide.block_r == row_heuristics.FUSED_LOOP_CHUNK and wide.splits == target.sms
    too_wide = 2 * row_heuristics.FUSED_COLUMN_VALUES * 32 * row_heuristics.FUSED_LOOP_WARPS // accumulators
    assert row_heuristics.fused_norm_backward(_geometry(16, too_wide), accumulators, 6, target) is None


# --- layernorm forward at wide rows -------------------------------------------------------------
def test_layernorm_forward_strides_and_precision():
    """Batch dims stored transposed; a mean of 1e4 against a spread of 0.1 in fp32 (y is 3e-3
    off: the mean rounded to fp32; the second pass takes back the deviations it leaves)."""
    g = dg.Graph()
    x_t = (1e4 + 0.1 * torch.randn(3, 7, 200)).transpose(0, 1)
    x, s, b = g.tensor_like(x_t, "x"), g.tensor(name="scale", dim=[1, 1, 200]), g.tensor(name="bias", dim=[1, 1, 200])
    for out in g.layernorm(x, s, b):
        out.set_output(True)
    check(g, {x: x_t, s: shifted(1, 1, 200), b: torch.randn(1, 1, 200)}, tolerance=1e-2)
    assert "(one_pass)" in g.plan.launches[0].config_text


def _one_pass_graph(op, rows, columns):
    """A bf16 row graph of `op` (layernorm, rmsnorm or softmax over the last axis)."""
    if op != "softmax":
        return _feature_graph(op, torch.bfloat16, (rows, columns), bias=op == "layernorm")[0]
    g = dg.Graph(io_data_type=dg.bfloat16)
    g.softmax(g.tensor(name="x", dim=[rows, columns]), axis=-1).set_output(True)
    return g


def _warps(graph) -> int:
    return int(re.search(r"num_warps=(\d+)", graph.plan.launches[0].config_text).group(1))


@pytest.mark.parametrize("target", [targets.H100, targets.H200], ids=["h100", "h200"])
def test_one_pass_warps_where_measured(target):
    """Layernorm forward rows of 16384 lanes take the warps measured for them (ONE_PASS_WARPS)
    where they run one row per program (too few rows to go persistent, or that mode forced);
    narrower layernorm rows and other ops at that width keep the values-per-thread rule, and
    rows past one tile do not see the table (built, not run)."""
    one_pass = dg.BuildOptions(target=target, row_mode="one_pass")
    expected = {("layernorm", 4096, 14336, one_pass): ("one_pass", 4), ("layernorm", 200, 16384, None): ("one_pass", 4),
                ("layernorm", 4096, 8192, one_pass): ("one_pass", 8),
                ("layernorm", 16384, 8192, one_pass): ("one_pass", 8),
                ("layernorm", 4096, 4096, one_pass): ("one_pass", 8), ("rmsnorm", 4096, 14336, None): ("one_pass", 16),
                ("softmax", 4096, 14336, None): ("one_pass", 16), ("layernorm", 2, 9000, None): ("looped", 8)}
    for (op, rows, columns, options), (mode, warps) in expected.items():
        g = _one_pass_graph(op, rows, columns)
        g.build(options=options or dg.BuildOptions(target=target))
        assert f"({mode})" in g.plan.launches[0].config_text, (op, rows, columns)
        assert _warps(g) == warps, (op, rows, columns, g.plan.launches[0].config_text)
    assert row_heuristics.ONE_PASS_WARPS[("layernorm", 16384)] == 4


def test_one_pass_warps_table_is_legal():
    """Every measured entry names a one-pass width (a power of two a tile holds) and a warp
    count Triton takes."""
    for (op, block_r), warps in row_heuristics.ONE_PASS_WARPS.items():
        assert block_r == pow2_at_least(block_r) <= row_heuristics.ONE_PASS_MAX, (op, block_r)
        assert warps in (1, 2, 4, 8, 16), (op, warps)


@pytest.mark.parametrize("columns,mode,warps", [(16383, "one_pass", 4), (9000, "looped", 8)])
def test_layernorm_forward_wide_rows(columns, mode, warps):
    """Two rows as wide as the table's entry (one tile of 16384 at 4 warps, the last lane
    masked) and a looped config, against float64: the warps change the layout, not the result."""
    g, inputs = _feature_graph("layernorm", torch.bfloat16, (2, columns))
    check(g, inputs, torch.bfloat16)
    assert f"({mode})" in g.plan.launches[0].config_text and _warps(g) == warps


# --- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(4096, 14336), (4096, 4096), (4096, 8192), (16384, 8192), (5, 14335),
                                   (33, 20000)])
def test_norm_backward_benchmark_shapes_gpu(op, shape):
    """bf16 at the benchmark shapes (and odd ones) against float64 on the GPU; two kernels
    where the column sums fit; bitwise the same on a second run."""
    g, inputs = _backward(op, *shape, dtype=torch.bfloat16)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA, reference_device=CUDA)
    if shape[1] <= 16384:
        assert _fused_launches(g) == ["fused", "combine"]
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336), (4096, 4096), (33, 16385), (4096, 16384)])
def test_layernorm_forward_benchmark_shapes_gpu(shape):
    """bf16 layernorm forward against float64 on the GPU (rows of 16384 lanes at 4 warps, their
    kernel spilling a little) and bitwise the same on a second run."""
    g, inputs = _feature_graph("layernorm", torch.bfloat16, shape)
    inputs = _to_cuda(inputs)
    first = check(g, inputs, torch.bfloat16, device=CUDA, reference_device=CUDA)
    if _block_r(g) == 16384 and "(one_pass)" in g.plan.launches[0].config_text:
        assert _warps(g) == row_heuristics.ONE_PASS_WARPS[("layernorm", 16384)]
    again = run(g, inputs, CUDA)
    assert all(torch.equal(first[name], again[name]) for name in first)


@pytest.mark.parametrize("op", OPS)
def test_chunked_dynamic_rows_and_width(op):
    """Rows and width dynamic: the chunks are unrolled for the bucket's top width; at sizes below
    it the last chunks are masked and programs past the rows store zero partials."""
    g = dg.Graph(name="norm_bwd_dynamic")
    rows, cols = dg.dynamic("rows", 1, 16), dg.dynamic("cols", 65, 300)
    x, dy = g.tensor(name="x", dim=[rows, cols]), g.tensor(name="dy", dim=[rows, cols])
    scale = g.tensor(name="scale", dim=[1, cols])
    stats = [g.tensor(name=n, dim=[rows, 1], data_type=dg.float32)
             for n in (("mean", "inv") if op == "layernorm_backward" else ("inv",))]
    extra = {} if op == "layernorm_backward" else {"has_dbias": True}
    grads = getattr(g, op)(dy, x, scale, *stats, **extra)
    for index, grad in enumerate(grads):
        grad.set_output(True).set_name(f"grad{index}")
    g.build(options=_chunked(64, 3))
    for low_rows, low_cols in ((3, 70), (16, 300), (1, 129)):
        inputs = {"x": shifted(low_rows, low_cols), "dy": torch.randn(low_rows, low_cols),
                  "scale": shifted(1, low_cols), "inv": torch.rand(low_rows, 1) + 0.5}
        if op == "layernorm_backward":
            inputs["mean"] = torch.randn(low_rows, 1)
        reference = g.reference(inputs)
        outputs = {grad.name: torch.full(tuple(reference[grad.name].shape), float("nan")) for grad in grads}
        g.execute({**inputs, **outputs})
        for name, got in outputs.items():
            assert (got.double() - reference[name]).norm() / reference[name].norm() < 5e-5, (low_rows, low_cols, name)
        config = " ".join(launch.config_text for launch in g.plan.plan_for((low_cols, low_rows)).launches)  # symbols by name
        assert "fused" in config and "BLOCK_R=64" in config


def sm90_graphs():
    """The benchmark shapes' norm kernels planned for the H200 (bf16), for the sm_90 compile
    check: the chunked backward of both norms, the one-tile backward (the next row blocks
    prefetched: two at 4096 lanes, one at 8192), and layernorm's forward (persistent rows of
    16384 and 8192 lanes at 16 warps)."""
    h200 = {"target": targets.H200}
    for op in OPS:
        for rows, columns in ((4096, 14336), (4096, 8192), (4096, 4096)):
            g = _graph_at(op, rows, columns)
            g.build(options=dg.BuildOptions(**h200))
            yield f"{op} {rows}x{columns}", g
    for rows, columns in ((4096, 14336), (16384, 8192)):
        g, _ = _feature_graph("layernorm", torch.bfloat16, (rows, columns))
        g.build(options=dg.BuildOptions(**h200))
        yield f"layernorm {rows}x{columns}", g


# Spill-store bytes a kernel may have, by label and kernel (the rest: none). The chunked
# backward's column sums take half the registers (chunks of 4096, two prefetched: layernorm's
# compiled with 160, rmsnorm's with 60; the unrolled form spilled 924+; the next row block's
# first chunks loaded during the dx walk: 164 and 104); layernorm's forward
# runs persistent rows at 16 warps, 104 registers and no spills (one row per program at 4 warps
# took 255 and spilled 128 bytes; holding scale and bias across the rows spilled 52).
SPILL_BYTES = {("layernorm_backward 4096x14336", "layernorm_backward"): 164,
               ("rmsnorm_backward 4096x14336", "rmsnorm_backward"): 104}


def _spill_limit(line: str) -> int:
    """The bound for a line `spills LABEL dnngraph_norm_<kernel>_<hash>: N`."""
    label, kernel = re.match(r"spills (.+) dnngraph_norm_(\w+)_[0-9a-f]+:", line).groups()
    return SPILL_BYTES.get((label, kernel), 0)


def test_kernels_compile_for_sm90_with_few_spills():
    from helpers import compiled_for_sm90
    out = compiled_for_sm90("test_norm_wide:sm90_graphs", env={"SM90_SPILLS": "1"})
    assert "compiled 14 kernels for sm_90" in out
    spills = [line for line in out.splitlines() if line.startswith("spills")]
    assert len(spills) == 14
    assert sum(_spill_limit(line) > 0 for line in spills) == len(SPILL_BYTES)
    for line in spills:
        assert int(line.rsplit(" ", 1)[1]) <= _spill_limit(line), line
