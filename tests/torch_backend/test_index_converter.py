"""aten.index.Tensor with several index tensors (x[rows, cols], a mask's padding[batch, kv],
CLIP's x[arange(B), argmax]) converts: the indexed axes merged into one, gathered by one flat
id; its backward (index_put with accumulate) converts as a scatter-add. Bool masks stay in
torch. Each case compares against eager on fresh random inputs (CPU, Triton's interpreter)."""
import pytest
import torch

from dnngraph import torch_backend
from helpers import rel_err
from test_torch_converters import _compiled, _left_to_torch


def _matches(fn, x, *ids):
    got, want = _compiled(fn)(x, *ids), fn(x, *ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    return got


def _ids(size, shape, dtype=torch.int64):
    """Ids of an axis of `size`, negatives among them (they count from the axis's end)."""
    return torch.randint(-size, size, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_two_index_tensors_on_a_matrix_convert(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    _matches(lambda x, r, c: x[r, c], x, _ids(5, (7,), dtype), _ids(6, (7,), dtype))
    assert _left_to_torch(["index"]) == []


def test_mixed_int32_and_int64_ids_convert():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    _matches(lambda x, r, c: x[r, c], x, _ids(5, (2, 3), torch.int32), _ids(6, (3,)))
    assert _left_to_torch(["index"]) == []


CASES = {  # fn, the index tensors' shapes, the sizes of the axes they index
    "leading_slice": (lambda x, i, j: x[:, i, j], ((4,), (4,)), (4, 5)),
    "both_slices": (lambda x, i, j: x[:, i, j, :], ((2, 3), (2, 3)), (4, 5)),
    "broadcast": (lambda x, i, j: x[i, j], ((3, 1), (1, 5)), (3, 4)),
    "ranks_differ": (lambda x, i, j: x[:, :, i, j], ((2, 1, 3), (3,)), (5, 6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_adjacent_index_tensors_on_a_4d_tensor_convert(name):
    torch.manual_seed(1)
    fn, shapes, sizes = CASES[name]
    x = torch.randn(3, 4, 5, 6)
    _matches(fn, x, *(_ids(size, shape) for size, shape in zip(sizes, shapes)))
    assert _left_to_torch(["index"]) == []


def test_three_index_tensors_convert():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 5, 6)
    fn = lambda x, i, j, k: x[:, i, j, k]  # noqa: E731
    _matches(fn, x, _ids(4, (2, 1)), _ids(5, (1, 3)), _ids(6, (3,)))
    assert _left_to_torch(["index"]) == []


def test_a_transposed_x_converts():
    """The indexed axes merge by a logical reshape: a transposed x's merge is a copy, not a view
    of memory with the wrong strides."""
    torch.manual_seed(3)
    fn = lambda x, i, j: x.transpose(0, 2)[:, i, j] * 2.0  # noqa: E731
    x = torch.randn(5, 4, 6)
    _matches(fn, x, _ids(4, (3,)), _ids(5, (3,)))
    assert _left_to_torch(["index"]) == []


def test_a_bf16_x_converts():
    torch.manual_seed(4)
    x = torch.randn(6, 7).to(torch.bfloat16)
    _matches(lambda x, r, c: x[r, c], x, _ids(6, (4, 1)), _ids(7, (1, 5)))
    assert _left_to_torch(["index"]) == []


def test_index_tensors_separated_by_a_slice_convert():
    """x[i, :, j]: torch puts the broadcast index dims first, then the sliced axis."""
    torch.manual_seed(5)
    x = torch.randn(4, 3, 5, 2)
    got = _matches(lambda x, i, j: x[i, :, j], x, _ids(4, (2, 1)), _ids(5, (6,)))
    assert got.shape == (2, 6, 3, 2)
    assert _left_to_torch(["index"]) == []


def test_clip_pooling_pattern_converts():
    """CLIP's pooled output: the hidden state at each row's argmax token."""
    torch.manual_seed(6)

    def pooled(hidden, tokens):
        return hidden[torch.arange(hidden.shape[0]), tokens.argmax(dim=-1)]

    hidden, tokens = torch.randn(3, 7, 8), torch.randint(0, 50, (3, 7))
    _matches(pooled, hidden, tokens)
    assert _left_to_torch(["index"]) == []


def test_transformers_padding_mask_pattern_converts():
    """transformers' sdpa_mask (masking_utils, non-vmap path): padding_mask[batch_idx, kv_idx]
    with batch [B, 1, 1, 1] and kv [1, 1, 1, KV] aranges, and'ed with a causal mask."""
    torch.manual_seed(7)
    batch, q_length, kv_length = 3, 5, 5

    def mask(padding_mask):
        b = torch.arange(batch)[:, None, None, None]
        h = torch.arange(1)[None, :, None, None]
        q = torch.arange(q_length)[None, None, :, None]
        kv = torch.arange(kv_length)[None, None, None, :]
        causal = kv <= q
        return (causal & padding_mask[b, kv]).expand(batch, -1, q_length, kv_length) & (h >= 0)

    padding_mask = torch.rand(batch, kv_length) > 0.3
    _matches(mask, padding_mask)
    assert _left_to_torch(["index"]) == []


def test_out_of_range_ids_read_nan_as_the_single_index_path_does():
    """torch raises on an id outside its axis; a kernel cannot: the gather reads NaN there (an id
    past one axis would otherwise name an element of the next row of the merged axis)."""
    x = torch.randn(4, 5)
    rows, cols = torch.tensor([1, 0, 4, -5]), torch.tensor([5, 2, 0, 1])
    got = _compiled(lambda x, r, c: x[r, c])(x, rows, cols)
    assert torch.isnan(got[[0, 2, 3]]).all() and got[1] == x[0, 2]


def test_a_bool_mask_stays_in_torch():
    """A mask's result shape depends on its values: torch computes it (dynamo breaks the graph
    there, or the backend leaves the op to torch with its reason)."""
    torch.manual_seed(8)
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    fn = lambda x, m: x[m] * 2.0  # noqa: E731
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    assert torch.equal(torch.compile(fn, backend="dnngraph")(x, mask), fn(x, mask))
    assert all("mask" in why for _, why in _left_to_torch(["index"]))


def test_a_mask_index_is_refused_with_its_reason():
    """The refusal itself, on an FX node of index.Tensor with a bool index (dynamo breaks the
    graph before one reaches the backend in practice)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from dnngraph.torch_backend.convert import _gather_refused, unsupported

    x, mask = torch.randn(4, 5), torch.rand(4) > 0.5
    traced = make_fx(lambda x, m: torch.ops.aten.index.Tensor(x, [m]), tracing_mode="fake")(x, mask)
    (node,) = [n for n in traced.graph.nodes if n.target is torch.ops.aten.index.Tensor]
    assert unsupported(node) is not None  # its symbolic result shape first
    assert "mask" in _gather_refused(node)


TRAINING = {  # fn, x's shape, the index tensors (shape, size of the axis indexed)
    "broadcast": (lambda x, i, j: x[i, j], (5, 6, 2), (((4, 1), 5), ((1, 3), 6))),
    "leading_slice": (lambda x, i, j: x[:, i, j], (3, 6, 2), (((7,), 6), ((7,), 2))),  # repeats accumulate
    "separated": (lambda x, i, j: x[i, :, j], (5, 4, 2), (((3,), 5), ((3,), 2))),
}


@pytest.mark.parametrize("name", list(TRAINING))
def test_a_training_step_through_two_index_tensors_converts(name):
    """The backward is index_put(new_zeros, [i, j], dy, accumulate=True): a scatter-add over the
    merged axes, the gradient as eager's."""
    torch.manual_seed(9)
    fn, shape, index_shapes = TRAINING[name]
    x, ids = torch.randn(*shape), [_ids(size, ids_shape) for ids_shape, size in index_shapes]
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    step = lambda x, i, j: fn(x, i, j).tanh()  # noqa: E731
    got, want = _compiled(step)(leaf, *ids), step(eager_leaf, *ids)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    assert rel_err(got, want) < 1e-5
    assert rel_err(leaf.grad, eager_leaf.grad) < 1e-5
    assert len(torch_backend.REPORTS) == 2
    words = ["index", "new_zeros", "scatter"]
    assert _left_to_torch(words) == [], _left_to_torch(words)
