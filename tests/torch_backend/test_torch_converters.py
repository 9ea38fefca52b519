"""torch.compile(backend="dnngraph") converters of the ops real models left to torch (MobileNet's
hard activations, average and ceil-mode pooling, cat and padding, gathers, nll_loss): each
forward and backward against eager, and each op no longer in the report's ops left to torch."""
import pytest
import torch
import torch.nn.functional as F

from dnngraph import torch_backend
from helpers import rel_err


def _compiled(fn):
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    return torch.compile(fn, backend="dnngraph", fullgraph=True, dynamic=False)


def _left_to_torch(words) -> list:
    """The ops of every report this compile made whose target names one of `words`."""
    return [(target, why) for report in torch_backend.REPORTS for target, why in report.torch_ops
            if any(word in target for word in words)]


def _step_matches(fn, inputs, words, tolerance=1e-5, reports=2):
    """fn's outputs and the gradients of its float inputs, compiled against eager; no op named by
    `words` left to torch in the forward or the backward graph."""
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    eager_leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    got, want = _compiled(fn)(*leaves), fn(*eager_leaves)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    assert rel_err(got, want) < tolerance
    for leaf, eager_leaf in zip(leaves, eager_leaves):
        if leaf.requires_grad:
            assert rel_err(leaf.grad, eager_leaf.grad) < tolerance
    assert len(torch_backend.REPORTS) == reports
    assert _left_to_torch(words) == [], _left_to_torch(words)
    return got


# --- (1) hard activations ------------------------------------------------------------------------
@pytest.mark.parametrize("fn, words", [
    (F.hardswish, ["hardswish"]), (F.hardsigmoid, ["hardsigmoid"]),
    (F.hardtanh, ["hardtanh"]), (F.relu6, ["hardtanh"]),
    (lambda x: F.hardtanh(x, -0.5, 2.0), ["hardtanh"]),
], ids=["hardswish", "hardsigmoid", "hardtanh", "relu6", "hardtanh_bounds"])
def test_hard_activations_and_their_backwards_convert(fn, words):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7) * 4
    x.view(-1)[::9] = 3.0  # the kinks, where torch's backward picks a side
    x.view(-1)[4::9] = -3.0
    x.view(-1)[5::11] = 1.0
    _step_matches(lambda t: fn(t) * 1.5, [x], words)


def test_mobilenet_style_block_runs_in_one_graph_each_way():
    """conv, batch norm, hardswish, a squeeze-excite gate with hardsigmoid, relu6: every op of
    the step in dnngraph (no hard activation between graphs)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6),
                                torch.nn.Hardswish(), torch.nn.ReLU6(), torch.nn.Hardsigmoid())
    x = torch.randn(2, 3, 5, 6)
    got = _compiled(block)(x)
    assert rel_err(got, block(x)) < 1e-5
    assert all("hard" not in target for r in torch_backend.REPORTS for target, _ in r.torch_ops)


def test_hardtanh_of_integers_stays_in_torch_with_why():
    def f(x):
        return F.hardtanh(x, -2, 2)

    x = torch.arange(-5, 5, dtype=torch.int32).view(2, 5)
    assert torch.equal(_compiled(f)(x), f(x))
    (why,) = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "hardtanh" in target]
    assert "integers" in why


# --- (2) average pooling, ceil-mode max pooling with partial windows ----------------------------
@pytest.mark.parametrize("fn", [
    lambda x: F.avg_pool2d(x, 3, 2, 1),
    lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=True),
    lambda x: F.avg_pool2d(x, [3, 2], [2, 2], [1, 0], ceil_mode=True, count_include_pad=False),
    lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, divisor_override=5),
    lambda x: F.avg_pool1d(x.flatten(2), 3, 2, 1, ceil_mode=True),
    lambda x: F.avg_pool3d(x.unsqueeze(2).expand(-1, -1, 3, -1, -1), [2, 3, 2], 2, 1, ceil_mode=True,
                           count_include_pad=False),
], ids=["plain", "ceil_include_pad", "ceil_exclude_pad", "divisor", "ceil_divisor", "1d_ceil", "3d_ceil"])
def test_average_pools_and_their_backwards_convert(fn):
    torch.manual_seed(0)
    _step_matches(fn, [torch.randn(2, 3, 8, 7)], ["avg_pool"])


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("module", [torch.nn.MaxPool2d(2, 2, ceil_mode=True), torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                                    torch.nn.MaxPool2d([3, 2], [2, 3], [1, 0], ceil_mode=True)],
                         ids=["2x2", "3x3_pad", "rectangular"])
def test_ceil_mode_max_pool_with_partial_windows_converts(module, layout):
    """Partial last windows (8 and 7 are odd for these windows): torch's sizes, values and the
    indices the backward routes by, with ties and NaN; integer gradients compare exactly."""
    torch.manual_seed(0)
    x = torch.randint(-2, 3, (2, 3, 8, 7)).float()
    x.view(-1)[::13] = float("nan")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = _compiled(module)(leaf), module(eager_leaf)
    grad = torch.randint(1, 5, want.shape).float()
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(leaf.grad, eager_leaf.grad)
    assert _left_to_torch(["max_pool"]) == [], _left_to_torch(["max_pool"])


def test_average_pool_of_integers_stays_in_torch_with_why():
    def f(x):
        return torch.ops.aten.avg_pool2d(x, [2, 2])

    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.int64).view(2, 3, 4, 4)
    assert torch.equal(_compiled(f)(x), f(x))
    (why,) = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "avg_pool" in target]
    assert "integers" in why


# --- (3) cat and constant padding ----------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda x: F.pad(x, (1, 2)),
    lambda x: F.pad(x, (2, 1, 1, 3), value=-1.5),
    lambda x: F.pad(x, (-1, 2, 0, -2), value=0.25),  # negative pads crop
    lambda x: F.pad(x, (0, 0, 0, 0, 1, 1)),  # the first axis too
    lambda x: F.pad(x.transpose(1, 2) * 2, (1, 1, 1, 0)),  # a transposed value
    lambda x: F.pad(x, (3, -3)),
], ids=["last_axis", "two_axes_value", "crop_and_pad", "all_axes", "transposed", "crop_to_pad"])
def test_constant_pad_and_its_backward_convert(fn):
    torch.manual_seed(0)
    _step_matches(fn, [torch.randn(2, 5, 7)], ["constant_pad", "slice", "cat"])


@pytest.mark.parametrize("dtype,fill", [(torch.int32, 7), (torch.int64, -3), (torch.bool, True),
                                        (torch.float16, float("-inf")), (torch.float32, float("nan"))])
def test_constant_pad_of_every_type_and_special_fills(dtype, fill):
    def f(x):
        return F.pad(x, (1, 2, -1, 1), value=fill)

    x = (torch.randn(3, 4, 5) * 4).to(dtype)
    got, want = _compiled(f)(x), f(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    assert _left_to_torch(["constant_pad"]) == []


def test_constant_pad_with_a_fraction_for_integers_stays_in_torch():
    def f(x):
        return torch.ops.aten.constant_pad_nd(x, [1, 1], 0.5)

    x = torch.arange(6, dtype=torch.int32).view(2, 3)
    _compiled(f)(x)
    (why,) = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "constant_pad" in target]
    assert "fraction" in why


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.cat([a, b * 2], 1),
    lambda a, b: torch.cat([a.transpose(1, 2), b.transpose(1, 2).relu()], -1),
    lambda a, b: torch.cat([a, b, a], 0).tanh(),
], ids=["middle_axis", "transposed_parts", "three_parts"])
def test_cat_and_its_backward_convert(fn):
    torch.manual_seed(0)
    _step_matches(fn, [torch.randn(2, 3, 5), torch.randn(2, 3, 5)], ["cat", "slice", "split"])


def test_cat_of_mixed_types_and_integers_converts():
    def f(a, b, n):
        return torch.cat([a, b], 1), torch.cat([n, n + 1], 0)

    a, b, n = torch.randn(2, 3), torch.randn(2, 4).half(), torch.arange(6).view(2, 3)
    got, want = _compiled(f)(a, b, n), f(a, b, n)
    for mine, theirs in zip(got, want):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    assert _left_to_torch(["cat"]) == []


# --- (4) gathers: embedding, index_select, gather, indexing --------------------------------------
@pytest.mark.parametrize("fn, make_ids", [
    (lambda w, ids: F.embedding(ids, w) * 2.0, lambda: torch.randint(0, 11, (3, 4))),
    (lambda w, ids: F.embedding(ids, w, padding_idx=0), lambda: torch.randint(0, 11, (7,))),
    (lambda x, ids: x.index_select(1, ids), lambda: torch.randint(0, 6, (5,), dtype=torch.int32)),
    (lambda x, ids: torch.gather(x, 1, ids), lambda: torch.randint(0, 6, (11, 4))),
    (lambda x, ids: torch.gather(x, 0, ids), lambda: torch.randint(0, 11, (3, 2))),  # smaller off the axis
    (lambda x, ids: x[ids], lambda: torch.randint(-11, 11, (2, 3))),  # negative ids wrap
    (lambda x, ids: x[:, ids].tanh(), lambda: torch.randint(-6, 6, (4,))),
], ids=["embedding", "embedding_padding_idx", "index_select", "gather", "gather_smaller_index", "index",
        "index_second_axis"])
def test_gathers_and_their_scatter_add_backwards_convert(fn, make_ids):
    """The forward's gather and the backward's scatter-add (embedding_dense_backward, index_add,
    scatter_add, index_put with accumulate, into new_zeros) run in dnngraph, as eager computes."""
    torch.manual_seed(0)
    table, ids = torch.randn(11, 6), make_ids()
    leaf, eager_leaf = table.clone().requires_grad_(True), table.clone().requires_grad_(True)
    compiled = _compiled(fn)
    got, want = compiled(leaf, ids), fn(eager_leaf, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(leaf.grad, eager_leaf.grad)
    words = ("embedding", "index", "gather", "scatter", "new_zeros")
    assert _left_to_torch(words) == [], _left_to_torch(words)


def test_gather_of_integers_and_bools_converts():
    def f(x, mask, ids, rows):
        return torch.gather(x, 1, ids), mask.index_select(0, rows)

    x, mask = torch.arange(24).view(4, 6), torch.rand(4, 6) > 0.5
    ids, rows = torch.randint(0, 4, (4, 3)), torch.tensor([3, 0, 0, 2, 1])
    got, want = _compiled(f)(x, mask, ids, rows), f(x, mask, ids, rows)
    for mine, theirs in zip(got, want):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    assert torch_backend.REPORTS[-1].torch_ops == ()


def test_indexing_with_two_index_tensors_converts():
    """x[rows, cols]: one gather over the merged indexed axes (test_index_converter.py has the
    forms)."""
    def f(x, rows, cols):
        return x[rows, cols]

    x, rows, cols = torch.randn(5, 6), torch.tensor([0, 4]), torch.tensor([1, 5])
    assert torch.equal(_compiled(f)(x, rows, cols), f(x, rows, cols))
    assert _left_to_torch(["index"]) == []


@pytest.mark.parametrize("rows, scale_by_freq, why", [(2**20, False, "scatter kernel scans every id"),
                                                      (11, True, "scale_grad_by_freq")])
def test_embedding_backwards_the_scatter_kernel_does_not_take_stay_in_torch(rows, scale_by_freq, why):
    """A large table's gradient (the scan over every id per row block would be far slower than
    torch's sorting kernel) and scale_grad_by_freq stay in torch, saying why; the forward converts."""
    torch.manual_seed(0)
    table, ids = torch.randn(rows, 4), torch.randint(0, 11, (32,))
    fn = lambda w, i: F.embedding(i, w, scale_grad_by_freq=scale_by_freq)  # noqa: E731
    leaf, eager_leaf = table.clone().requires_grad_(True), table.clone().requires_grad_(True)
    got, want = _compiled(fn)(leaf, ids), fn(eager_leaf, ids)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(got, want) and torch.equal(leaf.grad, eager_leaf.grad)
    forward, backward = torch_backend.REPORTS
    assert not any("embedding" in target for target, _ in forward.torch_ops)
    (reason,) = [reason for target, reason in backward.torch_ops if "embedding" in target]
    assert why in reason


def test_scatter_add_and_index_add_into_a_base_convert():
    def f(base, src, ids, rows):
        return base.scatter_add(1, ids, src), base.index_add(0, rows, src[:2] * 1.0, alpha=2.0)

    torch.manual_seed(0)
    base, src = torch.randn(3, 5), torch.randn(3, 5)
    ids, rows = torch.randint(0, 5, (3, 4)), torch.tensor([2, 2])
    got, want = _compiled(f)(base, src, ids, rows), f(base, src, ids, rows)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)
    assert _left_to_torch(["scatter", "index_add"]) == []


# --- nll_loss --------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("use_weight", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_nll_loss_and_its_backward_convert(ignore_index, use_weight, reduction):
    """Losses with class weights and an ignored class (the default -100, and a class that
    occurs), unreduced, summed and averaged over the weights (a 0-d loss): forward and backward
    in dnngraph, values and gradients as eager's."""
    torch.manual_seed(0)
    targets = torch.tensor([1, 2, -100, 0, 4, 4, 2] if ignore_index == -100 else [1, 2, 2, 0, 4, 4, 3])
    weight = torch.rand(5) + 0.5 if use_weight else None

    def loss(scores):
        return F.nll_loss(scores.log_softmax(-1), targets, weight=weight, ignore_index=ignore_index,
                          reduction=reduction)

    got = _step_matches(loss, [torch.randn(7, 5)], ["nll_loss"])
    assert got.dim() == (1 if reduction == "none" else 0)


def test_cross_entropy_training_step_runs_in_dnngraph_each_way():
    """A classifier head and its mean cross entropy: every op of the step in dnngraph."""
    torch.manual_seed(1)
    head, targets = torch.nn.Linear(8, 9), torch.randint(0, 9, (6,))
    fn = lambda x: F.cross_entropy(head(x), targets)  # noqa: E731
    _step_matches(fn, [torch.randn(6, 8)], ["nll_loss", "log_softmax"])
    assert all(report.torch_ops == () for report in torch_backend.REPORTS), \
        [report.torch_ops for report in torch_backend.REPORTS]


def test_nll_loss_with_every_row_ignored_is_nan_as_torchs():
    targets = torch.tensor([-100, -100])
    fn = lambda x: F.nll_loss(x, targets)  # noqa: E731
    x = torch.randn(2, 3)
    got, want = _compiled(fn)(x), fn(x)
    assert torch.isnan(got) and torch.isnan(want) and got.dim() == 0
    assert _left_to_torch(["nll_loss"]) == []


# --- GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_bf16_mobilenet_block_and_classifier_step_run_in_dnngraph():
    """bf16 channels-last: conv, batch norm, hardswish, a hardsigmoid gate, ceil-mode average
    pooling, a padded conv, then an embedding-conditioned classifier and its cross entropy; every
    converted op family of this file in one training step on the GPU, against eager."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # no bias before batch norm (as MobileNet): its gradient is 0 in exact arithmetic, so
            # both sides' values are rounding noise that no relative error can judge
            self.conv = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
            self.norm = torch.nn.BatchNorm2d(16)
            self.embed = torch.nn.Embedding(10, 16)
            self.head = torch.nn.Linear(16, 7)

        def forward(self, x, labels, targets):
            y = F.hardswish(self.norm(self.conv(F.pad(x, (1, 1, 1, 1))[..., 1:-1, 1:-1])))
            y = y * F.hardsigmoid(y.mean((2, 3), keepdim=True))
            y = F.avg_pool2d(F.relu6(y), 3, 2, 1, ceil_mode=True).mean((2, 3)) + self.embed(labels)
            return F.cross_entropy(self.head(y), targets)

    model = Block().cuda().to(memory_format=torch.channels_last)
    # eager runs NCHW (weights too: a channels-last weight makes cuDNN's output channels-last):
    # torch 2.11's channels-last CUDA avg_pool2d backward with padding is wrong
    # (pytorch/pytorch#188344); dnngraph's matches torch's CPU kernel there
    eager = __import__("copy").deepcopy(model).to(memory_format=torch.contiguous_format)
    x = torch.randn(4, 16, 15, 15, device="cuda").to(memory_format=torch.channels_last)
    labels, targets = torch.randint(0, 10, (4,), device="cuda"), torch.randint(0, 7, (4,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _compiled(model)(x, labels, targets)
        want = eager(x.contiguous(), labels, targets)
    got.backward()
    want.backward()
    assert rel_err(got, want) < 3e-2
    for mine, theirs in zip(model.parameters(), eager.parameters()):
        assert rel_err(mine.grad, theirs.grad) < 5e-2
    words = ["hard", "avg_pool", "constant_pad", "embedding", "nll_loss"]
    assert _left_to_torch(words) == [], _left_to_torch(words)


def test_safe_softmax_zeroes_rows_that_see_only_minus_infinity():
    # torch's attention math on CUDA decomposes to _safe_softmax: a fully masked row is 0, not NaN
    x = torch.randn(3, 4, 7)
    x[1, 2] = float("-inf")
    x[0, 1, ::2] = float("-inf")
    x[2, 0, 3] = float("nan")
    fn = lambda t: torch.ops.aten._safe_softmax(t * 1.0, -1)  # noqa: E731
    got, want = _compiled(fn)(x), fn(x)
    assert torch.equal(got[1, 2], torch.zeros(7)) and not torch.isnan(got[1, 2]).any()
    torch.testing.assert_close(got, want, equal_nan=True)
    assert _left_to_torch(["softmax"]) == [], _left_to_torch(["softmax"])


def test_safe_softmax_tests_minus_infinity_before_its_dtype():
    # a row of finite values that overflow to -inf in the narrower dtype is NaN in torch, not 0
    x = torch.tensor([[-70000.0, -70000.0], [1.0, 2.0]])
    fn = lambda t: torch.ops.aten._safe_softmax(t * 1.0, -1, torch.float16)  # noqa: E731
    got, want = _compiled(fn)(x), fn(x)
    assert torch.isnan(want[0]).all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_cpu_results_in_a_gpu_program_stay_in_torch():
    # the support predicate reads devices from the traced values; on a hand-built FX graph, a meta
    # tensor stands in for a GPU value (this machine has no GPU)
    from dnngraph.torch_backend.convert import _off_the_program_device

    def program(tensor_device: str):
        graph = torch.fx.Graph()
        x, s = graph.placeholder("x"), graph.placeholder("s")
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (x, s))
        bumped = graph.call_function(torch.ops.aten.add.Tensor, (s, 1))
        graph.output((scaled, bumped))
        x.meta["val"], scaled.meta["val"] = torch.empty(3, device=tensor_device), torch.empty(3, device=tensor_device)
        s.meta["val"] = bumped.meta["val"] = torch.empty(())
        return scaled, bumped

    scaled, bumped = program("meta")
    assert _off_the_program_device(bumped, bumped.meta["val"]) == "a result on the CPU in a program on meta"
    assert _off_the_program_device(scaled, scaled.meta["val"]) is None
    scaled, bumped = program("cpu")  # all on the CPU: a CPU program
    assert _off_the_program_device(bumped, bumped.meta["val"]) is None


# --- constants, alias and bool masks: how transformers builds its attention masks ------------------
CONSTANT_WORDS = ("arange", "scalar_tensor", "zeros", "ones", "full", "new_", "bitwise", "alias")


def _causal_mask_attention(x, attention_mask):
    """Attention over x with the causal-and-padding mask built as transformers builds it: arange
    positions compared, a bool padding mask and-ed in, where() between 0 and the type's minimum."""
    batch, length = attention_mask.shape
    cache_position = torch.arange(length, device=x.device)
    kv_index = torch.arange(length, device=x.device)
    causal = kv_index[None, :] <= cache_position[:, None]
    allowed = causal[None, :, :] & attention_mask.bool()[:, None, :]
    allowed = allowed | torch.zeros_like(allowed)  # a no-op that still reads a *_like constant
    bias = torch.where(allowed[:, None], torch.scalar_tensor(0.0, device=x.device),
                       torch.scalar_tensor(torch.finfo(x.dtype).min, device=x.device))
    scores = x @ x.transpose(-1, -2) * x.new_ones(()) + bias
    return torch.softmax(scores, dim=-1) @ x


def test_causal_mask_building_converts_and_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 4)
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    got = _compiled(_causal_mask_attention)(x, attention_mask)
    torch.testing.assert_close(got, _causal_mask_attention(x, attention_mask), rtol=1e-5, atol=1e-6)
    assert _left_to_torch(CONSTANT_WORDS) == [], _left_to_torch(CONSTANT_WORDS)
    assert torch_backend.REPORTS[-1].torch_ops == ()


@pytest.mark.parametrize("fn", [
    lambda x: torch.arange(5),
    lambda x: torch.arange(0, 1, 0.125),
    lambda x: torch.arange(2, 11, 3, dtype=torch.int32),
    lambda x: torch.full((2, 3), 3),
    lambda x: torch.full((2, 3), True),
    lambda x: torch.zeros(4, dtype=torch.float16),
    lambda x: torch.ones_like(x, dtype=torch.int64),
    lambda x: torch.full_like(x.t(), -2.5),
    lambda x: x.new_full((3,), 7),
    lambda x: torch.scalar_tensor(2),
], ids=["arange_int", "arange_float", "arange_int32", "full_int", "full_bool", "zeros_half", "ones_like_int",
        "full_like_transposed", "new_full", "scalar_tensor"])
def test_constants_have_torchs_type_layout_and_values(fn):
    """Each constant as eager makes it (torch's dtype inference, the *_like layout), read in the
    graph (a clone) and returned itself, as memory of its own per call: a caller writing into one
    does not change the next call's."""
    def read_and_returned(x):
        made = fn(x)
        return made, made.clone()

    x = torch.randn(3, 5)
    compiled = _compiled(read_and_returned)
    got, want = compiled(x), read_and_returned(x)
    for mine, theirs in zip(got, want):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and mine.stride() == theirs.stride()
        assert torch.equal(mine, theirs)
    assert torch_backend.REPORTS[-1].torch_ops == ()
    got[0].fill_(1)
    again = compiled(x)
    assert again[0].data_ptr() != got[0].data_ptr() and torch.equal(again[0], want[0])


def test_a_constant_only_torch_reads_stays_in_torch():
    """No graph reads it: torch makes it, as eager does (a graph would only copy it out)."""
    def f(x, rows, cols):
        return x[torch.arange(2).cumsum(0) + rows, cols]  # cumsum stays in torch, and so its input

    x, rows, cols = torch.randn(5, 6), torch.tensor([0, 3]), torch.tensor([1, 5])
    assert torch.equal(_compiled(f)(x, rows, cols), f(x, rows, cols))
    (why,) = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "arange" in target]
    assert "only torch reads" in why


def test_a_constant_read_inside_the_graph_is_bound_not_computed():
    """arange and full_like read by a pointwise op: one kernel, the constants bound as inputs."""
    def f(x):
        return x * torch.arange(5) + torch.full_like(x, 0.5)

    x = torch.randn(3, 5)
    got = _compiled(f)(x)
    torch.testing.assert_close(got, f(x))
    assert torch_backend.REPORTS[-1].torch_ops == ()
    assert torch_backend.REPORTS[-1].kernels() == 1


def test_constants_are_made_at_conversion_not_on_the_first_call(monkeypatch):
    """Under mode="reduce-overhead" the first call is the cudagraph trees' warm-up, inside their
    memory pool: a constant kept from it is a tensor they refuse. Made at conversion instead."""
    seen = []
    forward = torch_backend.DnngraphModule.forward

    def checked(self, *args):
        seen.append(not self.constant_specs or self.constants is not None)
        return forward(self, *args)

    monkeypatch.setattr(torch_backend.DnngraphModule, "forward", checked)

    def f(x):
        return x * torch.arange(5) + torch.full_like(x, 0.5)

    x = torch.randn(3, 5)
    torch.testing.assert_close(_compiled(f)(x), f(x))
    assert seen and all(seen)


def test_bool_bitwise_ops_are_logical_ops_and_integer_ones_stay_in_torch():
    def bools(a, b):
        return a & b, a | b, a ^ b

    def integers(a, b):
        return a & b

    a, b = torch.rand(4, 5) < 0.5, torch.rand(1, 5) < 0.5
    for mine, theirs in zip(_compiled(bools)(a, b), bools(a, b)):
        assert mine.dtype == torch.bool and torch.equal(mine, theirs)
    assert torch_backend.REPORTS[-1].torch_ops == ()
    i, j = torch.randint(0, 16, (4, 5)), torch.randint(0, 16, (4, 5))
    assert torch.equal(_compiled(integers)(i, j), integers(i, j))
    (why,) = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "bitwise" in target]
    assert "bitwise integer" in why


# --- F.local_response_norm (issue 32): one LRN kernel in inference, the decomposition in training --
@pytest.mark.parametrize("shape,size", [((2, 7, 5, 6), 5), ((2, 7, 5), 4), ((1, 6, 2, 3, 4), 2), ((2, 3, 4, 4), 7)])
def test_local_response_norm_inference_is_one_lrn_kernel(shape, size):
    fn = lambda x: F.local_response_norm(torch.relu(x), size, 1e-2, 0.75, 2.0)
    x = torch.randn(shape)
    with torch.no_grad():
        got = _compiled(fn)(x)
    assert rel_err(got, fn(x.double())) < 1e-5
    (report,) = torch_backend.REPORTS
    assert report.torch_ops == () and report.kernels() == 1
    (function,) = report.functions
    assert [n.op for n in function._plain[0]._nodes] == ["relu", "lrn"]


def test_local_response_norm_trains_through_its_decomposition():
    fn = lambda x: F.local_response_norm(x * 1.5, 3, 1e-1, 0.75, 1.0)
    _step_matches(fn, [torch.randn(2, 5, 3, 4)], ["pool", "pow"])


def test_a_division_that_only_looks_like_lrn_stays_a_division():
    """The same chain with another pad (not torch's window) or read elsewhere is not an LRN."""
    def fn(x):
        sq = (x * x).unsqueeze(1)
        pooled = F.avg_pool2d(F.pad(sq, (0, 0, 1, 2)), (4, 1), stride=1).squeeze(1)
        return x / (pooled * 0.1 + 2.0) ** 0.75
    def along_the_wrong_axis(x):  # torch's 3D chain, with the window over L instead of C
        sq = (x * x).unsqueeze(2)
        pooled = F.avg_pool2d(F.pad(sq, (0, 0, 2, 2)), (5, 1), stride=1).squeeze(2)
        return x / (pooled * 0.1 + 2.0) ** 0.75

    for function in (fn, along_the_wrong_axis):
        x = torch.randn(2, 6, 5)
        with torch.no_grad():
            got = _compiled(function)(x)
        assert rel_err(got, function(x.double())) < 1e-5
        (made,) = torch_backend.REPORTS[0].functions
        assert "lrn" not in [n.op for n in made._plain[0]._nodes]


def test_an_alexnet_block_with_local_response_norm_matches_eager():
    """conv -> relu -> LocalResponseNorm -> max pool: inference (the LRN one kernel) and a
    training step (its decomposition), both against eager."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.LocalResponseNorm(5, 1e-2, 0.75, 2.0),
                                torch.nn.MaxPool2d(3, 2))
    x = torch.randn(2, 3, 11, 11)
    with torch.no_grad():
        got = _compiled(block)(x)
        assert rel_err(got, block(x)) < 1e-5
    (report,) = torch_backend.REPORTS
    assert "lrn" in [n.op for n in report.functions[0]._plain[0]._nodes] and report.torch_ops == ()
    _step_matches(block, [x], ["pool", "pow", "convolution"], tolerance=1e-4)
