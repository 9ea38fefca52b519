"""API contract, validation at the op call, binding checks at execute, explain."""
import os

import pytest
import torch

import dnngraph as dg
from helpers import check, poisoned, run


def small_graph():
    g = dg.Graph(name="small")
    x = g.tensor(name="x", dim=[5, 6])
    b = g.tensor(name="b", dim=[1, 6])
    y = g.relu(g.add(x, b)).set_output(True).set_name("y")
    return g, x, b, y


def test_bindings_by_handle_or_name_and_in_place_outputs():
    g, x, b, y = small_graph()
    g.build()
    x_t, b_t = torch.randn(5, 6), torch.randn(1, 6)
    out = poisoned(y)
    g.execute({"x": x_t, b: b_t, "y": out})
    assert torch.allclose(out, torch.relu(x_t + b_t))


def test_setters_chain_and_types():
    g = dg.Graph(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 3])
    assert x.data_type is dg.bfloat16
    v = g.exp(x)
    assert v.is_virtual and v.data_type is dg.float32
    assert v.set_output(True).set_name("e").set_data_type(dg.float16) is v
    assert v.data_type is dg.float16 and v.name == "e" and not v.is_virtual
    assert g.cmp_lt(x, 0.0).data_type is dg.bool


def test_output_layout_follows_first_full_input():
    g = dg.Graph()
    x = g.tensor_like(torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last))
    b = g.tensor(name="b", dim=[1, 8, 1, 1])
    y = g.add(b, x)
    assert y.stride == (200, 1, 40, 8)
    t = g.tensor_like(torch.randn(7, 3).t(), name="t")
    assert g.neg(t).stride == (1, 3)
    assert g.matmul(g.tensor(name="a", dim=[4, 3]), t).stride == (7, 1)  # matmul: row-major


@pytest.mark.parametrize("make_error", [
    lambda g, x: g.add(x, g.tensor(name="z", dim=[4, 6])),  # broadcast mismatch
    lambda g, x: g.reduction(x, "sum", [2]),  # bad axis
    lambda g, x: g.reduction(x, "median", [0]),  # bad mode
    lambda g, x: g.softmax(x, axis=5),
    lambda g, x: g.conv_fprop(g.tensor(name="i", dim=[1, 4, 8, 8]), g.tensor(name="w", dim=[6, 2, 3, 3]),
                              padding=[-1, 0]),  # negative padding
    lambda g, x: g.conv_fprop(g.tensor(name="i", dim=[1, 4, 8, 8]), g.tensor(name="w", dim=[6, 2, 3, 3]),
                              stride=[0, 1], groups=2),  # zero stride
    lambda g, x: g.conv_fprop(g.tensor(name="i", dim=[1, 4, 8, 8]), g.tensor(name="w", dim=[6, 4, 3, 3]),
                              groups=3),  # groups not dividing channels
    lambda g, x: g.layernorm(x, g.tensor(name="s", dim=[1, 6]), None, epsilon=0.0),
    lambda g, x: g.rmsnorm(x, g.tensor(name="s", dim=[1, 5])),  # scale does not match
    lambda g, x: g.dropout(x, p=1.0, seed=1),
    lambda g, x: g.pooling(g.tensor(name="i", dim=[1, 2, 3, 3]), "max", [5, 5], padding=[0, 0]),
    lambda g, x: g.layernorm_backward(x, x, g.tensor(name="s", dim=[1, 6]), g.tensor(name="m", dim=[5, 2]),
                                      g.tensor(name="v", dim=[5, 1])),  # wrong statistics shape
    lambda g, x: g.matmul(x, x),
    lambda g, x: g.add(x, dg.Graph(name="other").tensor(name="o", dim=[5, 6])),  # foreign tensor
    lambda g, x: g.tensor(name="x", dim=[1]),  # duplicate name
    lambda g, x: x.set_output(True),  # an input cannot be an output
    lambda g, x: g.tensor(name="q", dim=[0, 3]),
    lambda g, x: g.sdpa(g.tensor(name="q", dim=[1, 3, 4, 8]), g.tensor(name="k", dim=[1, 2, 4, 8]),
                        g.tensor(name="v", dim=[1, 2, 4, 8])),  # heads not a multiple
])
def test_validation_errors_leave_the_graph_unchanged(make_error):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 6])
    tensors_before, nodes_before = len(g.tensors), len(g.nodes)
    with pytest.raises(dg.ValidationError) as info:
        make_error(g, x)
    assert str(info.value)
    assert len(g.nodes) == nodes_before
    # op calls that failed added no tensors beyond the ones the lambda declared itself
    assert all(t.producer is None for t in g.tensors[tensors_before:])


def test_error_names_the_op_and_tensors():
    g = dg.Graph()
    a, b = g.tensor(name="lhs", dim=[4, 5]), g.tensor(name="rhs", dim=[6, 7])
    with pytest.raises(dg.ValidationError, match=r"matmul.*lhs.*rhs"):
        g.matmul(a, b, name="proj")


def test_build_time_validation():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3])
    with pytest.raises(dg.ValidationError, match="no ops"):
        g.build()
    g.exp(x)
    with pytest.raises(dg.ValidationError, match="no outputs"):
        g.build()
    y = g.exp(x).set_output(True)
    with pytest.raises(dg.ValidationError, match="never used"):
        g.build()


def test_unsupported_family_names_the_node(monkeypatch):
    """A family no backend supports (every family has a Triton kernel today: one is taken away)
    raises UnsupportedError naming the node."""
    from dnngraph.backends.triton.backend import TRITON

    monkeypatch.delitem(TRITON.builders, "pooling")
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 4, 8, 8])
    g.pooling(x, "max", [2, 2], [2, 2], [0, 0], name="stem").set_output(True)
    with pytest.raises(dg.UnsupportedError, match="stem.*pooling"):
        g.build()


@pytest.mark.parametrize("case", ["missing", "shape", "dtype", "stride", "alias", "unknown", "virtual", "type"])
def test_bad_bindings_raise_and_write_nothing(case):
    g, x, b, y = small_graph()
    g.build()
    x_t, b_t, out = torch.randn(5, 6), torch.randn(1, 6), poisoned(y)
    bindings = {x: x_t, b: b_t, y: out}
    if case == "missing":
        del bindings[b]
    elif case == "shape":
        bindings[x] = torch.randn(5, 7)
    elif case == "dtype":
        bindings[x] = torch.randn(5, 6, dtype=torch.float64)
    elif case == "stride":
        bindings[x] = torch.randn(6, 5).t()
    elif case == "alias":  # y over x shifted by one element (the very same view runs in place)
        memory = torch.randn(31)
        bindings[x], bindings[y] = memory[:30].view(5, 6), memory[1:].view(5, 6)
        out = memory[1:].view(5, 6).fill_(float("nan"))
    elif case == "unknown":
        bindings["nope"] = x_t
    elif case == "virtual":
        bindings[g.nodes[0].outputs[0]] = torch.randn(5, 6)
    elif case == "type":
        bindings[x] = x_t.numpy()
    with pytest.raises(dg.ExecutionError):
        g.execute(bindings)
    assert torch.isnan(out).all(), "nothing may be written on error"


def test_execute_requires_build_and_rebuild_after_change():
    g, x, b, y = small_graph()
    with pytest.raises(dg.ExecutionError, match="build"):
        g.execute({})
    g.build()
    g.neg(y).set_output(True)
    assert g.plan is None  # changed: build again


def test_explain_shows_groups_configs_and_sources():
    g, x, b, y = small_graph()
    g.build()
    text = g.explain()
    assert "1 kernel" in text and "BLOCK_C=" in text and "why:" in text
    path = g.plan.launches[0].source_path
    assert os.path.exists(path) and "@triton.jit" in open(path).read()


def test_workspace_carries_values_between_kernels():
    g = dg.Graph()
    col, row = g.tensor(name="col", dim=[6, 1]), g.tensor(name="row", dim=[1, 5])
    shared = g.exp(g.add(col, row))  # [6, 5], read by two kernels of incompatible domains
    first = g.mul(g.tensor(name="p", dim=[3, 6, 5]), shared).set_output(True)
    second = g.mul(g.tensor(name="q", dim=[4, 6, 5]), shared).set_output(True)
    g.build()
    assert len(g.plan.launches) == 2 and g.plan.workspace_bytes > 0
    inputs = {"col": torch.randn(6, 1), "row": torch.randn(1, 5), "p": torch.randn(3, 6, 5),
              "q": torch.randn(4, 6, 5)}
    check(g, inputs)
