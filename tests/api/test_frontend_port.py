"""Code written for the cuDNN frontend's Python API runs on dnngraph with its import changed.

The canonical examples are written as frontend code is (its keyword names, enum namespaces, build
steps and execute(variant_pack, workspace)) and compared with the float64 reference; every entry
of the alias table (dnngraph/frontend.py) is exercised from the table itself.
"""
from __future__ import annotations

import pytest
import torch

import dnngraph as cudnn
from dnngraph.frontend import FRONTEND_KEYWORDS, FRONTEND_METHODS
from dnngraph.ops.pointwise import POINTWISE_OPS

from helpers import TOLERANCE, poisoned, rel_err


def _built_the_frontend_way(graph):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def _run_and_compare(graph, inputs: dict, outputs: list, tolerance=TOLERANCE[torch.float32]):
    results = {tensor: poisoned(tensor) for tensor in outputs}
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8)
    graph.execute({**inputs, **results}, workspace)
    reference = graph.reference(inputs)
    for tensor, value in results.items():
        assert rel_err(value, reference[tensor.name]) < tolerance, tensor.name


def _nhwc(n, c, h, w):
    return torch.randn(n, h, w, c).permute(0, 3, 1, 2)  # logical NCHW, channels-last storage


def test_conv_bias_relu_as_frontend_code():
    x, w, b = _nhwc(2, 5, 7, 9), _nhwc(6, 5, 3, 3), torch.randn(1, 6, 1, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    X = graph.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=cudnn.data_type.FLOAT)
    W = graph.tensor(name="W", dim=list(w.shape), stride=list(w.stride()), data_type=cudnn.data_type.FLOAT)
    B = graph.tensor(name="B", dim=list(b.shape), stride=list(b.stride()), data_type=cudnn.data_type.FLOAT)
    conv_output = graph.conv_fprop(image=X, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1],
                                   compute_data_type=cudnn.data_type.FLOAT)
    bias_output = graph.bias(name="bias", input=conv_output, bias=B)
    Y = graph.relu(name="relu", input=bias_output)
    Y.set_output(True)
    _built_the_frontend_way(graph)
    assert graph.get_engine_count() >= 1 and isinstance(graph.get_plan_name_at_index(0), str)
    _run_and_compare(graph, {X: x, W: w, B: b}, [Y])


def test_matmul_gelu_as_frontend_code():
    a, b = torch.randn(3, 17, 13), torch.randn(3, 23, 13).transpose(1, 2)  # B column-major
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    A = graph.tensor_like(a)
    B = graph.tensor_like(b)
    C = graph.matmul(name="matmul", A=A, B=B, compute_data_type=cudnn.data_type.FLOAT)
    Y = graph.gelu(name="gelu", input=C)
    Y.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    _built_the_frontend_way(graph)
    _run_and_compare(graph, {A: a, B: b}, [Y])


def test_layernorm_training_as_frontend_code():
    x = torch.randn(3, 7, 19)[:, ::2, :]  # rows 2 apart: non-contiguous
    scale, bias = torch.randn(1, 1, 19), torch.randn(1, 1, 19)
    graph = cudnn.pygraph(intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    X = graph.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=cudnn.data_type.FLOAT)
    S = graph.tensor(name="scale", dim=[1, 1, 19], stride=[19, 19, 1], data_type=cudnn.data_type.FLOAT)
    Bi = graph.tensor(name="bias", dim=[1, 1, 19], stride=[19, 19, 1], data_type=cudnn.data_type.FLOAT)
    eps = graph.tensor(name="epsilon", dim=[1, 1, 1], stride=[1, 1, 1], data_type=cudnn.data_type.FLOAT,
                       is_pass_by_value=True)
    Y, mean, inv_var = graph.layernorm(name="LN", norm_forward_phase=cudnn.norm_forward_phase.TRAINING,
                                       input=X, scale=S, bias=Bi, epsilon=eps)
    Y.set_output(True)
    mean.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    inv_var.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    _built_the_frontend_way(graph)
    _run_and_compare(graph, {X: x, S: scale, Bi: bias, eps: torch.full((1, 1, 1), 1e-5)}, [Y, mean, inv_var])


def test_sdpa_as_frontend_code():
    b, h, s, d = 2, 3, 37, 16
    q = torch.randn(b, s, h, d).transpose(1, 2)  # BSHD storage
    k, v = torch.randn(b, h, 29, d), torch.randn(b, h, 29, d)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    Q, K, V = graph.tensor_like(q), graph.tensor_like(k), graph.tensor_like(v)
    O, stats = graph.sdpa(name="sdpa", q=Q, k=K, v=V, is_inference=False, attn_scale=d ** -0.5,
                          use_causal_mask=True, compute_data_type=cudnn.data_type.FLOAT)
    O.set_output(True).set_stride(list(q.stride()))
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    _built_the_frontend_way(graph)
    _run_and_compare(graph, {Q: q, K: k, V: v}, [O, stats], tolerance=1e-4)


# --- the alias table, entry by entry ---------------------------------------------------------------
def _t(graph, dims, data_type=cudnn.float32):
    return graph.tensor(dim=dims, data_type=data_type)


def _pointwise_arguments(graph, op):
    entry = POINTWISE_OPS[op]
    boolean = op in ("logical_and", "logical_or", "logical_not")
    args = {name: _t(graph, [2, 3], cudnn.bool if boolean else cudnn.float32) for name in entry.operand_names}
    if op == "where":
        args["condition"] = _t(graph, [2, 3], cudnn.bool)
    if op in ("leaky_relu", "leaky_relu_backward"):
        args["negative_slope"] = 0.1
    if op == "gen_index":
        args["axis"] = 1
    return args


def _norm_arguments(graph, op):
    x = _t(graph, [2, 5, 3, 3])
    per_channel = [1, 5, 1, 1]
    if op in ("layernorm", "rmsnorm", "adalayernorm"):
        return {"x": x, "scale": _t(graph, [1, 5, 3, 3]), "bias": _t(graph, [1, 5, 3, 3])}
    if op == "genstats":
        return {"x": x}
    if op == "batchnorm_inference":
        return {"x": x, "mean": _t(graph, per_channel), "inv_variance": _t(graph, per_channel),
                "scale": _t(graph, per_channel), "bias": _t(graph, per_channel)}
    return {"x": x, "scale": _t(graph, per_channel), "bias": _t(graph, per_channel)}


def _norm_backward_arguments(graph, op):
    per_sample = [2, 1, 1, 1]
    scale = [1, 5, 3, 3] if op in ("layernorm_backward", "rmsnorm_backward", "adalayernorm_backward") \
        else [1, 5, 1, 1]
    stats = per_sample if op != "batchnorm_backward" else [1, 5, 1, 1]
    if op == "instancenorm_backward":
        stats = [2, 5, 1, 1]
    args = {"dy": _t(graph, [2, 5, 3, 3]), "x": _t(graph, [2, 5, 3, 3]), "scale": _t(graph, scale),
            "inv_variance": _t(graph, stats)}
    if op != "rmsnorm_backward":
        args["mean"] = _t(graph, stats)
    return args


def _sdpa_arguments(graph, op):
    q, k, v = (_t(graph, [1, 2, 5, 8]) for _ in range(3))
    if op == "sdpa":
        return {"q": q, "k": k, "v": v}
    return {"q": q, "k": k, "v": v, "o": _t(graph, [1, 2, 5, 8]), "dO": _t(graph, [1, 2, 5, 8]),
            "stats": _t(graph, [1, 2, 5, 1])}


RECIPES = {
    "matmul": lambda g, op: {"a": _t(g, [3, 4]), "b": _t(g, [4, 5])},
    "conv_fprop": lambda g, op: {"x": _t(g, [1, 2, 5, 5]), "w": _t(g, [3, 2, 3, 3]), "mode": "convolution"},
    "conv_dgrad": lambda g, op: {"dy": _t(g, [1, 3, 3, 3]), "w": _t(g, [3, 2, 3, 3]), "x_dim": [1, 2, 5, 5],
                                 "mode": "convolution"},
    "conv_wgrad": lambda g, op: {"dy": _t(g, [1, 3, 3, 3]), "x": _t(g, [1, 2, 5, 5]), "w_dim": [3, 2, 3, 3],
                                 "mode": "convolution"},
    "reduction": lambda g, op: {"x": _t(g, [2, 3]), "mode": cudnn.reduction_mode.ADD, "axes": [1]},
    "reshape": lambda g, op: {"x": _t(g, [2, 3]), "dim": [3, 2]},
    "transpose": lambda g, op: {"x": _t(g, [2, 3]), "permutation": [1, 0]},
    "slice": lambda g, op: {"x": _t(g, [4, 3]), "slices": [slice(1, 3), slice(0, 3)]},
    "identity": lambda g, op: {"x": _t(g, [2, 3])},
    "concatenate": lambda g, op: {"tensors": [_t(g, [2, 3]), _t(g, [2, 1])], "axis": 1},
    "tensor_like": lambda g, op: {"like": torch.randn(2, 3)},
    "block_scale_quantize": lambda g, op: {"x": _t(g, [4, 64]), "block_size": 32},
    "block_scale_dequantize": lambda g, op: {"x": _t(g, [4, 64], cudnn.float8_e4m3),
                                             "scale": _t(g, [4, 2], cudnn.float8_e8m0), "block_size": [1, 32]},
    **{op: _norm_arguments for op in ("layernorm", "adalayernorm", "rmsnorm", "batchnorm", "batchnorm_inference",
                                      "instancenorm", "genstats")},
    **{op: _norm_backward_arguments for op in ("layernorm_backward", "adalayernorm_backward", "rmsnorm_backward",
                                               "batchnorm_backward", "instancenorm_backward")},
    "sdpa": _sdpa_arguments, "sdpa_backward": _sdpa_arguments,
}


def _arguments(graph, op):
    return RECIPES[op](graph, op) if op in RECIPES else _pointwise_arguments(graph, op)


ALIASES = [(op, alias, own) for op, table in FRONTEND_KEYWORDS.items() for alias, own in table.items()]


@pytest.mark.parametrize("op, alias, own", ALIASES, ids=[f"{op}-{alias}" for op, alias, _ in ALIASES])
def test_each_frontend_keyword_means_its_dnngraph_keyword(op, alias, own):
    """The graph a call spelt with the frontend's keyword makes is the one dnngraph's makes."""
    ours, theirs = cudnn.Graph(name="g"), cudnn.Graph(name="g")
    with_own = _arguments(ours, op)
    getattr(ours, op)(**with_own)
    with_alias = _arguments(theirs, op)
    with_alias[alias] = with_alias.pop(own)
    getattr(theirs, op)(**with_alias)
    assert theirs.to_json() == ours.to_json()


@pytest.mark.parametrize("op, alias, own", ALIASES, ids=[f"{op}-{alias}" for op, alias, _ in ALIASES])
def test_both_spellings_at_once_are_refused(op, alias, own):
    graph = cudnn.Graph(name="g")
    arguments = _arguments(graph, op)
    arguments[alias] = arguments[own]
    before = graph.to_json()
    with pytest.raises(cudnn.ValidationError, match=f"{op}: {own} given twice"):
        getattr(graph, op)(**arguments)
    assert graph.to_json() == before


def test_an_alias_beside_its_argument_given_by_position_is_refused():
    graph = cudnn.Graph(name="g")
    x, w = _t(graph, [1, 2, 5, 5]), _t(graph, [3, 2, 3, 3])
    with pytest.raises(cudnn.ValidationError, match="conv_fprop: x given twice"):
        graph.conv_fprop(x, w, image=x)
    with pytest.raises(cudnn.ValidationError, match="relu: x given twice"):
        graph.relu(x, input=x)
    assert graph.nodes == []


@pytest.mark.parametrize("op", sorted(FRONTEND_KEYWORDS))
def test_unknown_keywords_are_refused_naming_the_accepted_ones(op):
    graph = cudnn.Graph(name="g")
    arguments = _arguments(graph, op)
    with pytest.raises(cudnn.ValidationError, match=f"{op}: unknown keyword 'not_a_keyword'; it takes .*name"):
        getattr(graph, op)(**arguments, not_a_keyword=1)


@pytest.mark.parametrize("op", sorted(set(FRONTEND_KEYWORDS) - {"tensor_like"}))
def test_compute_data_type_float32_or_unset(op):
    """float32 (or unset) is taken; another type is a typed error that adds nothing."""
    graph = cudnn.Graph(name="g")
    arguments = _arguments(graph, op)
    before = graph.to_json()
    with pytest.raises(cudnn.ValidationError, match="compute_data_type must be float32"):
        getattr(graph, op)(**arguments, compute_data_type=cudnn.data_type.HALF)
    assert graph.to_json() == before
    getattr(graph, op)(**arguments, compute_data_type=cudnn.data_type.FLOAT, name="named")
    getattr(graph, op)(**_arguments(graph, op), compute_data_type=cudnn.data_type.NOT_SET)


# --- the frontend's method names -------------------------------------------------------------------
METHODS = sorted(FRONTEND_METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_each_frontend_method_is_its_dnngraph_op(name):
    """Called by the frontend's keywords, the method adds the node its dnngraph method adds."""
    target, theirs, ours = FRONTEND_METHODS[name]
    mine, frontend_graph = cudnn.Graph(name="g"), cudnn.Graph(name="g")
    own = _pointwise_arguments(mine, target)
    getattr(mine, target)(**own)
    spelt = _pointwise_arguments(frontend_graph, target)
    getattr(frontend_graph, name)(**{t: spelt[o] for t, o in zip(theirs, ours)},
                                  compute_data_type=cudnn.data_type.FLOAT)
    assert frontend_graph.to_json() == mine.to_json()


@pytest.mark.parametrize("name", METHODS)
def test_frontend_methods_refuse_unknown_keywords(name):
    graph = cudnn.Graph(name="g")
    with pytest.raises(cudnn.ValidationError, match=f"{name}: .*it takes"):
        getattr(graph, name)(graph.tensor(dim=[2]), bogus=1)


def _select_graph():
    graph = cudnn.pygraph(compute_data_type=cudnn.data_type.FLOAT)
    a = graph.tensor(dim=[5, 7], stride=[13, 2], data_type=cudnn.data_type.FLOAT)  # every other column
    b, m = _t(graph, [1, 7]), _t(graph, [5, 1], cudnn.bool)
    y = graph.identity(input=graph.binary_select(input0=graph.max(input0=a, input1=b), input1=graph.min(a, b), mask=m))
    z = graph.cmp_neq(input=graph.gelu_approx_tanh(input=a), comparison=b)
    y.set_output(True)
    z.set_output(True).set_data_type(cudnn.data_type.BOOLEAN)
    return graph, a, b, m, y, z


def test_frontend_methods_compute_against_the_reference():
    """binary_select is input0 where mask holds; max, min, cmp_neq, gelu_approx_tanh, identity."""
    graph, a, b, m, y, z = _select_graph()
    _built_the_frontend_way(graph)
    at, bt = torch.randn(5, 13)[:, ::2], torch.randn(1, 7)
    mt = torch.rand(5, 1) > 0.5
    out_y, out_z = poisoned(y), torch.zeros(5, 7, dtype=torch.bool)
    graph.execute({a: at, b: bt, m: mt, y: out_y, z: out_z})
    expected = torch.where(mt, torch.maximum(at, bt), torch.minimum(at, bt))
    assert rel_err(out_y, expected) < TOLERANCE[torch.float32]
    assert torch.equal(out_z, graph.reference({a: at, b: bt, m: mt})[z.name].bool())


# --- the build steps --------------------------------------------------------------------------------
def _small_graph():
    graph = cudnn.pygraph()
    x = _t(graph, [3, 5])
    y = graph.relu(input=x)
    y.set_output(True)
    return graph, x, y


def test_build_steps_are_repeatable_and_build_plans_all_builds_every_index():
    graph, x, y = _small_graph()
    for _ in range(2):
        _built_the_frontend_way(graph)
    graph.build_plans(cudnn.build_plan_policy.ALL)
    xt = torch.randn(3, 5)
    for index in range(graph.get_engine_count()):
        out = poisoned(y)
        graph.execute_plan_at_index({x: xt, y: out}, index)
        assert torch.equal(out, torch.relu(xt))
        parts = graph.get_plan_name_at_index(index).split("; ")
        assert [part.split(":")[0] for part in parts] == [group.kind for group in graph.plans()]


def test_build_takes_the_frontends_heur_modes():
    graph, x, y = _small_graph()
    graph.build([cudnn.heur_mode.A])
    xt, out = torch.randn(3, 5), poisoned(y)
    graph.execute({x: xt, y: out})
    assert torch.equal(out, torch.relu(xt))
    with pytest.raises(cudnn.ValidationError, match="heur_modes"):
        graph.build(["A"])


def test_build_steps_refuse_bad_arguments_with_typed_errors():
    graph, _, _ = _small_graph()
    with pytest.raises(cudnn.ValidationError, match="heur_modes"):
        graph.create_execution_plans(["A"])
    with pytest.raises(cudnn.ValidationError, match="policy"):
        graph.build_plans("ALL")
    with pytest.raises(cudnn.ValidationError, match="plan index"):
        graph.get_plan_name_at_index(graph.get_engine_count())


def test_check_support_raises_the_unsupported_error_build_raises():
    """A convolution of int32 operands: ranked, but refused as it lowers."""
    def int32_conv():
        graph = cudnn.pygraph()
        x = graph.tensor(name="x", dim=[1, 3, 5, 5], data_type=cudnn.data_type.INT32)
        w = graph.tensor(name="w", dim=[2, 3, 3, 3])
        graph.conv_fprop(image=x, weight=w, padding=[1, 1]).set_output(True)
        return graph

    with pytest.raises(cudnn.UnsupportedError) as by_build:
        int32_conv().build()
    graph = int32_conv()
    graph.build_operation_graph().create_execution_plans()
    with pytest.raises(cudnn.UnsupportedError) as by_check:
        graph.check_support()
    assert str(by_check.value) == str(by_build.value)
    assert graph.plan is None


def test_check_support_raises_what_build_would():
    """A graph with no ops fails the steps as build() does."""
    graph = cudnn.pygraph()
    graph.tensor(dim=[2])
    with pytest.raises(cudnn.ValidationError) as by_build:
        graph.build()
    with pytest.raises(cudnn.ValidationError) as by_steps:
        graph.build_operation_graph()
    assert str(by_steps.value) == str(by_build.value)


# --- gen_index: the index along an axis -------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_gen_index_gives_each_elements_index_along_its_axis(axis):
    x = torch.randn(3, 7, 9, 5).permute(0, 3, 1, 2)  # [3, 5, 7, 9], channels-last storage
    graph = cudnn.pygraph()
    X = graph.tensor_like(x)
    index = graph.gen_index(input=X, axis=axis, compute_data_type=cudnn.data_type.INT32)
    index.set_output(True).set_data_type(cudnn.data_type.INT32)
    as_float = graph.gen_index(X, axis)
    as_float.set_output(True)
    _built_the_frontend_way(graph)
    out_int = torch.empty_strided(index.dim, index.stride, dtype=torch.int32).fill_(-1)
    out_float = poisoned(as_float)
    graph.execute({X: x, index: out_int, as_float: out_float})
    shape = [1, 1, 1, 1]
    shape[axis] = x.shape[axis]
    expected = torch.arange(x.shape[axis]).reshape(shape).expand(x.shape)
    assert torch.equal(out_int, expected.int())
    assert torch.equal(out_float, expected.float())
    assert torch.equal(graph.reference({X: x})[index.name], expected.double())


def test_gen_index_masks_a_matmul_output_as_the_frontends_flexible_attention_does():
    """A lower-triangular mask from two gen_index ops over a matmul's output (the anchor does not
    absorb them: only the pointwise kernel knows each element's index)."""
    a, b = torch.randn(2, 11, 6), torch.randn(2, 6, 13)
    graph = cudnn.pygraph()
    A, B = graph.tensor_like(a), graph.tensor_like(b)
    scores = graph.matmul(A=A, B=B)
    row, col = graph.gen_index(input=scores, axis=1), graph.gen_index(input=scores, axis=2)
    Y = graph.binary_select(input0=scores, input1=0.0, mask=graph.cmp_ge(input=row, comparison=col))
    Y.set_output(True)
    _built_the_frontend_way(graph)
    out = poisoned(Y)
    graph.execute({A: a, B: b, Y: out})
    expected = torch.tril(a.double() @ b.double())
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
    assert rel_err(out, graph.reference({A: a, B: b})[Y.name]) < TOLERANCE[torch.float32]


def test_gen_index_takes_no_gradient():
    """d(x * index)/dx is the index: gen_index itself passes no gradient to x."""
    graph = cudnn.pygraph()
    X = _t(graph, [4, 6])
    graph.mul(X, graph.gen_index(input=X, axis=1)).set_output(True)
    x = torch.randn(4, 6, requires_grad=True)
    graph.as_function()(x).sum().backward()
    assert torch.equal(x.grad, torch.arange(6.0).expand(4, 6))


def test_gen_index_refuses_an_axis_past_the_last_and_adds_nothing():
    graph = cudnn.pygraph()
    x = _t(graph, [2, 3])
    before = graph.to_json()
    with pytest.raises(cudnn.ValidationError, match="gen_index: axis 2 is past the last axis"):
        graph.gen_index(input=x, axis=2)
    with pytest.raises(cudnn.ValidationError, match="axis"):
        graph.gen_index(input=x, axis=-1)
    with pytest.raises(cudnn.ValidationError, match="compute_data_type must be float32"):
        graph.gen_index(input=x, axis=0, compute_data_type=cudnn.data_type.HALF)
    assert graph.to_json() == before


def gen_index_graphs():
    """(label, built graph) for tests/sm90_compile.py: gen_index's counters in a standalone
    pointwise kernel (int32 output, and a causal mask applied to a matmul's bf16 output), planned
    for an H100."""
    h100 = cudnn.BuildOptions(target=cudnn.target.H100)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[3, 37, 21])
    g.gen_index(input=x, axis=1, compute_data_type=cudnn.data_type.INT32).set_output(True).set_data_type(
        cudnn.data_type.INT32)
    yield "gen_index int32", g.build(options=h100)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    a, b = g.tensor(name="a", dim=[2, 129, 64]), g.tensor(name="b", dim=[2, 64, 129])
    scores = g.matmul(A=a, B=b)
    row, col = g.gen_index(input=scores, axis=1), g.gen_index(input=scores, axis=2)
    g.binary_select(scores, g.mul(scores, 0.0), g.cmp_ge(row, col)).set_output(True)
    yield "gen_index causal mask", g.build(options=h100)


def test_gen_index_compiles_for_sm90():
    """gen_index's kernels pass the GPU compiler (on this machine, for sm_90)."""
    from helpers import compiled_for_sm90
    assert "compiled 3 kernels for sm_90" in compiled_for_sm90("test_frontend_port:gen_index_graphs")
