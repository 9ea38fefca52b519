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


def test_attention_chain_without_its_kernel_splits_into_runnable_groups():
    import torch
    from helpers import check

    from dnngraph.plan import KERNEL_BUILDERS

    g = dg.Graph()
    q, kt, v = (g.tensor(name=n, dim=d) for n, d in
                (("q", [2, 3, 17, 8]), ("kt", [2, 3, 8, 19]), ("v", [2, 3, 19, 5])))
    g.matmul(g.softmax(g.mul(g.matmul(q, kt), 0.3)), v).set_output(True)
    groups = [(gr.kind, [n.op for n in gr.nodes]) for gr in partition(g, frozenset(KERNEL_BUILDERS))]
    if "attention" in KERNEL_BUILDERS:  # with an op-level attention kernel the chain is one group
        assert groups == [("attention", ["matmul", "mul", "softmax", "matmul"])]
    else:
        assert groups == [("matmul", ["matmul", "mul"]), ("softmax", ["softmax"]), ("matmul", ["matmul"])]
    torch.manual_seed(0)
    check(g, {"q": torch.randn(2, 3, 17, 8), "kt": torch.randn(2, 3, 8, 19), "v": torch.randn(2, 3, 19, 5)})
