"""Outputs stored blended with their prior content (Tensor.set_blend): y = alpha * result + beta *
prior, a read-modify-write in every family's store, compared with the float64 reference blended
with the prior by hand. Multi-kernel plans (split-K, split rows, exits, a prologue kernel) blend
exactly once; beta == 0 never reads the prior (NaN there stays out)."""
import json
import math

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from rowmodes import row_options

BLENDS = [(1.0, 1.0), (0.5, 2.0), (1.5, 0.0)]  # accumulate, scale both, beta 0 over a NaN prior
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _graph(dtype=dg.float32):
    return dg.Graph(io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _prior(tensor, beta):
    """The output's memory before the execute, in its declared strides: random where it is read,
    NaN where beta == 0 (it must not be read)."""
    prior = torch.empty_strided(tensor.dim, tensor.stride, dtype=tensor.data_type.torch_dtype)
    if beta == 0.0:
        return prior.fill_(math.nan)
    return prior.copy_(torch.randn(tensor.dim))


def _factor_tensors(graph, blended, factors):
    """Blend `blended` with alpha and beta read from one-element inputs: "device" tensors bound as
    torch tensors, or "host" ones passed by value (Python numbers); returns (alpha, beta) inputs."""
    host = factors == "host"
    alpha = graph.tensor(name="blend_alpha", dim=[1], data_type=dg.float32, is_pass_by_value=host)
    beta = graph.tensor(name="blend_beta", dim=[1], data_type=dg.float32, is_pass_by_value=host)
    for tensor in blended:
        tensor.set_blend(alpha=alpha, beta=beta)
    return alpha, beta


def _factor_values(factors, alpha, beta, handles) -> dict:
    if factors == "numbers":
        return {}
    as_value = (lambda f: f) if factors == "host" else (lambda f: torch.tensor([f]))
    return {handles[0]: as_value(alpha), handles[1]: as_value(beta)}


def check_blended(graph, inputs, alpha, beta, options=None, dtype=torch.float32, outputs=None, factors="numbers",
                  then=()):
    """Blend `outputs` (default: every output) with (alpha, beta), build, execute over random (or
    NaN) priors and compare with alpha * reference + beta * prior in float64; returns the plan's
    launches. `factors`: "numbers" (literals), "device" or "host" (one-element inputs read at each
    execute); with tensors, each (alpha, beta) of `then` runs too, on the same build."""
    blended = list(graph.outputs()) if outputs is None else outputs
    handles = None
    if factors == "numbers":
        for tensor in blended:
            tensor.set_blend(alpha=alpha, beta=beta)
    else:
        handles = _factor_tensors(graph, blended, factors)
    graph.build(options=options)
    launches = graph.plan.launches
    for alpha, beta in ((alpha, beta),) + tuple(then):
        _execute_blended(graph, inputs, alpha, beta, blended, dtype, _factor_values(factors, alpha, beta, handles))
        assert graph.plan.launches is launches  # a new factor value: the same kernels
    return launches


def _execute_blended(graph, inputs, alpha, beta, blended, dtype, factor_values):
    priors = {t.name: _prior(t, beta if t in blended else 0.0) for t in graph.outputs()}
    bound = {name: prior.clone() for name, prior in priors.items()}
    graph.execute({**inputs, **bound, **factor_values})
    refs = graph.reference(inputs)
    for tensor in graph.outputs():
        name, ref = tensor.name, refs[tensor.name]
        if tensor in blended:
            ref = alpha * ref + (beta * priors[name].double() if beta else 0.0)
        out = bound[name].double()
        assert not torch.isnan(out).any(), f"{name}: NaN in output (a prior read with beta 0, or unwritten)"
        err = (out - ref).norm().item() / (ref.norm().item() or 1.0)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("alpha,beta", BLENDS)
def test_pointwise_blend_strided_and_broadcast(alpha, beta):
    g = _graph()
    xt = torch.randn(3, 7, 5).transpose(0, 2)  # non-contiguous
    x = g.tensor_like(xt, name="x")
    b = g.tensor(name="b", dim=[1, 7, 1])  # broadcast operand
    y = g.gelu(g.add(x, b)).set_output(True).set_stride([1, 15, 5])  # a transposed output
    inputs = {x: xt, b: torch.randn(1, 7, 1)}
    check_blended(g, inputs, alpha, beta)
    assert y.blend == ((alpha, beta) if (alpha, beta) != (1.0, 0.0) else None)
    assert f"stored as {alpha!r} * result + {beta!r} * prior" in g.explain()


def test_pointwise_blend_output_smaller_than_domain_blends_once():
    """An output with a broadcast axis of the kernel's domain is stored by one index only."""
    g = _graph()
    x = g.tensor(name="x", dim=[6, 9])
    v = g.tensor(name="v", dim=[1, 9])
    g.mul(x, v).set_output(True)
    g.exp(v).set_output(True)  # [1, 9] in the [6, 9] group
    check_blended(g, {x: torch.randn(6, 9), v: torch.randn(1, 9)}, 1.0, 1.0)


def test_bf16_blend_rounds_once():
    g = _graph(dg.bfloat16)
    x = g.tensor(name="x", dim=[4, 33])
    g.sigmoid(x).set_output(True)
    check_blended(g, {x: torch.randn(4, 33).bfloat16()}, 0.5, 2.0, dtype=torch.bfloat16)


MATMUL_CONFIGS = {"tiled": mm.MatmulConfig("tiled", 16, 16, 16, 4, 2),
                  "split_k": mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3)}


@pytest.mark.parametrize("alpha,beta", BLENDS)
@pytest.mark.parametrize("config", sorted(MATMUL_CONFIGS))
def test_matmul_blend(config, alpha, beta):
    """dW += A @ B: the split-K combine kernel alone blends, once."""
    g = _graph()
    a = g.tensor(name="a", dim=[2, 19, 45])
    b = g.tensor(name="b", dim=[1, 45, 23])
    g.matmul(a, b).set_output(True)
    launches = check_blended(g, {a: torch.randn(2, 19, 45), b: torch.randn(1, 45, 23)}, alpha, beta,
                             dg.BuildOptions(matmul_config=MATMUL_CONFIGS[config]))
    assert len(launches) == (2 if config == "split_k" else 1)


@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("config", sorted(MATMUL_CONFIGS))
def test_matmul_exit_blend(config, axis):
    """A row (axis 2) or column (axis 1) reduction riding on the epilogue as an exit, folded by its
    own kernel, blends once."""
    g = _graph()
    a = g.tensor(name="a", dim=[1, 21, 40])
    b = g.tensor(name="b", dim=[1, 40, 50])
    bias = g.tensor(name="bias", dim=[1, 1, 50])
    y = g.relu(g.add(g.matmul(a, b), bias))
    g.reduction(y, mode="sum", axes=[axis]).set_output(True)
    launches = check_blended(g, {a: torch.randn(1, 21, 40), b: torch.randn(1, 40, 50), bias: torch.randn(1, 1, 50)},
                             0.5, 2.0, dg.BuildOptions(matmul_config=MATMUL_CONFIGS[config]))
    if axis == 2:  # the row sum rides as an exit (a column one here is a row kernel of its own)
        assert any(launch.group.exits for launch in launches)


@pytest.mark.parametrize("alpha,beta", BLENDS)
def test_conv_fprop_blend(alpha, beta):
    g = _graph()
    x = g.tensor(name="x", dim=[2, 3, 7, 6])
    w = g.tensor(name="w", dim=[5, 3, 3, 3])
    g.relu(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])).set_output(True)
    check_blended(g, {x: torch.randn(2, 3, 7, 6), w: torch.randn(5, 3, 3, 3)}, alpha, beta)


@pytest.mark.parametrize("alpha,beta", BLENDS)
@pytest.mark.parametrize("groups", [1, 4])
def test_conv_wgrad_blend(groups, alpha, beta):
    """dW += wgrad(dy, x); a depthwise wgrad (groups == channels) takes the GEMM kernels."""
    g = _graph()
    dy = g.tensor(name="dy", dim=[2, 4, 5, 6])
    x = g.tensor(name="x", dim=[2, 4, 5, 6])
    g.conv_wgrad(dy, x, [4, 4 // groups, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[1, 1],
                 groups=groups).set_output(True)
    check_blended(g, {dy: torch.randn(2, 4, 5, 6), x: torch.randn(2, 4, 5, 6)}, alpha, beta)


@pytest.mark.parametrize("alpha,beta", BLENDS)
@pytest.mark.parametrize("mode", ["one_pass", "looped", "split"])
def test_reduction_blend_every_row_mode(mode, alpha, beta):
    """The split mode's partials are workspace (not blended); its combine blends once."""
    g = _graph()
    x = g.tensor(name="x", dim=[5, 70])
    g.reduction(g.exp(x), mode="sum", axes=[1]).set_output(True)
    check_blended(g, {x: torch.randn(5, 70)}, alpha, beta, row_options(mode))


@pytest.mark.parametrize("mode", ["one_pass", "looped", "split"])
def test_layernorm_outputs_blend(mode):
    g = _graph()
    x = g.tensor(name="x", dim=[6, 40])
    s = g.tensor(name="scale", dim=[1, 40])
    b = g.tensor(name="bias", dim=[1, 40])
    for out in g.layernorm(x, s, b, epsilon=1e-5):
        out.set_output(True)
    check_blended(g, {x: torch.randn(6, 40) * 2 + 3, s: torch.randn(1, 40), b: torch.randn(1, 40)}, 0.5, 2.0,
                  row_options(mode))


def test_batchnorm_outputs_blend():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 4, 5, 5])
    s, b = g.tensor(name="scale", dim=[1, 4, 1, 1]), g.tensor(name="bias", dim=[1, 4, 1, 1])
    rm, rv = g.tensor(name="rm", dim=[1, 4, 1, 1]), g.tensor(name="rv", dim=[1, 4, 1, 1])
    for out in g.batchnorm(x, s, b, rm, rv, momentum=0.2):
        out.set_output(True)
    inputs = {x: torch.randn(3, 4, 5, 5), s: torch.randn(1, 4, 1, 1), b: torch.randn(1, 4, 1, 1),
              rm: torch.randn(1, 4, 1, 1), rv: torch.rand(1, 4, 1, 1) + 0.5}
    check_blended(g, inputs, 1.0, 1.0, row_options("split"))


def test_softmax_and_pooling_blend():
    g = _graph()
    x = g.tensor(name="x", dim=[2, 3, 9, 8])
    g.softmax(x, axis=-1).set_output(True)
    g.pooling(x, mode="max", window=[2, 2], stride=[2, 2], padding=[0, 0]).set_output(True)
    check_blended(g, {x: torch.randn(2, 3, 9, 8)}, 0.5, 2.0)


def test_multi_kernel_plan_blends_only_the_outputs():
    """A pointwise kernel writes a workspace value (not blended) a matmul reads; the matmul's store
    blends."""
    g = _graph()
    a = g.tensor(name="a", dim=[1, 12, 30])
    b = g.tensor(name="b", dim=[1, 30, 10])
    hidden = g.reduction(g.exp(a), mode="max", axes=[2])  # a row kernel into the workspace
    g.matmul(g.sub(a, hidden), b).set_output(True)
    launches = check_blended(g, {a: torch.randn(1, 12, 30), b: torch.randn(1, 30, 10)}, 1.0, 1.0)
    assert len(launches) >= 2


def test_only_blended_outputs_read_their_prior():
    g = _graph()
    x = g.tensor(name="x", dim=[4, 9])
    plain, blended = g.exp(x).set_output(True), g.sin(x).set_output(True)
    check_blended(g, {x: torch.randn(4, 9)}, 0.5, 2.0, outputs=[blended])
    assert plain.blend is None


# --- alpha and beta read from one-element tensors: one build for every value ----------------------
def _pointwise_case():
    g = _graph()
    xt = torch.randn(3, 7, 5).transpose(0, 2)
    x = g.tensor_like(xt, name="x")
    g.gelu(g.add(x, g.tensor(name="b", dim=[1, 7, 1]))).set_output(True)
    return g, {x: xt, "b": torch.randn(1, 7, 1)}, None


def _matmul_case(config):
    def case():
        g = _graph()
        a, b = g.tensor(name="a", dim=[2, 19, 45]), g.tensor(name="b", dim=[1, 45, 23])
        g.matmul(a, b).set_output(True)
        return g, {a: torch.randn(2, 19, 45), b: torch.randn(1, 45, 23)}, dg.BuildOptions(
            matmul_config=MATMUL_CONFIGS[config])
    return case


def _matmul_exit_case():
    g = _graph()
    a, b = g.tensor(name="a", dim=[1, 21, 40]), g.tensor(name="b", dim=[1, 40, 50])
    g.reduction(g.relu(g.matmul(a, b)), mode="sum", axes=[2]).set_output(True)
    return g, {a: torch.randn(1, 21, 40), b: torch.randn(1, 40, 50)}, dg.BuildOptions(
        matmul_config=MATMUL_CONFIGS["split_k"])


def _conv_case():
    g = _graph()
    x, w = g.tensor(name="x", dim=[2, 3, 7, 6]), g.tensor(name="w", dim=[5, 3, 3, 3])
    g.relu(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])).set_output(True)
    return g, {x: torch.randn(2, 3, 7, 6), w: torch.randn(5, 3, 3, 3)}, None


def _conv_stats_case():
    """Split-K conv with per-channel sums riding as a column exit: the combine kernel and the
    exit's fold each store blended, once."""
    g = _graph()
    x, w = g.tensor(name="x", dim=[2, 6, 7, 5]), g.tensor(name="w", dim=[6, 3, 3, 3])
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=2)
    for stat in g.genstats(y):
        stat.set_output(True)
    return g, {x: torch.randn(2, 6, 7, 5), w: torch.randn(6, 3, 3, 3)}, dg.BuildOptions(
        conv_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3))


def _rows_case(mode):
    def case():
        g = _graph()
        x = g.tensor(name="x", dim=[6, 40])
        s, b = g.tensor(name="scale", dim=[1, 40]), g.tensor(name="bias", dim=[1, 40])
        for out in g.layernorm(x, s, b, epsilon=1e-5):
            out.set_output(True)
        g.reduction(g.exp(x), mode="sum", axes=[1]).set_output(True)
        return g, {x: torch.randn(6, 40) * 2 + 3, s: torch.randn(1, 40), b: torch.randn(1, 40)}, row_options(mode)
    return case


def _softmax_pooling_case():
    g = _graph()
    x = g.tensor(name="x", dim=[2, 3, 9, 8])
    g.softmax(x, axis=-1).set_output(True)
    g.pooling(x, mode="max", window=[2, 2], stride=[2, 2], padding=[0, 0]).set_output(True)
    return g, {x: torch.randn(2, 3, 9, 8)}, None


TENSOR_FACTOR_CASES = {"pointwise": _pointwise_case, "matmul": _matmul_case("tiled"),
                       "matmul_split_k": _matmul_case("split_k"), "matmul_exit": _matmul_exit_case,
                       "conv": _conv_case, "conv_split_k_stats": _conv_stats_case, "rows_one_pass": _rows_case("one_pass"), "rows_split": _rows_case("split"),
                       "softmax_pooling": _softmax_pooling_case}


@pytest.mark.parametrize("factors", ["device", "host"])
@pytest.mark.parametrize("case", sorted(TENSOR_FACTOR_CASES))
def test_tensor_factors_change_per_execute(case, factors):
    """alpha and beta from one-element inputs: every family's store reads them in the kernel, a
    new value per execute on the same build (beta 0 over a NaN prior keeps the NaN out)."""
    g, inputs, options = TENSOR_FACTOR_CASES[case]()
    launches = check_blended(g, inputs, 0.5, 2.0, options, factors=factors, then=[(1.5, 0.0), (1.0, 1.0)])
    sources = "".join(launch.source_path.read_text() for launch in launches)
    assert "blend_factor" in sources and "0.5" not in sources  # read, not written into the source


def test_tensor_factors_round_trip_and_explain():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    alpha, beta = g.tensor(name="alpha", dim=[1]), g.tensor(name="beta", dim=[1, 1], is_pass_by_value=True)
    g.exp(x).set_output(True).set_name("y").set_blend(alpha=alpha, beta=beta)
    g2 = dg.Graph.from_json(g.to_json())
    assert [f.name for f in g2.tensor_by_name("y").blend] == ["alpha", "beta"]
    assert json.loads(g2.to_json()) == json.loads(g.to_json())
    g2.build()
    assert "stored as tensor 'alpha' * result + tensor 'beta' * prior" in g2.explain()
    xt, prior = torch.randn(3, 5), torch.randn(3, 5)
    y = prior.clone()
    g2.execute({"x": xt, "y": y, "alpha": torch.tensor([3.0]), "beta": -1.0})
    torch.testing.assert_close(y, 3.0 * xt.exp() - prior)


@pytest.mark.parametrize("retyped", [dg.float8_e8m0, dg.int32, dg.bool_bit_packed])
def test_factor_retyped_after_set_blend_is_refused_at_build(retyped):
    """The factor's checks hold at build too: a type set after set_blend (bytes of e8m0, an
    integer, bits) is refused there, not read as something else."""
    g = _graph()
    y = g.exp(g.tensor(name="x", dim=[3, 5])).set_output(True)
    alpha = g.tensor(name="alpha", dim=[1])
    y.set_blend(alpha=alpha, beta=0.0)
    alpha.set_data_type(retyped)
    with pytest.raises(dg.ValidationError, match="alpha"):
        g.build()


@pytest.mark.parametrize("bound", ["two_elements", "no_axis", "float64", "meta_device", "missing"])
def test_wrong_factor_bindings_are_refused_before_any_write(bound):
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x).set_output(True).set_name("y")
    alpha = g.tensor(name="alpha", dim=[1])
    y.set_blend(alpha=alpha, beta=1.0)
    g.build()
    wrong = {"two_elements": torch.tensor([1.0, 2.0]), "no_axis": torch.tensor(1.0),
             "float64": torch.tensor([1.0], dtype=torch.float64),
             "meta_device": torch.empty(1, device="meta")}
    prior = torch.randn(3, 5)
    y_t = prior.clone()
    with pytest.raises(dg.ExecutionError):
        g.execute({x: torch.randn(3, 5), y: y_t, **({alpha: wrong[bound]} if bound in wrong else {})})
    assert torch.equal(y_t, prior)


@pytest.mark.gpu
@pytest.mark.parametrize("factors", ["device", "host"])
def test_factor_on_the_wrong_device_is_refused_gpu(factors):
    """A device factor bound on the CPU while the rest is on the GPU is refused, nothing written;
    a host (pass-by-value) factor given as a CPU tensor is staged and read."""
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x).set_output(True).set_name("y")
    alpha = g.tensor(name="alpha", dim=[1], is_pass_by_value=factors == "host")
    y.set_blend(alpha=alpha, beta=0.0)
    g.build()
    xt, y_t = torch.randn(3, 5, device="cuda"), torch.full((3, 5), math.nan, device="cuda")
    if factors == "device":
        with pytest.raises(dg.ExecutionError):
            g.execute({x: xt, y: y_t, alpha: torch.tensor([2.0])})
        assert torch.isnan(y_t).all()
        return
    g.execute({x: xt, y: y_t, alpha: torch.tensor([2.0])})
    torch.testing.assert_close(y_t, 2.0 * xt.exp())


@pytest.mark.parametrize("reader", ["matmul", "pointwise", "same_kernel"])
def test_output_over_a_factor_tensor_is_refused(reader):
    """An output bound in place over the one-element input a blended store reads its alpha from
    (after, or in, the kernel that overwrites it) has no safe order: refused, nothing written."""
    g = _graph()
    s = g.tensor(name="s", dim=[1])
    y = g.neg(s).set_output(True).set_name("y")  # elementwise over s: in place, were s read by nothing else
    dims = [1] if reader == "same_kernel" else [4, 6]
    a, b = g.tensor(name="a", dim=dims), g.tensor(name="b", dim=[6, 5])
    z = (g.matmul(a, b) if reader == "matmul" else g.exp(a)).set_output(True).set_name("z")
    z.set_blend(alpha=s, beta=0.0)
    g.build()
    shared, z_t = torch.tensor([2.0]), torch.full(z.dim, math.nan)
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute({s: shared, y: shared, a: torch.randn(dims), b: torch.randn(6, 5), z: z_t})
    assert shared.item() == 2.0 and torch.isnan(z_t).all()
    y_t = torch.empty(1)  # apart, the same plan runs
    g.execute({s: shared, y: y_t, a: torch.ones(dims), b: torch.ones(6, 5), z: z_t})
    assert y_t.item() == -2.0 and torch.allclose(z_t, torch.full(z.dim, 2.0 * (6.0 if reader == "matmul" else math.e)))


@pytest.mark.parametrize("make", ["other_graph", "op_output", "two_elements", "integer", "e8m0", "fp4"])
def test_tensor_factor_refusals(make):
    g = _graph()
    x = g.tensor(name="x", dim=[4])
    y = g.exp(x)
    factor = {"other_graph": lambda: _graph().tensor(name="a", dim=[1]),
              "op_output": lambda: g.exp(g.tensor(name="a", dim=[1])),
              "two_elements": lambda: g.tensor(name="a", dim=[2]),
              "integer": lambda: g.tensor(name="a", dim=[1], data_type=dg.int32),
              # block-scale types are floating, but a kernel reads their bytes, not their values
              "e8m0": lambda: g.tensor(name="a", dim=[1], data_type=dg.float8_e8m0),
              "fp4": lambda: g.tensor(name="a", dim=[1], data_type=dg.float4_e2m1)}[make]()
    with pytest.raises(dg.ValidationError):
        y.set_blend(alpha=factor, beta=1.0)
    assert y.blend is None


# --- what is refused ---------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,beta", [(math.inf, 1.0), (1.0, math.nan), (True, 1.0), ("1", 0.0),
                                        (torch.tensor(1.0), 1.0)])
def test_set_blend_refuses_non_numbers(alpha, beta):
    g = _graph()
    y = g.exp(g.tensor(name="x", dim=[3]))
    with pytest.raises(dg.ValidationError):
        y.set_blend(alpha=alpha, beta=beta)
    assert y.blend is None


def test_blend_refused_on_virtual_integer_and_consumed_tensors():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 4])
    hidden = g.exp(x).set_blend(alpha=1.0, beta=1.0)
    g.relu(hidden).set_output(True)
    with pytest.raises(dg.ValidationError, match="no graph output"):
        g.build()
    hidden.set_output(True)
    with pytest.raises(dg.ValidationError, match="read by node"):
        g.build()
    g = _graph()
    i = g.tensor(name="i", dim=[3], data_type=dg.int32)
    g.add(i, i).set_output(True).set_data_type(dg.int32).set_blend(alpha=1.0, beta=1.0)
    with pytest.raises(dg.ValidationError, match="floating"):
        g.build()


def test_blend_refused_on_layout_op_outputs():
    """A reshape or transpose output is a view of its producer's memory, or a copy kernel's."""
    for layout in (lambda g, t: g.transpose(t, [1, 0]), lambda g, t: g.reshape(t, [12])):
        g = _graph()
        x = g.tensor(name="x", dim=[3, 4])
        layout(g, g.exp(x)).set_output(True).set_blend(alpha=1.0, beta=1.0)
        with pytest.raises(dg.UnsupportedError, match="layout op"):
            g.build()


def test_blend_refused_where_no_kernel_blends():
    """sdpa's stores do not blend: a typed error at build, not a plain store."""
    g = _graph()
    q = g.tensor(name="q", dim=[1, 2, 8, 16])
    k = g.tensor(name="k", dim=[1, 2, 8, 16])
    v = g.tensor(name="v", dim=[1, 2, 8, 16])
    o, _ = g.sdpa(q, k, v, attn_scale=0.25)
    o.set_output(True).set_blend(alpha=1.0, beta=1.0)
    with pytest.raises(dg.UnsupportedError):
        g.build()


def test_blend_round_trips_and_keys_the_plan_cache():
    def graph(beta):
        g = _graph()
        x = g.tensor(name="x", dim=[3, 5])
        g.exp(x).set_output(True).set_name("y").set_blend(alpha=1.0, beta=beta)
        return g, x
    g1, x1 = graph(1.0)
    g2 = dg.Graph.from_json(g1.to_json())
    assert g2.tensor_by_name("y").blend == (1.0, 1.0)
    g3, x3 = graph(2.0)
    xt, prior = torch.randn(3, 5), torch.randn(3, 5)
    for g, beta in ((g2, 1.0), (g3, 2.0), (g1, 1.0)):
        g.build()
        y = prior.clone()
        g.execute({"x": xt, "y": y})
        torch.testing.assert_close(y, xt.exp() + beta * prior)
    document = json.loads(g1.to_json())
    next(t for t in document["tensors"] if t["name"] == "y")["blend"] = [1.0]
    with pytest.raises(dg.SerializationError):
        dg.Graph.from_json(json.dumps(document))


def test_as_function_refuses_blended_outputs_and_runs_plain_ones():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x).set_output(True)
    torch.testing.assert_close(g.as_function()(torch.ones(3, 5)), torch.full((3, 5), math.e))
    y.set_blend(alpha=1.0, beta=1.0)
    with pytest.raises(dg.ValidationError, match="blended"):
        g.as_function()


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiled", "split_k", "persistent"])
def test_matmul_blend_gpu(config):
    """On the GPU: bf16 dW += A @ B through every variant (the persistent one without descriptor
    stores for the blended output)."""
    configs = dict(MATMUL_CONFIGS, persistent=mm.MatmulConfig("persistent", 128, 128, 64, 8, 3, tma_store=True))
    g = _graph(dg.bfloat16)
    a = g.tensor(name="a", dim=[1, 300, 256])
    b = g.tensor(name="b", dim=[1, 256, 264])
    y = g.matmul(a, b).set_output(True).set_blend(alpha=1.0, beta=1.0)
    g.build(options=dg.BuildOptions(matmul_config=configs[config]))
    at, bt = torch.randn(1, 300, 256, device="cuda").bfloat16(), torch.randn(1, 256, 264, device="cuda").bfloat16()
    prior = torch.randn(1, 300, 264, device="cuda").bfloat16()
    out = prior.clone()
    g.execute({a: at, b: bt, y: out})
    ref = at.double() @ bt.double() + prior.double()
    assert (out.double() - ref).norm() / ref.norm() < 1.6e-2


@pytest.mark.gpu
def test_rows_and_pointwise_blend_gpu():
    g = _graph(dg.bfloat16)
    x = g.tensor(name="x", dim=[64, 4096])
    g.reduction(x, mode="sum", axes=[1]).set_output(True).set_blend(alpha=0.5, beta=2.0)
    g.silu(x).set_output(True).set_blend(alpha=1.0, beta=1.0)
    g.build()
    xt = torch.randn(64, 4096, device="cuda").bfloat16()
    priors = [torch.randn(64, 1, device="cuda").bfloat16(), torch.randn(64, 4096, device="cuda").bfloat16()]
    outs = [p.clone() for p in priors]
    g.execute({x: xt, g.outputs()[0]: outs[0], g.outputs()[1]: outs[1]})
    refs = [0.5 * xt.double().sum(1, keepdim=True) + 2 * priors[0].double(),
            torch.nn.functional.silu(xt.double()) + priors[1].double()]
    for out, ref in zip(outs, refs):
        assert (out.double() - ref).norm() / ref.norm() < 1.6e-2


@pytest.mark.parametrize("mode", ["one_pass", "looped", "split"])
def test_row_kernel_epilogue_output_blends_once(mode):
    """An element output of a row kernel's epilogue (a prologue feeding the softmax before it)
    blends once in every mode, the statistics walking the row before the apply stores."""
    g = _graph()
    x = g.tensor(name="x", dim=[5, 70])
    g.mul(g.softmax(g.exp(x), axis=-1), x).set_output(True)
    check_blended(g, {x: torch.randn(5, 70)}, 0.5, 2.0, row_options(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("factors", ["device", "host"])
@pytest.mark.parametrize("config", ["tiled", "split_k", "persistent"])
def test_tensor_factors_gpu(config, factors):
    """On the GPU: alpha and beta read from one-element tensors (device, or host values passed by
    value) by every matmul variant and a row kernel, new values on the same build."""
    configs = dict(MATMUL_CONFIGS, persistent=mm.MatmulConfig("persistent", 128, 128, 64, 8, 3, tma_store=True))
    g = _graph(dg.bfloat16)
    a, b = g.tensor(name="a", dim=[1, 300, 256]), g.tensor(name="b", dim=[1, 256, 264])
    y = g.matmul(a, b).set_output(True)
    r = g.reduction(g.exp(a), mode="sum", axes=[2]).set_output(True)
    alpha, beta = _factor_tensors(g, [y, r], factors)
    g.build(options=dg.BuildOptions(matmul_config=configs[config]))
    at, bt = torch.randn(1, 300, 256, device="cuda").bfloat16(), torch.randn(1, 256, 264, device="cuda").bfloat16()
    for a_value, b_value in ((1.0, 1.0), (0.5, 0.0), (-2.0, 0.25)):
        priors = {y: torch.randn(1, 300, 264, device="cuda").bfloat16(),
                  r: torch.randn(1, 300, 1, device="cuda").bfloat16()}
        if b_value == 0.0:
            priors = {t: p.fill_(float("nan")) for t, p in priors.items()}
        bound = {t: p.clone() for t, p in priors.items()}
        values = _factor_values(factors, a_value, b_value, (alpha, beta))
        values = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        g.execute({a: at, b: bt, **bound, **values})
        results = {y: at.double() @ bt.double(), r: at.double().exp().sum(2, keepdim=True)}
        for t, result in results.items():
            ref = a_value * result + (b_value * priors[t].double() if b_value else 0.0)
            assert not torch.isnan(bound[t]).any()
            assert (bound[t].double() - ref).norm() / ref.norm() < 1.6e-2


def test_factor_tensors_are_not_written_back_by_the_interpreter_process(monkeypatch):
    """CPU tensors sent to the interpreter process (as on a GPU machine) are copied back only
    where a kernel writes them: a factor tensor is read, never rewritten (another thread may be
    setting the next value meanwhile)."""
    from dnngraph.runtime import interpreter as runtime
    from dnngraph.runtime import interpreter_client

    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x).set_output(True).set_name("y")
    alpha = g.tensor(name="alpha", dim=[1])
    y.set_blend(alpha=alpha, beta=0.0)
    g.build()
    written, copy_out = [], interpreter_client.copy_out
    monkeypatch.setattr(interpreter_client, "copy_out",
                        lambda arena, tensor, place: (written.append(tensor.data_ptr()), copy_out(arena, tensor, place)))
    runtime.force_interpreter_worker(True)
    try:
        xt, yt, alpha_t = torch.randn(3, 5), torch.empty(3, 5), torch.tensor([2.0])
        g.execute({x: xt, y: yt, alpha: alpha_t})
    finally:
        runtime.force_interpreter_worker(False)
    torch.testing.assert_close(yt, 2.0 * xt.exp())
    assert written == [yt.data_ptr()]


def test_serialized_plan_with_a_factor_declared_after_its_output_loads():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x).set_output(True).set_name("y")
    alpha = g.tensor(name="alpha", dim=[1], is_pass_by_value=True)  # made after y: a later uid
    y.set_blend(alpha=alpha, beta=0.0)
    g.build()
    loaded = dg.Graph.deserialize(g.serialize())
    xt, yt = torch.randn(3, 5), torch.full((3, 5), math.nan)
    loaded.execute({"x": xt, "y": yt, "alpha": 2.0})
    torch.testing.assert_close(yt, 2.0 * xt.exp())
