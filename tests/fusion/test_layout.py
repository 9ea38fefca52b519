"""Layout ops (reshape, transpose, slice, concatenate): views where strides can express them
(no kernel), copies otherwise, producers writing straight into a concatenate or a transposed
output; every case against the float64 reference with poisoned outputs. On the GPU (marked gpu):
bf16 at realistic sizes, views that start off 16-byte boundaries (the launches that do not assume
aligned pointers), attention in BSHD through transposes."""
import pytest
import torch

import dnngraph as dg
from helpers import check, compiled_for_sm90, run

GEN = torch.Generator().manual_seed(11)


def _graph(inputs: dict, io=dg.float32):
    g = dg.Graph(name="layout", io_data_type=io, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    return g, {name: g.tensor_like(value, name) for name, value in inputs.items()}


def _check(g, tensors, inputs, kernels, dtype=torch.float32):
    g.build()
    assert len(g.plan.launches) == kernels, g.plan.explain()
    return check(g, {tensors[n]: v for n, v in inputs.items()}, dtype)


def _randn(*dims, dtype=torch.float32):
    return torch.randn(*dims, generator=GEN).to(dtype)


def test_a_transpose_feeding_a_matmul_is_a_stride_change():
    inputs = {"x": _randn(3, 7, 5), "w": _randn(3, 7, 4)}
    g, t = _graph(inputs)
    g.matmul(g.transpose(t["x"], [0, 2, 1]), t["w"]).set_output(True)
    _check(g, t, inputs, 1)
    assert g.plan.workspace_bytes == 0


def test_bshd_attention_through_transposes_is_one_kernel():
    """q, k, v stored BSHD, transposed to BHSD for sdpa, o transposed back into a BSHD output:
    no copies, one flash kernel."""
    inputs = {n: _randn(2, 19, 3, 16) for n in ("q", "k", "v")}
    g, t = _graph(inputs)
    q, k, v = (g.transpose(t[n], [0, 2, 1, 3]) for n in ("q", "k", "v"))
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    g.transpose(o, [0, 2, 1, 3]).set_output(True)
    _check(g, t, inputs, 1)  # the flash kernel writes o straight into the BSHD output


def test_views_of_views_compose():
    inputs = {"x": _randn(4, 6, 10)}
    g, t = _graph(inputs)
    y = g.slice(g.transpose(t["x"], [2, 0, 1]), [slice(1, 9, 2), slice(None), slice(0, 6, 3)])
    y = g.transpose(y, [1, 0, 2])  # [4, 4, 2] strides (60, 2, 30) over x
    g.mul(g.reshape(y, [4, 4, 1, 2]), 2.0).set_output(True)
    _check(g, t, inputs, 1)
    g2, t2 = _graph(inputs)
    y = g2.slice(g2.transpose(t2["x"], [2, 0, 1]), [slice(1, 9, 2), slice(None), slice(0, 6, 3)])
    g2.mul(g2.reshape(g2.transpose(y, [1, 0, 2]), [4, 8]), 2.0).set_output(True)
    _check(g2, t2, inputs, 2)  # (4, 2) at strides (2, 30) do not merge: a copy, then the mul


@pytest.mark.parametrize("op", ["transpose", "reshape", "slice"])
def test_a_layout_op_as_a_graph_output_is_one_copy(op):
    inputs = {"x": _randn(4, 6, 5)}
    g, t = _graph(inputs)
    call = {"transpose": lambda x: g.transpose(x, [2, 0, 1]), "reshape": lambda x: g.reshape(x, [24, 5]),
            "slice": lambda x: g.slice(x, [slice(1, 4), slice(0, 6, 4), slice(2, 5)])}[op]
    call(t["x"]).set_output(True)
    _check(g, t, inputs, 1)


def test_a_pointwise_producer_writes_straight_into_a_transposed_output():
    inputs = {"x": _randn(4, 6, 5)}
    g, t = _graph(inputs)
    g.transpose(g.relu(t["x"]), [2, 0, 1]).set_output(True)
    _check(g, t, inputs, 1)
    assert g.plan.workspace_bytes == 0


@pytest.mark.parametrize("reader", ["epilogue", "pointwise"])
def test_a_value_reshaped_into_an_output_and_read_by_others_is_written_there_once(reader):
    """A matmul's result saved through a reshape (an output) and also read by its epilogue, or
    by a later pointwise kernel, is written once into the output's memory, where the others
    read it: no copy kernel, no workspace."""
    inputs = {"x": _randn(3, 5, 7), "w": _randn(7, 9), "r": _randn(3, 5, 9)}
    g, t = _graph(inputs)
    c = g.matmul(t["x"], t["w"])
    g.reshape(c, [15, 9]).set_output(True).set_name("saved")
    if reader == "epilogue":
        g.add(c, t["r"]).set_output(True).set_name("y")
        kernels = 1
    else:
        g.exp(g.softmax(c, axis=2)).set_output(True).set_name("y")  # a row kernel, then exp joins it
        kernels = 2
    _check(g, t, inputs, kernels)
    assert all(group.kind != "copy" for group in g.plan.groups) and g.plan.workspace_bytes == 0


def test_attention_writes_its_outputs_straight_into_the_layout_a_reshape_needs():
    """o and dq [B, H, S, D] transposed to [B, S, H, D] and merged to [B, S, H*D] (what a model's
    transpose(1, 2).reshape does before its output projection): the attention kernels store
    them in that layout through their strides; no copy kernel."""
    inputs = {"q": _randn(2, 3, 9, 8), "k": _randn(2, 3, 11, 8), "v": _randn(2, 3, 11, 8),
              "dO": _randn(2, 3, 9, 8), "w": _randn(24, 5)}
    g, t = _graph(inputs)
    o, stats = g.sdpa(t["q"], t["k"], t["v"], is_inference=False, use_causal_mask=True)
    merged = g.reshape(g.transpose(o, [0, 2, 1, 3]), [2, 9, 24])
    g.matmul(merged, t["w"]).set_output(True).set_name("projected")
    dq, dk, dv = g.sdpa_backward(t["q"], t["k"], t["v"], o, t["dO"], stats, use_causal_mask=True)
    g.reshape(g.transpose(dq, [0, 2, 1, 3]), [2, 9, 24]).set_output(True).set_name("dq_merged")
    dk.set_output(True)
    dv.set_output(True)
    g.build()
    assert all(group.kind != "copy" for group in g.plan.groups), g.plan.explain()
    check(g, {t[n]: v for n, v in inputs.items()})


def test_concatenate_parts_are_written_in_place_or_copied():
    """Pointwise parts write into the output; an input part (and one read twice) is copied."""
    inputs = {"x": _randn(3, 4, 5), "z": _randn(3, 2, 5)}
    g, t = _graph(inputs)
    parts = [g.relu(t["x"]), t["z"], g.exp(t["x"]), t["z"]]
    g.concatenate(parts, axis=1).set_output(True)
    _check(g, t, inputs, 3)  # relu and exp (siblings over x: one kernel), two copies of z


def test_a_virtual_concatenate_feeds_a_consumer():
    inputs = {"x": _randn(3, 4, 5)}
    g, t = _graph(inputs)
    both = g.concatenate([g.relu(t["x"]), g.neg(t["x"])], axis=2)
    g.reduction(both, "sum", [2]).set_output(True)
    _check(g, t, inputs, 2)  # relu and neg (siblings over x: one kernel), the reduction


def test_a_reshape_that_neither_side_can_view_goes_through_a_dense_buffer():
    x = torch.randn(5, 6, 4, generator=GEN).permute(2, 1, 0)  # [4, 6, 5], no view merges 6 x 5
    inputs = {"x": x}
    g, t = _graph(inputs)
    y = g.reshape(t["x"], [4, 30]).set_output(True)
    y.set_stride([1, 4])  # output column-major: x viewed as [4, 6, 5] over it exists
    _check(g, t, inputs, 1)
    g2, t2 = _graph(inputs)
    y2 = g2.reshape(t2["x"], [6, 20]).set_output(True)
    y2.set_stride([1, 6])  # no view of y2 with x's dims either: x -> dense -> y2
    _check(g2, t2, inputs, 2)


def test_size_one_axes_broadcast_inputs_and_a_type_change():
    """An expanded input (stride 0), size-1 axes, fp16 in and an fp32 output: the copy casts."""
    x = torch.randn(1, 5, 1, generator=GEN).half().expand(3, 5, 1)
    inputs = {"x": x}
    g, t = _graph(inputs, io=dg.float16)
    y = g.reshape(g.transpose(t["x"], [2, 1, 0]), [5, 3]).set_output(True)
    y.set_data_type(dg.float32)
    g.build()
    out = check(g, {t["x"]: x}, torch.float16)
    assert out[y.name].dtype == torch.float32


def test_integers_bools_and_nan_pass_through_unchanged():
    x = torch.tensor([[1.0, float("nan")], [float("-inf"), 2.0], [0.0, -0.0]])
    n = torch.arange(6, dtype=torch.int32).view(3, 2)
    inputs = {"x": x, "n": n}
    g, t = _graph(inputs)
    g.transpose(t["x"], [1, 0]).set_output(True)
    g.transpose(t["n"], [1, 0]).set_output(True)
    g.transpose(g.cmp_gt(t["x"], 0.5), [1, 0]).set_output(True)
    _check(g, t, inputs, 3)


def test_names_that_look_like_kernel_variables():
    inputs = {"acc": _randn(3, 4), "x_ptr": _randn(3, 4)}
    g, t = _graph(inputs)
    g.concatenate([g.transpose(t["acc"], [1, 0]), g.transpose(t["x_ptr"], [1, 0])], axis=0) \
        .set_output(True).set_name("pid")
    _check(g, t, inputs, 2)


def test_a_rebuild_restores_strides_a_view_took():
    """A view takes over a virtual tensor's strides for one build; marking it an output gives
    it its own memory and layout back."""
    inputs = {"x": _randn(4, 6)}
    g, t = _graph(inputs)
    y = g.transpose(t["x"], [1, 0])
    z = g.mul(y, 3.0).set_output(True)
    g.build()
    assert y.stride == (1, 6)
    y.set_output(True)
    assert y.stride == (4, 1)
    g.build()
    out = check(g, {t["x"]: inputs["x"]})
    assert torch.equal(out[y.name], inputs["x"].t().contiguous())
    assert out[z.name].shape == (6, 4)


def test_layout_ops_run_and_match_after_json_round_trip():
    inputs = {"x": _randn(2, 3, 4)}
    g, t = _graph(inputs)
    g.concatenate([g.slice(t["x"], [slice(None), slice(0, 2), slice(None)]), t["x"]], axis=1).set_output(True)
    again = dg.Graph.from_json(g.to_json())
    again.build()
    out = run(again, {again.tensor_by_name("x"): inputs["x"]})
    (value,) = out.values()
    assert torch.equal(value, torch.cat([inputs["x"][:, :2], inputs["x"]], 1))


def test_json_after_a_build_carries_own_strides_not_view_strides():
    """A build lends virtual tensors view strides; the JSON (and so a round trip) keeps each
    tensor's own layout: relu.y written straight into a transposed output stays row-major."""
    inputs = {"x": _randn(4, 6)}
    g, t = _graph(inputs)
    relu = g.relu(t["x"])
    g.transpose(relu, [1, 0]).set_output(True)
    before = g.to_json()
    g.build()
    assert relu.stride == (1, 4)  # the view this build made of it
    assert g.to_json() == before
    again = dg.Graph.from_json(g.to_json())
    assert again.tensor_by_name(relu.name).set_output(True).stride == (6, 1)
    again.build()
    check(again, {again.tensor_by_name("x"): inputs["x"]})


def test_a_concatenate_of_parts_of_different_types_keeps_every_value():
    """Views keep their values' type, a concatenate too when its parts agree on one; parts of
    several types (a bool mask beside floats, fp16 beside float32) meet in the intermediate type
    instead of the first part's (which turned the floats into True)."""
    x = _randn(3, 4) * 3
    g, t = _graph({"x": x}, io=dg.float16)
    half = g.cast(t["x"], dg.float16)
    mixed = g.concatenate([g.cmp_gt(t["x"], 0.0), t["x"]], 0)
    floats = g.concatenate([half, g.exp(t["x"])], 1)
    same = g.concatenate([g.cmp_gt(t["x"], 0.0), g.cmp_lt(t["x"], 0.0)], 0)
    assert (mixed.data_type, floats.data_type, same.data_type) == (dg.float32, dg.float32, dg.bool)
    a = g.mul(mixed, 1.0).set_output(True).set_data_type(dg.float32)
    g.mul(floats, 1.0).set_output(True)
    g.logical_not(same).set_output(True)
    g.build()
    out = check(g, {t["x"]: x}, torch.float16)
    assert torch.equal(out[a.name][3:], x)


def test_an_op_added_after_a_build_infers_its_layout_from_own_strides():
    """An output's layout follows its input's own strides, not the view strides the last build
    lent it: the same graph gives the same layouts whether or not it was built in between."""
    inputs = {"x": _randn(4, 6)}
    strides = []
    for build_between in (False, True):
        g, t = _graph(inputs)
        seen = g.transpose(g.relu(t["x"]), [1, 0])  # relu writes into the transposed output
        g.mul(seen, 2.0).set_output(True)
        if build_between:
            g.build()
        strides.append(g.exp(seen).set_output(True).stride)
        g.build()
        check(g, {t["x"]: inputs["x"]})
    assert strides == [(4, 1), (4, 1)]


def test_explain_to_dot_and_a_failed_build_leave_strides_alone(monkeypatch):
    from dnngraph.backends.triton.backend import TRITON

    inputs = {"x": _randn(4, 6)}
    g, t = _graph(inputs)
    y = g.transpose(g.relu(t["x"]), [1, 0])
    g.exp(y).set_output(True)
    before = {tensor.name: tensor.stride for tensor in g.tensors}
    g.explain()
    g.to_dot()
    assert {tensor.name: tensor.stride for tensor in g.tensors} == before
    monkeypatch.delitem(TRITON.builders, "pointwise")  # the build fails after the partition
    with pytest.raises(dg.UnsupportedError):
        g.build()
    assert {tensor.name: tensor.stride for tensor in g.tensors} == before


def test_fusions_through_views_compile_for_sm90_with_h100_configs():
    """The epilogues and strided stores the view rules allow (residual + variance exit, SwiGLU's
    product, folded batches, attention writing BSHD and its gradients), built with the configs an
    H100 gets and compiled by the GPU compiler (tests/sm90_fusion_graphs.py)."""
    assert "compiled 11 kernels for sm_90" in compiled_for_sm90("sm90_fusion_graphs:llama_fusions")


@pytest.mark.parametrize("chain", ["transpose_reshape", "reshape_reshape"])
def test_a_value_another_view_reads_is_not_written_through_views_into_an_output(chain):
    """p is read by a transpose (an alias of p's memory, decided first) and, through a chain of
    views, saved into an output: p may not move into the output's memory, or the transpose is
    left stated over memory that no longer exists (KeyError at execute)."""
    inputs = {"x": _randn(3, 5, 7)}
    g, t = _graph(inputs)
    p = g.exp(t["x"])
    g.relu(g.transpose(p, [0, 2, 1])).set_output(True).set_name("y")
    if chain == "transpose_reshape":
        g.reshape(g.transpose(p, [1, 0, 2]), [5, 21]).set_output(True).set_name("saved")
    else:
        g.reshape(g.reshape(p, [15, 7]), [105]).set_output(True).set_name("saved")
    g.build()
    check(g, {t["x"]: inputs["x"]})


# --- on the GPU: bf16 at realistic sizes, views off 16-byte boundaries ---------------------------
CUDA = "cuda"


@pytest.mark.gpu
def test_transpose_copy_and_concat_bf16():
    gen = torch.Generator(device=CUDA).manual_seed(1)
    inputs = {"x": torch.randn(1031, 2049, generator=gen, device=CUDA).bfloat16()}
    g, t = _graph(inputs, io=dg.bfloat16)
    g.transpose(t["x"], [1, 0]).set_output(True)
    g.concatenate([g.relu(t["x"]), t["x"]], axis=0).set_output(True)
    g.build()
    check(g, {t["x"]: inputs["x"]}, torch.bfloat16, device=CUDA)


@pytest.mark.gpu
def test_a_slice_one_element_in_reads_through_an_unaligned_view():
    """x[:, 1:] of fp16 starts 2 bytes into x: its reader runs without aligned-pointer hints."""
    gen = torch.Generator(device=CUDA).manual_seed(2)
    inputs = {"x": torch.randn(64, 257, generator=gen, device=CUDA).half()}
    g, t = _graph(inputs, io=dg.float16)
    y = g.exp(g.slice(g.mul(t["x"], 0.5), [slice(None), slice(1, 257)]))
    y.set_output(True)
    g.build()
    assert not g.plan.views_aligned
    check(g, {t["x"]: inputs["x"]}, torch.float16, device=CUDA)


@pytest.mark.gpu
def test_bshd_attention_through_transposes():
    gen = torch.Generator(device=CUDA).manual_seed(3)
    inputs = {n: torch.randn(2, 300, 8, 64, generator=gen, device=CUDA).bfloat16() for n in ("q", "k", "v")}
    g, t = _graph(inputs, io=dg.bfloat16)  # (the GPU file's io type, lost when it was folded here)
    q, k, v = (g.transpose(t[n], [0, 2, 1, 3]) for n in ("q", "k", "v"))
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    g.transpose(o, [0, 2, 1, 3]).set_output(True)
    g.build()
    # o is a float32 intermediate: the flash kernel writes it, a copy casts it into the bf16
    # BSHD output (a float32 output is written straight by the flash kernel: the CPU test above)
    assert len(g.plan.launches) == 2, g.explain()
    check(g, {t[n]: inputs[n] for n in inputs}, torch.bfloat16, device=CUDA, tolerance=2e-2)
