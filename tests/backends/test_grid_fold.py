"""Grids past CUDA's limits on axes y and z: a kernel whose count there (batch entries of a
GEMM, groups of a convolution, tap blocks of a depthwise wgrad, the dbias kernel's tiles)
passes the limit folds it into axis x and decodes the indices from program_id(0). The limits
are lowered here (a target whose max_grid is small, which every build of it reads, check_grid
too) so that the folded layouts run cheaply through the interpreter, against the float64
reference; ordinary shapes keep the plain grid and source."""
import dataclasses

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check

SMALL_LIMITS = (2**31 - 1, 3, 3)
# the interpreter's target with grid axes y and z of 3 programs
SMALL_GRID = dataclasses.replace(dg.target.INTERPRETER, name="small grid", max_grid=SMALL_LIMITS)
VARIANTS = {
    "tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
    "small_m": mm.MatmulConfig("small_m", 16, 32, 32, 4, 2),
    "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3),
    "persistent": mm.MatmulConfig("persistent", 16, 16, 16, 4, 2),
}


def small(**fields) -> dg.BuildOptions:
    """Options planning for SMALL_GRID, with `fields` besides."""
    return dg.BuildOptions(target=SMALL_GRID, **fields)


def _graph(dtype=dg.float32):
    return dg.Graph(name="grid", io_data_type=dtype, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32)


def within_limits(g):
    """Every launch (and its unaligned alternative) within the lowered limits; the sources of
    those with folded grids."""
    folded = []
    for launch in g.plan.launches:
        for chosen in (launch, launch.alternative):
            if chosen is None:
                continue
            assert SMALL_GRID.grid_fits(chosen.grid), (chosen.config_text, chosen.grid)
            source = open(chosen.source_path).read()
            if "pid_flat" in source:
                folded.append(source)
    return folded


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bmm_with_more_products_than_grid_axis_y(variant):
    """7 and 2 x 5 products (a broadcast batch, odd sizes, a column-major b): each variant folds."""
    for a_shape, b_shape in (([7, 19, 23], [7, 23, 17]), ([2, 1, 5, 21], [5, 21, 33])):
        a_t = torch.randn(a_shape)
        b_t = torch.randn(b_shape[:-2] + b_shape[:-3:-1]).transpose(-1, -2)
        g = _graph()
        a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
        g.relu(g.matmul(a, b)).set_output(True).set_name("c")
        g.build(options=small(matmul_config=VARIANTS[variant]))
        assert within_limits(g)
        check(g, {"a": a_t, "b": b_t})


def test_bmm_with_a_row_exit_folds():
    """A row-sum exit beside the folded main kernel (its fold kernel is one axis)."""
    a_t, b_t = torch.randn(5, 18, 20), torch.randn(5, 20, 35)
    g = _graph()
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    c = g.matmul(a, b).set_output(True).set_name("c")
    g.reduction(c, mode="sum", axes=[2]).set_output(True).set_name("rows")
    g.build(options=small(matmul_config=VARIANTS["tiled"]))
    assert within_limits(g)
    check(g, {"a": a_t, "b": b_t}, tolerance=1e-4)


def test_ordinary_shapes_keep_the_plain_grid_and_source():
    """Under CUDA's own limits a batch of 7 keeps (tiles, batch); the source is the one built
    with the limits raised (no fold anywhere in the code path)."""
    def built_source(options=None):
        g = _graph()
        a, b = g.tensor(name="a", dim=[7, 19, 23]), g.tensor(name="b", dim=[7, 23, 17])
        g.matmul(a, b).set_output(True).set_name("c")
        g.build(options=options)
        launch = g.plan.launches[0]
        return launch.grid, open(launch.source_path).read()

    grid, source = built_source()
    assert grid[1] == 7 and "pid_flat" not in source
    unlimited = dataclasses.replace(dg.target.INTERPRETER, max_grid=(2**31 - 1, 2**31 - 1, 2**31 - 1))
    assert built_source(dg.BuildOptions(target=unlimited)) == (grid, source)


CONV = dict(padding=[1, 0], stride=[1, 2], dilation=[1, 1])


def _grouped_conv(op, groups, layout):
    """A grouped conv of `groups` groups, 2 channels and 3 filters each, 3x2 filters."""
    x_t = torch.randn(2, 2 * groups, 7, 6)
    w_t = torch.randn(3 * groups, 2, 3, 2)
    if layout == "nhwc":
        x_t, w_t = (t.contiguous(memory_format=torch.channels_last) for t in (x_t, w_t))
    y_t = torch.nn.functional.conv2d(x_t, w_t, groups=groups, padding=CONV["padding"], stride=CONV["stride"])
    dy_t = torch.randn_like(y_t)
    g = _graph()
    if op == "fprop":
        x, w = g.tensor_like(x_t, name="x"), g.tensor_like(w_t, name="w")
        out, inputs = g.conv_fprop(x, w, groups=groups, **CONV), {"x": x_t, "w": w_t}
    elif op == "dgrad":
        dy, w = g.tensor_like(dy_t, name="dy"), g.tensor_like(w_t, name="w")
        out, inputs = g.conv_dgrad(dy, w, x_dim=list(x_t.shape), groups=groups, **CONV), {"dy": dy_t, "w": w_t}
    else:
        dy, x = g.tensor_like(dy_t, name="dy"), g.tensor_like(x_t, name="x")
        out, inputs = g.conv_wgrad(dy, x, w_dim=list(w_t.shape), groups=groups, **CONV), {"dy": dy_t, "x": x_t}
    out.set_output(True).set_name("out")
    return g, inputs


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_grouped_conv_with_more_groups_than_grid_axis_y(op, layout):
    g, inputs = _grouped_conv(op, 5, layout)
    g.build(options=small())
    assert within_limits(g)
    check(g, inputs, tolerance=1e-4)


def test_grouped_wgrad_split_k_folds_batch_and_split():
    g, inputs = _grouped_conv("wgrad", 4, "nchw")
    g.build(options=small(conv_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3)))
    assert len(within_limits(g)) == 2  # the split kernel and its combine
    check(g, inputs, tolerance=1e-4)


@pytest.mark.parametrize("bias_dim", [(2, 4, 50, 41), (1, 4, 50, 41), (2, 1, 1, 41)])
def test_attention_dbias_with_tiles_past_grid_axes_y_and_z(bias_dim):
    """4 query tiles and 8 (batch, head) pairs over limits of 3; broadcast biases sum over the
    (batch, head) pairs and query tiles they span; the other backward kernels group heads."""
    from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
    from test_sdpa import _run_dbias
    tile = sdpa_heuristics.AttentionConfig(16, 16, 1, 1)
    # every build checks its grids against the lowered limits: an unfolded dbias grid is refused
    _run_dbias((2, 4, 50, 16), (2, 41), bias_dim, lens=([50, 31], [41, 17]), use_causal_mask=True,
               options=small(sdpa_dkdv_config=tile, sdpa_dq_config=tile))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_depthwise_with_channels_taps_and_splits_past_the_limits(op, layout):
    """5 channels (x2 multiplier) over limits of 3; wgrad's 6 tap blocks (one tap each) and 5
    splits past axes y and z fold into axis x."""
    from dnngraph.backends.triton.heuristics import depthwise as dw_heuristics
    from test_depthwise import RANKS, assert_depthwise, conv_graph
    g, out, inputs = conv_graph(op, RANKS[2], layout, 2)
    out.set_output(True).set_name("out")
    g.build(options=small(depthwise_config=dw_heuristics.DepthwiseConfig("wgrad", 16, 8, 2, 1, 5)))
    assert_depthwise(g, op)
    assert bool(within_limits(g)) == (op == "wgrad")
    check(g, inputs, tolerance=1e-4)


def test_op_level_attention_chains_group_heads_past_grid_axis_y():
    """Attention written as ops, 2 x 3 (batch, head) pairs over a limit of 3: the forward kernel,
    the backward's log-sum-exp pass, dK/dV and dQ take head groups, against autograd."""
    from test_attention_grad import ALL, FUSED, _chain, _check
    g, inputs = _chain(softcap=4.0)
    derivation = _check(g, inputs, ALL, kinds=FUSED, options=small())
    flash = [launch for plan in (derivation.forward.plan, derivation.backward.plan) for launch in plan.launches
             if launch.group.kind in ("attention", "attention_backward")]
    assert len(flash) == 4 and all(launch.grid[1] <= 3 for launch in flash)


class _Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.relu(torch.bmm(a, b))


def test_torch_compile_of_a_bmm_past_grid_axis_y_runs_in_dnngraph():
    """The backend claims torch.bmm of 6 products over a limit of 3 and runs it (folded), forward
    and backward, as eager does."""
    from dnngraph import torch_backend
    from helpers import rel_err
    from test_torch_backend import _compiled
    a = torch.randn(6, 9, 13, requires_grad=True)
    b = torch.randn(6, 13, 11, requires_grad=True)
    compiled = _compiled(_Bmm(), options={"build_options": small()})
    out = compiled(a, b)
    grad = torch.randn_like(out)
    out.backward(grad)
    a_eager, b_eager = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    expected = _Bmm()(a_eager, b_eager)
    expected.backward(grad)
    assert rel_err(out, expected) < 1e-5
    assert rel_err(a.grad, a_eager.grad) < 1e-5 and rel_err(b.grad, b_eager.grad) < 1e-5
    forward, backward = torch_backend.REPORTS
    assert forward.torch_ops == () and backward.torch_ops == ()  # every aten op in dnngraph
    launches = [launch for report in (forward, backward) for function in report.functions
                for launch in function._plain[0].plan.launches]
    assert len(launches) >= 3 and all(SMALL_GRID.grid_fits(launch.grid) for launch in launches)
    products = [launch for launch in launches if launch.group.kind == "matmul"]
    assert len(products) >= 3 and all("pid_flat" in open(launch.source_path).read() for launch in products)


# --- CUDA's own limits on a GPU ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bmm_of_70000_products_on_the_gpu(dtype):
    a_t = torch.randn(70000, 5, 7, device="cuda").to(dtype)
    b_t = torch.randn(70000, 3, 7, device="cuda").to(dtype).transpose(-1, -2)
    g = _graph(dg.dtypes.from_torch(dtype))
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    g.relu(g.matmul(a, b)).set_output(True).set_name("c")
    g.build()
    assert all(launch.grid[1] <= 65535 for launch in g.plan.launches)
    check(g, {"a": a_t, "b": b_t}, dtype, device="cuda")


def _check_groups(g, op, inputs: dict, picked, device: str, reference_inputs=None):
    """Execute the grouped conv on `device` (output poisoned first) and compare the groups
    `picked` with torch's float64 conv of that group alone (of `reference_inputs`, default the
    inputs): the reference of every group (one CPU conv of 66000 groups) took minutes, and a
    fold of the grid that maps a program to the wrong group shows at the first and last groups
    and either side of 65536."""
    ref = inputs if reference_inputs is None else reference_inputs
    out = g.outputs()[0]
    result = torch.full(out.dim, float("nan"), device=device).as_strided(out.dim, out.stride)
    g.execute({**{name: t.to(device) for name, t in inputs.items()}, "out": result})
    result = result.cpu().double()
    F = torch.nn.functional
    for group in picked:
        cin, cout = slice(2 * group, 2 * group + 2), slice(3 * group, 3 * group + 3)
        if op == "fprop":
            got, want = result[:, cout], F.conv2d(ref["x"][:, cin].double(), ref["w"][cout].double(), **CONV)
        elif op == "dgrad":
            dy, w = ref["dy"][:, cout].double(), ref["w"][cout].double()
            shape = (dy.shape[0], 2) + tuple(result.shape[2:])
            got, want = result[:, cin], torch.nn.grad.conv2d_input(shape, w, dy, **CONV)
        else:
            dy, x = ref["dy"][:, cout].double(), ref["x"][:, cin].double()
            got, want = result[cout], torch.nn.grad.conv2d_weight(x, (3, 2, 3, 2), dy, **CONV)
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-4, (op, group, error)


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_the_per_group_check_agrees_with_the_whole_reference(op):
    """_check_groups on a small grouped conv passes where helpers.check (every group against
    the graph's reference) does, and fails against inputs whose first two groups are swapped."""
    torch.manual_seed(1)
    g, inputs = _grouped_conv(op, 5, "nhwc")
    check(g, inputs)
    _check_groups(g, op, inputs, range(5), "cpu")
    name = "x" if op == "fprop" else "dy"  # read per group on axis 1: swap groups 0 and 1 there
    width = 2 if name == "x" else 3
    order = list(range(inputs[name].shape[1]))
    order[:2 * width] = order[width:2 * width] + order[:width]
    swapped = {**inputs, name: inputs[name][:, order]}
    with pytest.raises(AssertionError):
        _check_groups(g, op, inputs, [0], "cpu", reference_inputs=swapped)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_grouped_conv_of_66000_groups_on_the_gpu(op):
    torch.manual_seed(0)
    g, inputs = _grouped_conv(op, 66000, "nhwc")
    g.build()
    _check_groups(g, op, inputs, [0, 1, 32768, 65534, 65535, 65536, 65537, 65999], "cuda")


@pytest.mark.gpu
def test_attention_dbias_of_70000_pairs_on_the_gpu():
    """70000 (batch, head) pairs of a full bias: the dbias kernel's grid folds into axis x."""
    from test_sdpa import _backward_case
    g, _, _ = _backward_case(70000, 1, 1, 16, 20, 16, dtype=torch.float16, bias_dim=(70000, 1, 16, 20),
                             use_causal_mask=True)
    assert g.plan.launches[-1].grid[1:] == (1, 1)


@pytest.mark.gpu
def test_torch_compile_of_a_bmm_of_70000_products_on_the_gpu():
    from helpers import rel_err
    from test_torch_backend import _compiled
    a, b = torch.randn(70000, 6, 5, device="cuda"), torch.randn(70000, 5, 4, device="cuda")
    assert rel_err(_compiled(_Bmm())(a, b), _Bmm()(a, b)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_torch_compile_leaves_integer_products_to_torch(dtype):
    """The backend claims no product it has no kernel for: an integer bmm and mm run in torch,
    exact, the addition after them in dnngraph."""
    from dnngraph import torch_backend
    from test_torch_backend import _compiled

    def program(a, b, c):
        return torch.bmm(a, b) + 1, torch.mm(a[0], c) * 2

    a, b, c = (torch.randint(-9, 9, shape, dtype=dtype) for shape in ((3, 4, 5), (3, 5, 2), (5, 6)))
    for got, want in zip(_compiled(program)(a, b, c), program(a, b, c)):
        assert torch.equal(got, want)
    (report,) = torch_backend.REPORTS
    kept = dict(report.torch_ops)
    assert "integers" in kept["aten.bmm.default"] and "integers" in kept["aten.mm.default"]
    assert "aten.add.Tensor" not in kept and "aten.mul.Tensor" not in kept


def sm90_graphs():
    """Built graphs of the folded layouts for the sm_90 compile check (lowered limits): the
    GEMM's tiled kernel, split-K and its combine, grouped conv fprop and wgrad, the depthwise
    wgrad, the attention backward with dbias and an op-level chain."""
    from dnngraph.backends.triton.heuristics import depthwise as dw_heuristics
    from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
    from test_attention_grad import _chain
    from test_depthwise import RANKS, conv_graph
    for variant in ("tiled", "split_k"):
        g = _graph(dg.float16)
        a, b = g.tensor(name="a", dim=[7, 19, 23]), g.tensor(name="b", dim=[7, 23, 17])
        g.relu(g.matmul(a, b)).set_output(True)
        g.build(options=small(matmul_config=VARIANTS[variant]))
        yield f"bmm {variant}", g
    for op in ("fprop", "wgrad"):
        g, _ = _grouped_conv(op, 5, "nhwc")
        g.build(options=small())
        yield f"grouped conv {op}", g
    g, out, _ = conv_graph("wgrad", RANKS[2], "nhwc", 2, "convolution", torch.bfloat16)
    out.set_output(True)
    g.build(options=small(depthwise_config=dw_heuristics.DepthwiseConfig("wgrad", 16, 8, 2, 1, 5)))
    yield "depthwise wgrad", g
    tile = sdpa_heuristics.AttentionConfig(16, 16, 1, 1)
    g = _graph(dg.float16)
    q, k, v, o, d_o = (g.tensor(name=n, dim=[2, 4, 50, 16]) for n in ("q", "k", "v", "o", "dO"))
    stats = g.tensor(name="stats", dim=[2, 4, 50, 1], data_type=dg.float32)
    bias = g.tensor(name="bias", dim=[2, 4, 50, 50])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, bias=bias, compute_dbias=True, use_causal_mask=True):
        grad.set_output(True)
    g.build(options=small(sdpa_dkdv_config=tile, sdpa_dq_config=tile))
    yield "sdpa backward with dbias", g
    g, _ = _chain(dtype=torch.float16)
    g.build(options=small())
    yield "op-level attention chain", g


def test_folded_kernels_compile_for_sm90():
    """The interpreter skips Triton's type checks: the folded layouts compiled for sm_90."""
    from helpers import compiled_for_sm90
    assert "compiled 12 kernels for sm_90" in compiled_for_sm90("test_grid_fold:sm90_graphs", timeout=300)
