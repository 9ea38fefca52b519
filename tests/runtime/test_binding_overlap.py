"""Bindings in one buffer: an output may share no element with another binding (DESIGN.md: no
safe order exists), but views that interleave in one buffer without a common element are
disjoint and run: dQ, dK and dV unbound from one dQKV tensor, rotary halves, even and odd columns,
an input interleaved with an output. The exact test (runtime/overlap.py) is checked against brute
force enumeration on random strided views. On the GPU (marked gpu): dQ/dK/dV and rotary halves
written into views of one buffer through the prepared launches."""
import itertools
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dnngraph as dg
from dnngraph.runtime import interpreter as runtime
from dnngraph.runtime import overlap
from dnngraph.runtime.overlap import StridedBytes, share_a_byte
from helpers import rel_err

GEN = torch.Generator().manual_seed(2626)


def _randn(*dims, device="cpu"):
    return torch.randn(*dims, generator=GEN).to(device)


def _assert_close(outputs: dict, reference: dict, limit=2e-5):
    for name, value in outputs.items():
        assert rel_err(value, reference[name]) < limit, name


# --- dQKV in one buffer -------------------------------------------------------------------------
def _packed_bhsd(batch, seq, heads, dim, fill=None):
    """(buffer [B, S, 3, H, D], its three [B, H, S, D] views): q, k, v packed as the cuDNN
    frontend's tests pack them."""
    buffer = torch.full((batch, seq, 3, heads, dim), fill) if fill is not None else _randn(batch, seq, 3, heads, dim)
    return buffer, [part.permute(0, 2, 1, 3) for part in buffer.unbind(2)]


def _attention_forward(q_t, k_t, v_t):
    """(o, stats) of sdpa on the given values, from the float64 reference."""
    g = dg.Graph(name="forward")
    q, k, v = (g.tensor_like(t, name) for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
    o.set_output(True).set_name("o")
    stats.set_output(True).set_name("stats")
    reference = g.reference({q: q_t, k: k_t, v: v_t})
    return reference["o"].float(), reference["stats"].float()


def test_dqkv_written_into_views_of_one_buffer_by_sdpa_backward():
    batch, seq, heads, dim = 2, 7, 2, 8
    _, (q_t, k_t, v_t) = _packed_bhsd(batch, seq, heads, dim)
    o_t, stats_t = _attention_forward(q_t, k_t, v_t)
    do_t = _randn(*o_t.shape)
    g = dg.Graph(name="dqkv")
    q, k, v = (g.tensor_like(t, name) for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, d_o, stats = g.tensor_like(o_t, "o"), g.tensor_like(do_t, "dO"), g.tensor_like(stats_t, "stats")
    grads_buffer, grad_views = _packed_bhsd(batch, seq, heads, dim, fill=float("nan"))
    grads = g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
    for grad, name, view in zip(grads, ("dq", "dk", "dv"), grad_views):
        grad.set_output(True).set_name(name).set_stride(list(view.stride()))
    g.build()
    inputs = {q: q_t, k: k_t, v: v_t, o: o_t, d_o: do_t, stats: stats_t}
    g.execute({**inputs, **dict(zip(grads, grad_views))})
    _assert_close(dict(zip(("dq", "dk", "dv"), grad_views)), g.reference(inputs))
    assert not torch.isnan(grads_buffer).any()  # the three views cover it exactly


# --- pointwise outputs in one tensor ------------------------------------------------------------
def _two_outputs(x_t, first_view, second_view):
    """y1 = x * 2 and y2 = exp(x) over halves of x, written into `first_view`, `second_view`."""
    g = dg.Graph(name="halves")
    x = g.tensor_like(x_t, "x")
    rows, cols = x_t.shape
    half = cols // 2
    x1 = g.slice(x, [slice(None), slice(0, half)])
    x2 = g.slice(x, [slice(None), slice(half, cols)])
    y1 = g.scale(x1, 2.0).set_output(True).set_name("y1").set_stride(list(first_view.stride()))
    y2 = g.exp(x2).set_output(True).set_name("y2").set_stride(list(second_view.stride()))
    return g.build(), x, y1, y2


@pytest.fixture(params=["in_this_process", "in_the_interpreter_process"])
def where(request):
    """Where CPU kernels run: the interpreter process copies outputs back element by element."""
    runtime.force_interpreter_worker(request.param == "in_the_interpreter_process")
    yield request.param
    runtime.force_interpreter_worker(False)


@pytest.mark.parametrize("split", ["halves", "even_odd"])
def test_two_outputs_interleaved_in_one_tensor(split, where):
    rows, cols = 5, 14
    x_t = _randn(rows, cols)
    out = torch.full((rows, cols), float("nan"))
    if split == "halves":  # rotary: x[..., :D/2] and x[..., D/2:]
        views = out[:, :cols // 2], out[:, cols // 2:]
    else:
        views = out[:, 0::2], out[:, 1::2]
    g, x, y1, y2 = _two_outputs(x_t, *views)
    g.execute({x: x_t, y1: views[0], y2: views[1]})
    _assert_close({"y1": views[0], "y2": views[1]}, g.reference({x: x_t}))
    assert not torch.isnan(out).any()


def test_outputs_sharing_one_element_are_refused_and_nothing_is_written():
    rows, cols = 5, 14
    x_t = _randn(rows, cols)
    out = torch.full((rows, cols + 1), float("nan"))
    views = out[:, :cols // 2], out[:, cols // 2 - 1:cols - 1]  # column cols/2 - 1 in both
    g, x, y1, y2 = _two_outputs(x_t, *views)
    with pytest.raises(dg.ExecutionError, match="output 'y1' overlaps 'y2'|output 'y2' overlaps 'y1'"):
        g.execute({x: x_t, y1: views[0], y2: views[1]})
    assert torch.isnan(out).all()
    # one element only: the last of one output's rows is the first of the other's next row
    flat = torch.full((rows * cols,), float("nan"))
    first = flat[:rows * cols // 2].view(rows, cols // 2)
    second = flat[cols // 2 - 1:].as_strided((rows, cols // 2), (cols // 2 + 1, 1))  # starts on first's element 6
    assert first.data_ptr() + (cols // 2 - 1) * 4 == second.data_ptr()
    g2, x, y1, y2 = _two_outputs(x_t, first, second)
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g2.execute({x: x_t, y1: first, y2: second})
    assert torch.isnan(flat).all()


def test_an_input_interleaved_with_an_output_runs_and_one_sharing_an_element_is_refused():
    """execute's rule for an input and an output, by elements: no element in common runs, the
    very same view runs in place (an elementwise kernel: runtime/in_place.py), one element in
    common otherwise is refused."""
    memory = _randn(7, 10)
    buffer = memory[:6]
    x_t = buffer[:, 0::2]
    g = dg.Graph(name="interleaved")
    x = g.tensor_like(x_t, "x")
    y = g.sigmoid(x).set_output(True).set_name("y").set_stride(list(x_t.stride()))
    g.build()
    expected = g.reference({x: x_t})["y"]
    before = buffer.clone()
    g.execute({x: x_t, y: buffer[:, 1::2]})
    assert rel_err(buffer[:, 1::2], expected) < 2e-5
    assert torch.equal(buffer[:, 0::2], before[:, 0::2])
    before = buffer.clone()
    expected = g.reference({x: x_t.clone()})["y"]
    g.execute({x: x_t, y: buffer[:, 0::2]})  # in place: each element read before it is written
    assert rel_err(buffer[:, 0::2], expected) < 2e-5
    assert torch.equal(buffer[:, 1::2], before[:, 1::2])
    shifted = memory.view(-1)[2:].as_strided((6, 5), (10, 2))  # x's element [0, 1] is its [0, 0]
    before = memory.clone()
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute({x: x_t, y: shifted})
    assert torch.equal(memory, before)


def test_outputs_of_different_dtypes_interleaved_by_bytes():
    """A float16 output in the gaps of a float32 output (its odd float32 slots): apart by bytes;
    one sharing half of each of the float32 output's elements is refused."""
    x_t = _randn(4, 6)
    g = dg.Graph(name="bytes")
    x = g.tensor_like(x_t, "x")
    wide = g.relu(x).set_output(True).set_name("wide").set_stride([12, 2])
    narrow = g.neg(x).set_output(True).set_name("narrow").set_data_type(dg.float16).set_stride([24, 4])
    g.build()
    raw = torch.full((4 * 12,), float("nan"))
    wide_t = raw.as_strided((4, 6), (12, 2))
    narrow_t = raw.view(torch.float16)[2:].as_strided((4, 6), (24, 4))  # the odd float32 slots
    g.execute({x: x_t, wide: wide_t, narrow: narrow_t})
    _assert_close({"wide": wide_t, "narrow": narrow_t}, g.reference({x: x_t}), limit=1e-3)
    clashing = raw.view(torch.float16)[1:].as_strided((4, 6), (24, 4))  # upper halves of wide's elements
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.execute({x: x_t, wide: wide_t, narrow: clashing})


# --- the exact test against enumeration --------------------------------------------------------
def _brute_force(first: StridedBytes, second: StridedBytes) -> bool:
    def addresses(view):
        ranges = [range(size) for size, _ in view.axes]
        return {view.start + sum(i * stride for i, (_, stride) in zip(index, view.axes))
                for index in itertools.product(*ranges)}
    return bool(addresses(first) & addresses(second))


@st.composite
def _views(draw):
    rank = draw(st.integers(0, 3))
    sizes = draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 4, 5, 7]), min_size=rank, max_size=rank))
    # stride 0 (broadcast) and strides smaller than what inner axes span (self-overlapping)
    strides = draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16]), min_size=rank, max_size=rank))
    return StridedBytes.of(draw(st.integers(0, 48)), sizes, strides, draw(st.sampled_from([1, 2, 4, 8])))


@settings(max_examples=600, deadline=None)
@given(_views(), _views())
def test_exact_overlap_agrees_with_enumeration(first, second):
    assert share_a_byte(first, second) == _brute_force(first, second)
    assert share_a_byte(second, first) == _brute_force(first, second)


@settings(max_examples=200, deadline=None)
@given(_views(), _views())
def test_past_the_search_budget_enumeration_decides_and_past_both_overlap_is_assumed(first, second):
    """The fallbacks: a search cut short enumerates (still exact); a pair too large to enumerate
    is reported as overlapping, never as disjoint when it is not."""
    expected = _brute_force(first, second)
    with mock.patch.object(overlap, "SEARCH_BUDGET", 0):
        assert share_a_byte(first, second) == expected
        with mock.patch.object(overlap, "ENUMERATION_LIMIT", 0):
            assert share_a_byte(first, second) or not expected


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_equal_layouts_at_an_offset_agree_with_enumeration(data):
    """The common case (views of one layout at another offset: packed heads, halves, phases)."""
    view = data.draw(_views())
    shifted = StridedBytes(view.start + data.draw(st.integers(0, 64)), view.axes)
    assert share_a_byte(view, shifted) == _brute_force(view, shifted)


def test_large_packed_views_are_decided_exactly_and_at_once():
    """dQ, dK, dV of a [B, S, 3, H, D] bf16 buffer at training sizes: no enumeration could do it."""
    batch, seq, heads, dim = 8, 4096, 32, 128
    strides = (seq * 3 * heads * dim, dim, 3 * heads * dim, 1)  # [B, H, S, D] views

    def head(part, shift=0):
        return StridedBytes.of(2 * (part * heads * dim + shift), (batch, heads, seq, dim), strides, 2)

    assert not share_a_byte(head(0), head(1))
    assert not share_a_byte(head(0), head(2))
    assert share_a_byte(head(0), head(1, shift=-1))
    assert share_a_byte(head(0), StridedBytes(head(1).start - 1, head(1).axes))  # one byte


# --- on the GPU: views of one buffer through the prepared launches -------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dqkv_in_one_buffer_on_cuda(dtype):
    """q, k, v read from one packed buffer, dQ, dK, dV written into views of another."""
    batch, seq, heads, dim = 2, 197, 4, 64
    data_type = dg.float16 if dtype == torch.float16 else dg.bfloat16
    packed, _ = _packed_bhsd(batch, seq, heads, dim)
    packed = packed.to(dtype)
    q_t, k_t, v_t = (part.permute(0, 2, 1, 3) for part in packed.unbind(2))  # CPU, the reference's
    o_t, stats_t = _attention_forward(q_t.float(), k_t.float(), v_t.float())
    o_t, do_t = o_t.to(dtype), torch.randn(*o_t.shape, generator=GEN).to(dtype)
    g = dg.Graph(name="dqkv_gpu", io_data_type=data_type)
    q, k, v = (g.tensor_like(t, name) for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    o, d_o, stats = g.tensor_like(o_t, "o"), g.tensor_like(do_t, "dO"), g.tensor_like(stats_t, "stats")
    buffer = torch.full((batch, seq, 3, heads, dim), float("nan"), dtype=dtype, device="cuda")
    views = [part.permute(0, 2, 1, 3) for part in buffer.unbind(2)]
    grads = g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
    for grad, name, view in zip(grads, ("dq", "dk", "dv"), views):
        grad.set_output(True).set_name(name).set_data_type(data_type).set_stride(list(view.stride()))
    g.build()
    on_gpu = [part.permute(0, 2, 1, 3) for part in packed.cuda().unbind(2)]  # the packed strides kept
    bound = dict(zip((q, k, v), on_gpu))
    bound.update({o: o_t.cuda(), d_o: do_t.cuda(), stats: stats_t.cuda()})
    g.execute({**bound, **dict(zip(grads, views))})
    reference = g.reference({q: q_t, k: k_t, v: v_t, o: o_t, d_o: do_t, stats: stats_t})
    for name, view in zip(("dq", "dk", "dv"), views):
        assert rel_err(view, reference[name]) < 2e-2, name
    assert not torch.isnan(buffer).any()


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["halves", "even_odd"])
def test_interleaved_outputs_on_cuda(split):
    x_t = _randn(33, 128, device="cuda")
    out = torch.full((33, 128), float("nan"), device="cuda")
    views = (out[:, :64], out[:, 64:]) if split == "halves" else (out[:, 0::2], out[:, 1::2])
    g, x, y1, y2 = _two_outputs(x_t, *views)
    for _ in range(2):  # the second through the prepared launches
        g.execute({x: x_t, y1: views[0], y2: views[1]})
    reference = g.reference({x: x_t.cpu()})
    assert rel_err(views[0], reference["y1"]) < 1e-5 and rel_err(views[1], reference["y2"]) < 1e-5
    assert not torch.isnan(out).any()
