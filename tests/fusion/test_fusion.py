"""Partition structure: how many kernels each pattern becomes, and what each group holds."""
import dnngraph as dg
from dnngraph.fusion import partition


def kinds(graph):
    return [(g.kind, [n.op for n in g.nodes]) for g in partition(graph)]


def test_conv_bias_relu_is_one_group():
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[8, 64, 56, 56]), g.tensor(name="w", dim=[64, 64, 3, 3])
    b = g.tensor(name="b", dim=[1, 64, 1, 1])
    g.relu(g.add(g.conv_fprop(x, w, padding=[1, 1]), b)).set_output(True)
    assert kinds(g) == [("conv", ["conv_fprop", "add", "relu"])]


def test_matmul_bias_gelu_residual_stores_pre_activation():
    g = dg.Graph()
    a, w = g.tensor(name="a", dim=[128, 64]), g.tensor(name="w", dim=[64, 32])
    b, r = g.tensor(name="b", dim=[1, 32]), g.tensor(name="r", dim=[128, 32])
    pre = g.add(g.matmul(a, w), b).set_output(True)
    out = g.add(g.gelu(pre), r).set_output(True)
    (group,) = partition(g)
    assert group.kind == "matmul" and [n.op for n in group.epilogue] == ["add", "gelu", "add"]
    assert {t.name for t in group.outputs} == {pre.name, out.name}


def test_residual_add_rmsnorm_scale_cast_stores_the_sum():
    g = dg.Graph()
    x, r, s = g.tensor(name="x", dim=[16, 256]), g.tensor(name="r", dim=[16, 256]), g.tensor(name="s", dim=[1, 256])
    h = g.add(x, r).set_output(True)
    y, _ = g.rmsnorm(h, s, norm_forward_phase="inference")
    g.cast(g.mul(y, 2.0), dg.bfloat16).set_output(True)
    (group,) = partition(g)
    assert [n.op for n in group.nodes] == ["add", "rmsnorm", "mul", "cast"]
    assert h in group.outputs


def test_scale_mask_softmax_is_one_group():
    g = dg.Graph()
    x, m = g.tensor(name="x", dim=[4, 8, 128, 128]), g.tensor(name="m", dim=[1, 1, 128, 128])
    g.softmax(g.add(g.mul(x, 0.125), m)).set_output(True)
    assert kinds(g) == [("softmax", ["mul", "add", "softmax"])]


def test_attention_written_as_ops_is_one_group():
    g = dg.Graph()
    q, kt, v = (g.tensor(name=n, dim=d) for n, d in
                (("q", [2, 4, 64, 32]), ("kt", [2, 4, 32, 64]), ("v", [2, 4, 64, 32])))
    g.matmul(g.softmax(g.mul(g.matmul(q, kt), 0.17)), v).set_output(True)
    assert kinds(g) == [("attention", ["matmul", "mul", "softmax", "matmul"])]


def test_sdpa_op_with_output_cast_is_one_group():
    g = dg.Graph()
    q, k, v = (g.tensor(name=n, dim=[2, 4, 64, 32]) for n in "qkv")
    o, _ = g.sdpa(q, k, v)
    g.cast(o, dg.float16).set_output(True)
    assert kinds(g) == [("sdpa", ["sdpa", "cast"])]


def test_value_needed_elsewhere_is_not_absorbed_as_prologue():
    g = dg.Graph()
    x, m = g.tensor(name="x", dim=[4, 16]), g.tensor(name="m", dim=[4, 16])
    scaled = g.mul(x, 0.5)
    g.softmax(scaled).set_output(True)
    g.add(scaled, m).set_output(True)
    groups = kinds(g)
    assert ("softmax", ["softmax"]) in groups and len(groups) == 2


def test_groups_never_form_a_cycle():
    # a -> reduction -> b, and a -> b directly: a and b cannot share a pointwise kernel
    g = dg.Graph()
    x = g.tensor(name="x", dim=[8, 32])
    a = g.exp(x)
    total = g.reduction(a, "sum", [1])
    g.div(a, total).set_output(True)
    groups = partition(g)
    order = [gr.kind for gr in groups]
    assert order.index("reduction") < len(order) - 1
    for i, group in enumerate(groups):  # every input is produced by an earlier group or the user
        earlier = {t.uid for gr in groups[:i] for t in gr.outputs}
        assert all(t.producer is None or t.uid in earlier for t in group.inputs)


def test_groups_convex_one_by_one_never_wait_on_each_other_in_a_ring():
    # the norm kernel takes maximum(reduction(f), y) as its epilogue; a pointwise group of f and
    # mul(inv_variance, f) would be convex at the node level, yet it needs the norm kernel while
    # the reduction (and so the norm kernel) needs it: mul runs apart (a fuzz graph found it)
    import torch
    from helpers import check
    g = dg.Graph()
    x, s = g.tensor(name="x", dim=[4, 1, 8, 4]), g.tensor(name="s", dim=[1, 1, 1, 4])
    y, inv = g.rmsnorm(x, s, epsilon=1e-3)
    f = g.floor(s)
    g.mul(inv, f).set_output(True).set_name("scaled")
    g.maximum(g.reduction(f, "norm1", [0, 2]), y).set_output(True).set_name("top")
    y.set_output(True).set_name("y")
    groups = partition(g)
    for i, group in enumerate(groups):  # every input is produced by an earlier group or the user
        earlier = {t.uid for gr in groups[:i] for t in gr.outputs}
        assert all(t.producer is None or t.uid in earlier for t in group.inputs), group.describe()
    gen = torch.Generator().manual_seed(1387)
    check(g, {"x": torch.randn(4, 1, 8, 4, generator=gen), "s": torch.randn(1, 1, 1, 4, generator=gen) * 3})


def test_attention_chain_without_its_kernel_splits_into_runnable_groups():
    import torch
    from helpers import check

    from dnngraph.backends import registry

    g = dg.Graph()
    q, kt, v = (g.tensor(name=n, dim=d) for n, d in
                (("q", [2, 3, 17, 8]), ("kt", [2, 3, 8, 19]), ("v", [2, 3, 19, 5])))
    g.matmul(g.softmax(g.mul(g.matmul(q, kt), 0.3)), v).set_output(True)
    groups = [(gr.kind, [n.op for n in gr.nodes]) for gr in partition(g, registry.families())]
    if "attention" in registry.families():  # with an op-level attention kernel the chain is one group
        assert groups == [("attention", ["matmul", "mul", "softmax", "matmul"])]
    else:
        assert groups == [("matmul", ["matmul", "mul"]), ("softmax", ["softmax"]), ("matmul", ["matmul"])]
    torch.manual_seed(0)
    check(g, {"q": torch.randn(2, 3, 17, 8), "kt": torch.randn(2, 3, 8, 19), "v": torch.randn(2, 3, 19, 5)})


# --- casts and reshapes of what an anchor makes: no kernel of their own ---------------------------
def _lone_groups(groups):
    """Groups that only move or convert values: layout copies and pointwise groups of casts."""
    return [g for g in groups if g.kind == "copy" or all(n.op == "cast" for n in g.nodes)]


def _strided(torch, dims, order):
    """Fresh random values in a non-contiguous layout: the axes permuted in memory by `order`."""
    return torch.randn([dims[a] for a in order]).permute([order.index(a) for a in range(len(dims))])


def test_batchnorm_statistics_cast_and_reshaped_ride_the_norm_kernel():
    """The casts of a training batch norm's statistics (fp32 -> fp16, as torch's running stats of
    a half model) and their reshape to [C] outputs: one norm kernel writes them all."""
    import torch
    from helpers import check

    g = dg.Graph(name="bn_stats")
    x = g.tensor(name="x", dim=[3, 5, 7, 6], stride=[210, 1, 30, 5])  # channels-last
    params = [g.tensor(name=n, dim=[1, 5, 1, 1]) for n in ("scale", "bias", "running_mean", "running_var")]
    y, mean, inv_variance, next_mean, next_var = g.batchnorm(x, *params, epsilon=1e-5, momentum=0.1)
    g.relu(y).set_output(True)
    for stat in (mean, inv_variance, next_mean, next_var):
        g.reshape(g.cast(stat, dg.float16), [5]).set_output(True).set_data_type(dg.float16)
    groups = partition(g)
    assert [(gr.kind, len(gr.nodes)) for gr in groups] == [("norm", 6)]  # batchnorm, relu, four casts
    assert not groups.views.copies
    torch.manual_seed(0)
    inputs = {"x": _strided(torch, [3, 5, 7, 6], [0, 2, 3, 1]) * 3 + 1, "scale": torch.randn(1, 5, 1, 1),
              "bias": torch.randn(1, 5, 1, 1), "running_mean": torch.randn(1, 5, 1, 1),
              "running_var": torch.rand(1, 5, 1, 1) + 0.5}
    check(g, inputs, dtype=torch.float16)


def test_layernorm_and_batchnorm_backward_side_outputs_take_pointwise_epilogues():
    import torch
    from helpers import check

    torch.manual_seed(1)
    x_values, xb_values = torch.randn(37, 9).t(), _strided(torch, [2, 3, 5, 4], [1, 0, 3, 2])
    g = dg.Graph(name="side_epilogues")
    x, s, b = g.tensor_like(x_values, name="x"), g.tensor(name="s", dim=[1, 37]), g.tensor(name="b", dim=[1, 37])
    y, mean, inv_variance = g.layernorm(x, s, b)
    y.set_output(True)
    g.cast(mean, dg.float16).set_output(True).set_data_type(dg.float16)
    g.mul(inv_variance, 2.0).set_output(True)
    dy, xb = g.tensor(name="dy", dim=[2, 3, 5, 4]), g.tensor_like(xb_values, name="xb")
    scale, m, iv = (g.tensor(name=n, dim=[1, 3, 1, 1]) for n in ("scale", "m", "iv"))
    dx, dscale, dbias = g.batchnorm_backward(dy, xb, scale, m, iv)
    dx.set_output(True)
    g.cast(dscale, dg.float16).set_output(True).set_data_type(dg.float16)
    g.cast(dbias, dg.float16).set_output(True).set_data_type(dg.float16)
    groups = partition(g)
    assert sorted((gr.kind, len(gr.nodes)) for gr in groups) == [("norm", 3), ("norm", 3)]
    inputs = {"x": x_values, "s": torch.randn(1, 37), "b": torch.randn(1, 37),
              "dy": torch.randn(2, 3, 5, 4), "xb": xb_values,
              "scale": torch.randn(1, 3, 1, 1), "m": torch.randn(1, 3, 1, 1), "iv": torch.rand(1, 3, 1, 1) + 0.5}
    check(g, inputs, dtype=torch.float16)


def test_matmul_result_reshaped_or_transposed_twice_into_an_output_is_written_in_place():
    """A reshape of a matmul's result into a graph output, and a transpose of a transpose (as a
    weight gradient comes out of AOTAutograd): the matmul writes the output's memory."""
    import torch
    from helpers import check

    g = dg.Graph(name="in_place")
    a, w = g.tensor(name="a", dim=[6, 11], stride=[1, 6]), g.tensor(name="w", dim=[11, 13])
    g.reshape(g.matmul(a, w), [2, 3, 13]).set_output(True)
    c = g.matmul(g.transpose(a, [1, 0]), g.tensor(name="d", dim=[6, 7]))
    g.transpose(g.transpose(c, [1, 0]), [1, 0]).set_output(True)
    groups = partition(g)
    assert [gr.kind for gr in groups] == ["matmul", "matmul"] and not groups.views.copies
    torch.manual_seed(2)
    check(g, {"a": torch.randn(11, 6).t(), "w": torch.randn(11, 13), "d": torch.randn(6, 7)})


def test_a_reshape_of_a_matmul_in_another_layout_is_still_copied():
    """The matmul writes its own layout: an output the reshape lays out otherwise gets a copy."""
    import torch
    from helpers import check

    g = dg.Graph(name="other_layout")
    a, w = g.tensor(name="a", dim=[6, 5]), g.tensor(name="w", dim=[5, 8])
    g.transpose(g.matmul(a, w), [1, 0]).set_output(True)
    groups = partition(g)
    assert [gr.kind for gr in groups] == ["matmul", "copy"]
    torch.manual_seed(3)
    check(g, {"a": torch.randn(6, 5), "w": torch.randn(5, 8)})


def test_every_anchor_op_says_what_it_absorbs_beside_its_op():
    """Fusion reads an anchor's rule from the op's catalog entry (no table in fusion/ to keep in
    step): every anchor that fuses has one, its positions name real inputs and outputs, and no
    pointwise or opaque op carries one. scatter_add absorbs nothing (its writes accumulate)."""
    from dnngraph.fusion.patterns import anchor_rule
    from dnngraph.ops.base import REGISTRY

    for name, op in REGISTRY.items():
        rule = anchor_rule(name)
        if op.role != "anchor":
            assert rule is None, name
            continue
        assert rule is not None or name == "scatter_add", name
        if rule is not None:
            assert all(0 <= i < len(op.input_names) for i in rule.prologue_inputs), name
            assert rule.epilogue_output is None or 0 <= rule.epilogue_output < len(op.output_names), name
