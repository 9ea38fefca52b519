"""Bit-packed booleans (dg.bool_bit_packed, cuDNN's CUDNN_DATA_BOOLEAN layout): one bit per
element, 8 per uint8 byte along the innermost axis, least significant bit first, rows starting on
a byte. Comparisons, logical ops and where read and write them in the pointwise kernel; results
are unpacked and compared with the float64 reference (which works on bools). Outputs' storage is
poisoned with random bytes first: bits past a row's extent (a partial last byte, a wider row
stride) must keep their prior value."""
import json

import pytest
import torch

import dnngraph as dg
from dnngraph import dtypes

CMPS = ["cmp_eq", "cmp_ne", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge"]


def _graph():
    return dg.Graph(io_data_type=dg.float32, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _storage(tensor, device="cpu", fill=None) -> torch.Tensor:
    """Uint8 storage of a bit-packed graph tensor in its declared layout: random bytes (poison
    for an output), or `fill` (a bool tensor of its logical dims) packed into it."""
    storage = _laid_out(tensor, lambda span: torch.randint(0, 256, (span,), dtype=torch.uint8))
    if fill is not None:
        _write_bits(storage, tensor, fill)  # the bytes' other bits stay random
    return storage.to(device)


def _laid_out(tensor, make) -> torch.Tensor:
    """`make(span)` (a flat uint8 tensor) viewed in the tensor's storage layout."""
    shape, strides = dtypes.storage_layout(tensor.dim, tensor.stride, tensor.data_type)
    span = sum((size - 1) * step for size, step in zip(shape, strides)) + 1
    return make(span).as_strided(shape, strides)


def _write_bits(storage, tensor, values):
    """Write logical bools `values` into `storage` (the test's own packer: element offsets from
    the strides, bit offset % 8 of byte offset // 8; the other bits of each byte kept)."""
    flat = torch.as_strided(storage, (storage.untyped_storage().nbytes() - storage.storage_offset(),), (1,))
    offsets = torch.zeros(tensor.dim, dtype=torch.int64)
    for axis, (size, step) in enumerate(zip(tensor.dim, tensor.stride)):
        shape = [1] * len(tensor.dim)
        shape[axis] = size
        offsets = offsets + (torch.arange(size) * step).reshape(shape)
    offsets = offsets.flatten()
    byte, weight = offsets // 8, (1 << (offsets % 8))
    # distinct elements hold distinct bits of a byte: sums of their weights are ORs
    owned = torch.zeros(flat.numel(), dtype=torch.int64).index_add_(0, byte, weight)
    on = torch.zeros(flat.numel(), dtype=torch.int64).index_add_(0, byte, weight * values.flatten().cpu().long())
    flat.copy_(((flat.long() & ~owned) | on).to(torch.uint8))


def _bits_outside(storage, tensor) -> torch.Tensor:
    """A copy of the storage's bits that belong to no element of `tensor` (padding), as a mask
    of the bytes: bytes & ~(bits the tensor owns)."""
    owned = _laid_out(tensor, lambda span: torch.zeros(span, dtype=torch.uint8))  # (zeros_like may densify)
    _write_bits(owned, tensor, torch.ones(tensor.dim, dtype=torch.bool))
    return storage & ~owned


def _execute_and_check(graph, inputs: dict, device="cpu"):
    """Execute over poisoned outputs and compare every output with the reference; bit-packed
    outputs unpacked, their padding bits unchanged."""
    graph.build()
    outputs, priors = {}, {}
    for tensor in graph.outputs():
        if tensor.data_type.is_bit_packed:
            outputs[tensor.name] = _storage(tensor, device)
            priors[tensor.name] = _bits_outside(outputs[tensor.name].cpu(), tensor)
        else:
            outputs[tensor.name] = torch.empty_strided(tensor.dim, tensor.stride, dtype=tensor.data_type.torch_dtype,
                                                       device=device).fill_(float("nan"))
    graph.execute({**{k: v.to(device) for k, v in inputs.items()}, **outputs})
    refs = graph.reference({k: v.cpu() for k, v in inputs.items()})
    for tensor in graph.outputs():
        out, ref = outputs[tensor.name].cpu(), refs[tensor.name]
        if tensor.data_type.is_bit_packed:
            assert ref.dtype == torch.bool and tuple(ref.shape) == tuple(tensor.dim)
            assert torch.equal(dg.unpack_bits(out, tensor.dim, tensor.stride), ref), tensor.name
            assert torch.equal(_bits_outside(out, tensor), priors[tensor.name]), f"{tensor.name}: padding bits changed"
        elif ref.dtype == torch.bool:
            assert torch.equal(out.bool(), ref), tensor.name
        else:  # floats: NaN where the reference is NaN, else the relative norm error of fp32 math
            out = out.double()
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{tensor.name}: NaN (unwritten?)"
            finite = torch.isfinite(ref)
            assert torch.equal(out[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]), tensor.name
            error = (out[finite] - ref[finite]).norm() / (ref[finite].norm() or 1.0)
            assert error < 2e-5, f"{tensor.name}: relative error {error:.3g}"
    return outputs


def _mask(dims, p=0.5):
    return torch.rand(dims) < p


# --- the storage format ----------------------------------------------------------------------------

def test_bit_order_is_cudnns():
    # cuDNN's example: a byte 01001111 holds 1 for elements 0-3 and 6, 0 for 4, 5 and 7
    values = torch.tensor([1, 1, 1, 1, 0, 0, 1, 0], dtype=torch.bool)
    assert dg.pack_bits(values).tolist() == [0b01001111]
    assert torch.equal(dg.unpack_bits(torch.tensor([0b01001111], dtype=torch.uint8), [8], [1]), values)


@pytest.mark.parametrize("dims", [[1], [7], [8], [9], [3, 13], [2, 3, 17], [4, 1]])
def test_pack_unpack_round_trip(dims):
    values = _mask(dims)
    packed = dg.pack_bits(values)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-dims[-1] // 8)
    strides = dg.bit_packed_strides(dims, torch.empty(dims).stride())
    assert torch.equal(dg.unpack_bits(packed, dims, strides), values)


def test_declared_layouts():
    g = _graph()
    m = g.tensor(name="m", dim=[3, 13], data_type=dg.bool_bit_packed)
    assert m.stride == (16, 1)  # rows start on a byte
    assert dtypes.storage_layout(m.dim, m.stride, m.data_type) == ((3, 2), (2, 1))
    col = g.tensor(name="col", dim=[13, 3], stride=[1, 16], data_type=dg.bool_bit_packed)
    assert dtypes.storage_layout(col.dim, col.stride, col.data_type) == ((2, 3), (1, 2))
    one = g.tensor(name="one", dim=[5, 1], data_type=dg.bool_bit_packed)
    assert dtypes.storage_layout(one.dim, one.stride, one.data_type)[0] == (1, 1)
    with pytest.raises(dg.ValidationError, match="multiples of 8"):
        g.tensor(name="dense", dim=[3, 13], stride=[13, 1], data_type=dg.bool_bit_packed)
    with pytest.raises(dg.ValidationError, match="stride 1"):
        g.tensor(name="gapped", dim=[3, 13], stride=[32, 2], data_type=dg.bool_bit_packed)
    # uint8 alone says nothing of bits: tensor_like of one is a uint8 tensor, never packed booleans
    assert g.tensor_like(torch.zeros(3, 2, dtype=torch.uint8), name="bytes").data_type is dg.uint8
    assert "dense" not in [t.name for t in g.tensors]


def test_output_made_bit_packed_takes_byte_rows():
    g = _graph()
    a = g.tensor(name="a", dim=[3, 13])
    y = g.cmp_gt(a, a).set_output(True).set_data_type(dg.bool_bit_packed)
    assert y.stride == (16, 1)
    t = g.tensor(name="t", dim=[13, 3], stride=[1, 13])
    z = g.cmp_lt(t, t).set_output(True).set_data_type(dg.bool_bit_packed)
    assert z.stride == (1, 16)  # the input's order, each column a byte row


# --- kernels --------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", CMPS)
@pytest.mark.parametrize("dims", [[5, 13], [3, 8], [2, 1], [1, 17]])
def test_compare_to_bits(op, dims):
    g = _graph()
    a, b = g.tensor(name="a", dim=dims), g.tensor(name="b", dim=dims)
    getattr(g, op)(a, b).set_output(True).set_data_type(dg.bool_bit_packed)
    at = torch.randn(dims)
    bt = torch.where(torch.rand(dims) < 0.3, at, torch.randn(dims))  # equal pairs too
    _execute_and_check(g, {"a": at, "b": bt})


@pytest.mark.parametrize("op", CMPS)
def test_nan_and_inf_compare_as_ieee(op):
    # NaN compares unequal to everything (cmp_ne true), infinities compare as numbers
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
    at, bt = torch.cartesian_prod(specials, specials).T.contiguous().reshape(2, 4, 9)
    g = _graph()
    a, b = g.tensor(name="a", dim=[4, 9]), g.tensor(name="b", dim=[4, 9])
    getattr(g, op)(a, b).set_output(True).set_data_type(dg.bool_bit_packed)
    out = _execute_and_check(g, {"a": at, "b": bt})
    expected = getattr(torch, op[4:])(at, bt)
    assert torch.equal(dg.unpack_bits(out[g.outputs()[0].name], [4, 9], [16, 1]), expected)


def test_bits_in_and_out_in_one_kernel():
    g = _graph()
    dims = [6, 21]
    a, b = g.tensor(name="a", dim=dims), g.tensor(name="b", dim=[1, 21])
    # names that look like the kernel's own variables: they never reach its code
    m = g.tensor(name="mask", dim=dims, data_type=dg.bool_bit_packed)
    n = g.tensor(name="y1_ptr", dim=dims, data_type=dg.bool_bit_packed)
    keep = g.logical_or(g.logical_and(g.cmp_le(a, b), m), g.logical_not(n))
    keep.set_output(True).set_data_type(dg.bool_bit_packed).set_name("cols_idx")
    chosen = g.where(m, a, g.neg(a))
    chosen.set_output(True)
    inputs = {"a": torch.randn(dims), "b": torch.randn(1, 21)}
    inputs["mask"] = _storage(m, fill=_mask(dims))
    inputs["y1_ptr"] = _storage(n, fill=_mask(dims, 0.3))
    _execute_and_check(g, inputs)
    assert len(g.plan.launches) == 1
    assert "store_bit_runs" in g.plan.launches[0].source_path.read_text()


def test_broadcast_bits_and_broadcast_inputs():
    g = _graph()
    dims = [4, 3, 11]
    x = g.tensor(name="x", dim=dims)
    row = g.tensor(name="row", dim=[1, 1, 11], data_type=dg.bool_bit_packed)  # one mask for every row
    scalar = g.tensor(name="s", dim=[1, 1, 1], data_type=dg.bool_bit_packed)
    wide = g.tensor(name="w", dim=dims, stride=[0, 0, 1])  # an expanded input
    y = g.where(g.logical_and(row, scalar), x, wide)
    y.set_output(True)
    z = g.logical_or(row, g.cmp_gt(x, wide))
    z.set_output(True).set_data_type(dg.bool_bit_packed)
    inputs = {"x": torch.randn(dims), "w": torch.randn(11).expand(dims)}
    inputs["row"] = _storage(row, fill=_mask([1, 1, 11]))
    inputs["s"] = _storage(scalar, fill=torch.ones(1, 1, 1, dtype=torch.bool))
    _execute_and_check(g, inputs)


def test_strided_and_transposed_layouts():
    g = _graph()
    # a bit-packed input read out of a wider buffer (row stride 40 bits), a column-major packed
    # output, a transposed float input
    m = g.tensor(name="m", dim=[5, 13], stride=[40, 1], data_type=dg.bool_bit_packed)
    a = g.tensor(name="a", dim=[5, 13], stride=[1, 5])
    y = g.logical_and(g.cmp_gt(a, a), m)  # a > a is false: the and is all false; below, an or
    y = g.logical_or(y, g.cmp_lt(a, g.tensor(name="b", dim=[5, 13])))
    y.set_output(True).set_data_type(dg.bool_bit_packed).set_stride([1, 8])
    inputs = {"a": torch.randn(13, 5).T, "b": torch.randn(5, 13), "m": _storage(m, fill=_mask([5, 13]))}
    _execute_and_check(g, inputs)


def test_output_rows_wider_than_their_bits():
    # rows of 13 bits 24 bits apart: the bytes between rows and the last byte's high bits keep
    # what they held
    g = _graph()
    a = g.tensor(name="a", dim=[5, 13])
    g.cmp_ge(a, 0.0).set_output(True).set_data_type(dg.bool_bit_packed).set_stride([24, 1])
    _execute_and_check(g, {"a": torch.randn(5, 13)})


@pytest.mark.parametrize("dims,stride", [([5, 1], [8, 1]), ([2, 5, 1], [96, 16, 1]), ([3, 1], [24, 1])])
def test_output_packed_along_an_axis_of_one(dims, stride):
    # the stride-1 axis has extent 1: each element is alone in its byte (bit 0), the bytes'
    # other bits keep what they held
    g = _graph()
    a = g.tensor(name="a", dim=dims)
    g.cmp_gt(a, 0.0).set_output(True).set_data_type(dg.bool_bit_packed).set_stride(stride)
    _execute_and_check(g, {"a": torch.randn(dims)})


def test_narrower_bit_packed_outputs_beside_a_wider_kernel():
    # masks of a per-row, a per-column and a single value, stored and used over the whole
    # domain: each stored by a kernel walking its own packed axis, the wide one walking x's rows
    g = _graph()
    rows, cols = g.tensor(name="r", dim=[9, 1]), g.tensor(name="c", dim=[1, 21])
    x = g.tensor(name="x", dim=[9, 21])
    by_row = g.cmp_gt(rows, 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    by_col = g.cmp_lt(cols, 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    one = g.cmp_ge(g.tensor(name="s", dim=[1, 1]), 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    chosen = g.where(g.logical_and(g.logical_and(by_row, by_col), one), x, g.neg(x)).set_output(True)
    _execute_and_check(g, {"r": torch.randn(9, 1), "c": torch.randn(1, 21), "s": torch.ones(1, 1),
                           "x": torch.randn(9, 21)})
    wide = [launch for launch in g.plan.launches if chosen.name in [t.name for t in launch.group.outputs]]
    assert "space=[9, 21]" in wide[0].config_text


def test_schedule_stores_a_narrower_packed_output_along_its_own_axis():
    # were a kernel over a wider domain to store one (the partitioner keeps graph outputs apart):
    # the output's broadcast axis goes outermost, its packed axis is the column axis
    from dnngraph.backends.triton.heuristics.pointwise import schedule
    from dnngraph.fusion.partition import FusionGroup
    from dnngraph.target import target_of

    g = _graph()
    r, x = g.tensor(name="r", dim=[9, 1]), g.tensor(name="x", dim=[9, 21])
    by_row = g.cmp_gt(r, 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    chosen = g.where(by_row, x, 0.0).set_output(True)
    group = FusionGroup("pointwise", None, [by_row.producer, chosen.producer], inputs=[r, x],
                        outputs=[by_row, chosen])
    planned = schedule(group, target_of())
    assert planned.space.sizes == (21, 9) and planned.operands[2].strides == (0, 1)


@pytest.mark.parametrize("stride", [[40, 1], [1, 8], [0, 1]])
def test_strided_bit_packed_inputs_are_read_bit_by_bit(stride):
    # a mask read out of a wider buffer, packed along the other axis, or one row for all: the
    # selected values follow every bit (a wrong bit picks the other branch)
    g = _graph()
    m = g.tensor(name="m", dim=[5, 13], stride=stride, data_type=dg.bool_bit_packed)
    a = g.tensor(name="a", dim=[5, 13])
    g.where(m, a, g.neg(a)).set_output(True)
    g.logical_not(m).set_output(True).set_data_type(dg.bool_bit_packed)
    values = _mask([5, 13]) if stride[0] else _mask([1, 13]).expand(5, 13)
    _execute_and_check(g, {"a": torch.rand(5, 13) + 0.5, "m": _storage(m, fill=values)})


def test_mask_updated_in_place():
    # the output bound to the input's own storage: each program reads its bytes before it
    # writes them, the padding bits stay
    g = _graph()
    m = g.tensor(name="m", dim=[5, 13], data_type=dg.bool_bit_packed)
    x = g.tensor(name="x", dim=[5, 13])
    y = g.logical_or(g.logical_not(m), g.cmp_gt(x, 1.0)).set_output(True).set_data_type(dg.bool_bit_packed)
    g.build()
    values, xt = _mask([5, 13]), torch.randn(5, 13)
    storage = _storage(m, fill=values)
    padding = _bits_outside(storage, m)
    g.execute({m: storage, x: xt, y: storage})
    assert torch.equal(dg.unpack_bits(storage, [5, 13], [16, 1]), ~values | (xt > 1.0))
    assert torch.equal(_bits_outside(storage, m), padding)


def test_integer_compare_and_cast_to_bits():
    g = _graph()
    i = g.tensor(name="i", dim=[3, 10], data_type=dg.int32)
    j = g.tensor(name="j", dim=[3, 10], data_type=dg.int32)
    g.cmp_eq(i, j).set_output(True).set_data_type(dg.bool_bit_packed)
    g.cast(i, data_type=dg.bool_bit_packed).set_output(True)
    it = torch.randint(-2, 3, (3, 10), dtype=torch.int32)
    _execute_and_check(g, {"i": it, "j": torch.randint(-2, 3, (3, 10), dtype=torch.int32)})


def test_many_tiles_own_whole_bytes():
    # several row and column tiles, rows ending in a partial byte: every tile packs whole bytes
    g = _graph()
    dims = [9, 1030]
    a = g.tensor(name="a", dim=dims)
    g.cmp_ge(a, g.tensor(name="b", dim=[9, 1])).set_output(True).set_data_type(dg.bool_bit_packed)
    _execute_and_check(g, {"a": torch.randn(dims), "b": torch.randn(9, 1)})
    assert g.plan.launches[0].grid[0] > 1


def test_reference_takes_bools_or_storage():
    g = _graph()
    m = g.tensor(name="m", dim=[2, 9], data_type=dg.bool_bit_packed)
    g.logical_not(m).set_output(True)
    values = _mask([2, 9])
    by_bits = g.reference({"m": dg.pack_bits(values)})
    by_bools = g.reference({"m": values})
    assert torch.equal(by_bits[g.outputs()[0].name], ~values)
    assert torch.equal(by_bools[g.outputs()[0].name], ~values)


@pytest.mark.parametrize("value", [1, 2, -1, 0])
def test_pass_by_value_bit_as_a_bool_is(value):
    # a host number for a one-element mask: any nonzero number is true, as for dg.bool (not
    # only those whose lowest bit is set)
    results = {}
    for data_type in (dg.bool, dg.bool_bit_packed):
        g = _graph()
        m = g.tensor(name="m", dim=[1, 1], data_type=data_type, is_pass_by_value=True)
        x = g.tensor(name="x", dim=[3, 5])
        y = g.where(m, x, 0.0).set_output(True)
        g.build()
        xt, yt = torch.randn(3, 5), torch.full((3, 5), float("nan"))
        g.execute({m: value, x: xt, y: yt})
        assert torch.equal(g.reference({m: value, x: xt})[y.name].float(), yt)
        results[data_type.name] = torch.equal(yt, xt if value else torch.zeros(3, 5))
    assert results == {"bool": True, "bool_bit_packed": True}


def test_serialization_keeps_bits():
    g = _graph()
    m = g.tensor(name="m", dim=[3, 5], data_type=dg.bool_bit_packed)
    a = g.tensor(name="a", dim=[3, 5])
    g.logical_and(m, g.cmp_gt(a, a)).set_output(True).set_data_type(dg.bool_bit_packed).set_name("y")
    g2 = dg.Graph.from_json(g.to_json())
    y2 = [t for t in g2.outputs() if t.name == "y"][0]
    assert y2.data_type is dg.bool_bit_packed and y2.stride == (8, 1)
    assert json.loads(g.to_json()) == json.loads(g2.to_json())
    _execute_and_check(g2, {"m": _storage(g2.inputs()[0], fill=_mask([3, 5])), "a": torch.randn(3, 5)})


def test_as_function_returns_storage():
    g = _graph()
    a = g.tensor(name="a", dim=[4, 10])
    g.cmp_gt(a, g.tensor(name="b", dim=[4, 10])).set_output(True).set_data_type(dg.bool_bit_packed)
    fn = g.as_function()
    at, bt = torch.randn(4, 10), torch.randn(4, 10)
    out = fn(at, bt)
    assert out.dtype == torch.uint8 and tuple(out.shape) == (4, 2)
    assert torch.equal(dg.unpack_bits(out, [4, 10], [16, 1]), at > bt)


# --- attention written as ops: a bit-packed mask on the scores ----------------------------------

def _masked_attention(s_q=13, s_kv=19, d=8):
    """softmax(where(mask, q k^T / sqrt(d), -inf)) v with the mask [1, 1, s_q, s_kv] bit-packed
    (key rows of 19 bits: partial last bytes); every query row sees its first key."""
    g = _graph()
    q, kt = g.tensor(name="q", dim=[2, 3, s_q, d]), g.tensor(name="kt", dim=[2, 3, d, s_kv])
    v = g.tensor(name="v", dim=[2, 3, s_kv, d])
    mask = g.tensor(name="mask", dim=[1, 1, s_q, s_kv], data_type=dg.bool_bit_packed)
    scores = g.where(mask, g.mul(g.matmul(q, kt), d ** -0.5), float("-inf"))
    g.matmul(g.softmax(scores, axis=-1), v).set_output(True).set_name("o")
    visible = _mask([1, 1, s_q, s_kv], 0.6)
    visible[..., 0] = True
    inputs = {"q": torch.randn(2, 3, s_q, d), "kt": torch.randn(2, 3, d, s_kv), "v": torch.randn(2, 3, s_kv, d),
              "mask": _storage(mask, fill=visible)}
    return g, inputs, visible


def test_attention_reads_a_bit_packed_mask_in_its_one_kernel():
    g, inputs, visible = _masked_attention()
    outputs = _execute_and_check(g, inputs)
    assert [launch.group.kind for launch in g.plan.launches] == ["attention"]
    q, kt, v = inputs["q"].double(), inputs["kt"].double(), inputs["v"].double()
    scores = torch.where(visible, (q @ kt) * 8 ** -0.5, float("-inf"))
    assert torch.allclose(outputs["o"].double(), torch.softmax(scores, -1) @ v, atol=1e-5)


def test_attention_gradients_through_a_bit_packed_mask():
    g, inputs, visible = _masked_attention()
    fn = g.as_function()
    q, kt, v = (inputs[name].clone().requires_grad_(True) for name in ("q", "kt", "v"))
    fn(q, kt, v, inputs["mask"]).sum().backward()
    q64, kt64, v64 = (x.detach().double().requires_grad_(True) for x in (q, kt, v))
    scores = torch.where(visible, (q64 @ kt64) * 8 ** -0.5, float("-inf"))
    (torch.softmax(scores, -1) @ v64).sum().backward()
    for got, want in ((q, q64), (kt, kt64), (v, v64)):
        assert (got.grad.double() - want.grad).norm() / want.grad.norm() < 2e-5


# --- refusals: typed, and nothing written ---------------------------------------------------------

def _one_compare():
    g = _graph()
    a = g.tensor(name="a", dim=[3, 13])
    y = g.cmp_gt(a, g.tensor(name="b", dim=[3, 13])).set_output(True).set_data_type(dg.bool_bit_packed)
    g.build()
    return g, y


@pytest.mark.parametrize("bad", ["logical_shape", "bool_dtype", "wrong_strides", "short"])
def test_wrong_storage_is_refused_and_nothing_written(bad):
    g, y = _one_compare()
    good = _storage(y)
    wrong = {"logical_shape": torch.zeros(3, 13, dtype=torch.uint8),
             "bool_dtype": torch.zeros(3, 2, dtype=torch.bool),
             "wrong_strides": torch.zeros(2, 3, dtype=torch.uint8).T,
             "short": torch.zeros(3, 1, dtype=torch.uint8)}[bad]
    before = wrong.clone()
    other = g.outputs()[0]
    with pytest.raises(dg.ExecutionError):
        g.execute({"a": torch.randn(3, 13), "b": torch.randn(3, 13), other: wrong})
    assert torch.equal(wrong, before)
    g.execute({"a": torch.randn(3, 13), "b": torch.randn(3, 13), other: good})  # the plan still runs


def test_wrong_input_storage_refused_before_any_write():
    g = _graph()
    m = g.tensor(name="m", dim=[3, 13], data_type=dg.bool_bit_packed)
    a = g.tensor(name="a", dim=[3, 13])
    y = g.where(m, a, a).set_output(True)
    g.build()
    out = torch.full((3, 13), float("nan"))
    for wrong in (torch.zeros(3, 13, dtype=torch.bool), torch.zeros(3, 3, dtype=torch.uint8)):
        with pytest.raises(dg.ExecutionError):
            g.execute({"m": wrong, "a": torch.randn(3, 13), y: out})
        assert torch.isnan(out).all()
    with pytest.raises(dg.ExecutionError):
        g.reference({"m": torch.zeros(3, 13, dtype=torch.uint8), "a": torch.randn(3, 13)})


def test_non_pointwise_readers_refused():
    g = _graph()
    m = g.tensor(name="m", dim=[4, 16], data_type=dg.bool_bit_packed)
    g.reduction(g.cast(m, data_type=dg.float32), mode="sum", axes=[1]).set_output(True)  # fine: cast is pointwise
    g.build()
    g2 = _graph()
    m2 = g2.tensor(name="m", dim=[4, 16], data_type=dg.bool_bit_packed)
    g2.transpose(m2, [1, 0]).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="only pointwise ops"):
        g2.build()


def test_bits_stay_out_of_anchor_epilogues():
    # matmul then a compare into bits: the compare is its own pointwise kernel, not the GEMM's
    # epilogue (a GEMM's stores address bytes)
    g = _graph()
    a, b = g.tensor(name="a", dim=[5, 7]), g.tensor(name="b", dim=[7, 11])
    y = g.cmp_gt(g.matmul(a, b), g.tensor(name="t", dim=[1, 11]))
    y.set_output(True).set_data_type(dg.bool_bit_packed)
    _execute_and_check(g, {"a": torch.randn(5, 7), "b": torch.randn(7, 11), "t": torch.randn(1, 11)})
    assert [launch.group.kind for launch in g.plan.launches] == ["matmul", "pointwise"]


def test_packed_outputs_of_crossed_layouts_get_kernels_of_their_own():
    # one kernel packs along one column axis: a row-major and a column-major bit-packed output of
    # one input stay in two kernels (siblings of other layouts merge)
    g = _graph()
    a = g.tensor(name="a", dim=[8, 19])
    g.cmp_gt(a, 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    g.cmp_lt(a, 0.5).set_output(True).set_data_type(dg.bool_bit_packed).set_stride([1, 8])
    g.exp(a).set_output(True)
    _execute_and_check(g, {"a": torch.randn(8, 19)})
    assert len(g.plan.launches) == 2


def test_schedule_refuses_a_packed_output_off_the_column_axis():
    # the schedule's own guard, were a group to hold two packed layouts
    from dnngraph.backends.triton.heuristics.pointwise import schedule
    from dnngraph.fusion.partition import FusionGroup
    from dnngraph.target import target_of

    g = _graph()
    a = g.tensor(name="a", dim=[8, 16])
    y = g.cmp_gt(a, a).set_output(True).set_data_type(dg.bool_bit_packed)
    z = g.cmp_lt(a, a).set_output(True).set_data_type(dg.bool_bit_packed).set_stride([1, 8])
    group = FusionGroup("pointwise", None, [y.producer, z.producer], inputs=[a], outputs=[y, z])
    with pytest.raises(dg.UnsupportedError, match="column axis"):
        schedule(group, target_of())


def test_blending_bits_refused():
    g, y = _one_compare()
    y.set_blend(alpha=1.0, beta=1.0)
    with pytest.raises(dg.ValidationError, match="floating"):
        g.build()


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dims", [[4099, 1027], [3, 70001], [257, 9]])
def test_gpu_bits_race_free(dims):
    # many programs: neighbouring tiles of one row share no byte (a race would flip bits)
    g = _graph()
    a = g.tensor(name="a", dim=dims)
    m = g.tensor(name="m", dim=dims, data_type=dg.bool_bit_packed)
    keep = g.logical_and(g.cmp_gt(a, g.tensor(name="b", dim=[1, dims[1]])), m)
    keep.set_output(True).set_data_type(dg.bool_bit_packed)
    g.where(m, a, g.neg(a)).set_output(True)
    inputs = {"a": torch.randn(dims), "b": torch.randn(1, dims[1]), "m": dg.pack_bits(_mask(dims))}
    for _ in range(3):
        _execute_and_check(g, inputs, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [70001, 4099])
def test_gpu_narrow_and_lone_bit_outputs(rows):
    # many programs over a per-row mask stored from a wider kernel, and a column of bits each
    # alone in its byte: every byte has one writer
    g = _graph()
    r, x = g.tensor(name="r", dim=[rows, 1]), g.tensor(name="x", dim=[rows, 37])
    by_row = g.cmp_gt(r, 0.0).set_output(True).set_data_type(dg.bool_bit_packed)
    g.where(by_row, x, g.neg(x)).set_output(True)
    g.cmp_lt(r, 0.5).set_output(True).set_data_type(dg.bool_bit_packed).set_stride([8, 1])
    for _ in range(3):
        _execute_and_check(g, {"r": torch.randn(rows, 1), "x": torch.randn(rows, 37)}, device="cuda")


@pytest.mark.gpu
def test_gpu_compare_transposed_bits():
    g = _graph()
    a = g.tensor(name="a", dim=[300, 77], stride=[1, 300])
    y = g.cmp_ne(a, g.tensor(name="b", dim=[300, 77]))
    y.set_output(True).set_data_type(dg.bool_bit_packed)
    at = torch.randn(77, 300).T
    _execute_and_check(g, {"a": at, "b": torch.where(torch.rand(300, 77) < 0.5, at, 0.0)}, device="cuda")


@pytest.mark.gpu
def test_gpu_attention_with_a_bit_packed_mask():
    g, inputs, _ = _masked_attention(s_q=200, s_kv=333, d=64)
    _execute_and_check(g, inputs, device="cuda")
    assert [launch.group.kind for launch in g.plan.launches] == ["attention"]


def sm90_bit_run_graphs():
    """(label, graph) of pointwise kernels reading and writing bit-packed tensors along their
    columns, planned for an H200 (tests/sm90_compile.py)."""
    from dnngraph.target import H200
    for rows, cols in ((16384, 8192), (5, 4096), (3, 1000)):
        g = dg.Graph(name="mask", io_data_type=dg.bfloat16)
        x, t = g.tensor(name="x", dim=[rows, cols]), g.tensor(name="t", dim=[1, cols])
        m = g.tensor(name="m", dim=[rows, cols], data_type=dg.bool_bit_packed)
        g.logical_and(g.cmp_gt(x, t), m).set_output(True).set_data_type(dg.bool_bit_packed)
        g.cmp_gt(x, t).set_output(True).set_data_type(dg.bool_bit_packed)
        yield f"mask {rows}x{cols}", g.build(options=dg.BuildOptions(target=H200))


def test_bit_runs_pack_inside_threads_on_sm90():
    """A byte of bits is packed and unpacked by the one thread holding its 8 columns: the
    compiled kernels exchange nothing through shared memory (the first bit-packed kernels
    reshaped their tiles, which went through shared memory and ran at a quarter of the byte
    masks' bandwidth on an H200). Rows of 1000 columns and more, where a tile is one row; tiles
    of several narrow rows still convert their row-broadcast operands."""
    from helpers import compiled_for_sm90
    output = compiled_for_sm90("test_bit_packed:sm90_bit_run_graphs", timeout=400)
    shared = [line for line in output.splitlines() if line.startswith("shared ")]
    assert len(shared) == 3, output[-2000:]
    assert all(line.endswith(": 0") for line in shared), shared
