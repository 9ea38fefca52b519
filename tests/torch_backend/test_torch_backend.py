"""torch.compile(model, backend="dnngraph"): forward and backward of small modules against eager
torch, with the partition each aten graph became (torch_backend.REPORTS); on the GPU, a bf16 Llama
decoder layer (transformers' where installed), a small channels-last CNN and attention in its
flash and math forms."""
import copy
import logging
import sys
from pathlib import Path

import pytest
import torch

from dnngraph import torch_backend
from helpers import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # llama_layer


def _compiled(module, **options):
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    return torch.compile(module, backend="dnngraph", fullgraph=True, dynamic=False, **options)


def _train_step_matches(model, make_inputs, tolerance=1e-5):
    """Outputs and every parameter and input gradient of one step, compiled against eager."""
    torch.manual_seed(0)
    inputs = make_inputs()
    compiled = _compiled(model)
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = compiled(*leaves)
    grad = torch.randn_like(out)
    out.backward(grad)
    compiled_grads = [p.grad.clone() for p in model.parameters()] + [x.grad for x in leaves if x.requires_grad]
    model.zero_grad()
    eager_leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    expected = model(*eager_leaves)
    expected.backward(grad)
    eager_grads = [p.grad for p in model.parameters()] + [x.grad for x in eager_leaves if x.requires_grad]
    assert rel_err(out, expected) < tolerance
    for got, want in zip(compiled_grads, eager_grads):
        assert rel_err(got, want) < tolerance


def test_mlp_forward_and_backward_run_in_dnngraph():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 7),
                                torch.nn.Softmax(-1))
    _train_step_matches(model, lambda: [torch.randn(5, 12)])
    forward, backward = torch_backend.REPORTS
    assert forward.torch_ops == () and backward.torch_ops == ()  # every aten op in dnngraph
    assert forward.graphs == 1 and backward.graphs == 1


class _Attention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        probs = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


def test_attention_module_forward_and_backward():
    torch.manual_seed(2)
    _train_step_matches(_Attention(), lambda: [torch.randn(2, 9, 16)])
    assert sum(r.dnngraph_ops for r in torch_backend.REPORTS) > 10


class _Sorted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h, _ = torch.sort(h, dim=-1)  # dnngraph has no sort: it runs in torch between two graphs
        return torch.tanh(self.b(h))


def test_an_op_dnngraph_lacks_runs_in_torch_between_graphs():
    torch.manual_seed(3)
    _train_step_matches(_Sorted(), lambda: [torch.randn(4, 6)])
    forward = torch_backend.REPORTS[0]
    assert forward.graphs == 2 and any("sort" in target for target, _ in forward.torch_ops)


def test_outputs_that_alias_inputs():
    def f(x, y):
        return x, x.view(-1), y.t(), torch.sigmoid(y) * 2.0

    compiled = _compiled(f)
    x, y = torch.randn(3, 4), torch.randn(5, 6)
    results = compiled(x, y)
    for got, want in zip(results, f(x, y)):
        assert torch.equal(got, want) or rel_err(got, want) < 1e-6
    x.add_(1.0)  # the aliases see the input's change, as eager's do
    assert torch.equal(results[0], x) and torch.equal(results[1], x.view(-1))


def test_detached_values_returned_and_read_inside():
    """detach of an argument and of a value the graph makes, returned and read by other ops:
    the returned ones are torch views of the argument and of the graph's output."""
    def f(x):
        made = torch.sigmoid(x)
        return x.detach(), made.detach(), made.detach().detach() * 3.0 + made

    compiled = _compiled(f)
    x = torch.randn(5, 7)
    results = compiled(x)
    for got, want in zip(results, f(x)):
        assert rel_err(got, want) < 1e-6
    assert results[0].data_ptr() == x.data_ptr()
    x.add_(1.0)
    assert torch.equal(results[0], x)


def test_clones_read_inside_are_values_and_returned_ones_are_copies():
    """A clone read inside the graph costs no kernel (exp(x).t().contiguous().view(-1): exp
    writes the transposed layout itself); a returned clone is memory of its own, as eager's."""
    def f(x):
        return x.clone(), torch.sigmoid(x).clone(), torch.exp(x).t().contiguous().view(-1) * 2.0

    compiled = _compiled(f)
    x = torch.randn(5, 7)
    results = compiled(x)
    for got, want in zip(results, f(x)):
        assert torch.equal(got, want) or rel_err(got, want) < 1e-6
    assert results[0].data_ptr() != x.data_ptr()
    before = results[0].clone()
    x.add_(1.0)
    assert torch.equal(results[0], before)  # the returned clone does not see the input change
    (report,) = torch_backend.REPORTS
    # x's copy, sigmoid and exp (written transposed straight into the contiguous view) read x:
    # siblings, one kernel; then the product
    assert report.kernels() == 2, report.kernels()


def test_a_clone_returned_through_views_is_a_copy():
    """x.clone().view(-1) returned: the clone is the graph's output (torch applies the view), so
    it is a copy even though its only user is a view; an input is never a graph output."""
    def f(x):
        return x.clone().view(-1), torch.exp(x).clone().t(), x.clone().t().reshape(-1)[2:]

    compiled = _compiled(f)
    x = torch.randn(3, 4)
    before, expected = x.clone(), f(x)
    results = compiled(x)
    for got, want in zip(results, expected):
        assert rel_err(got, want) < 1e-6
    assert all(r.data_ptr() != x.data_ptr() for r in results)
    x.add_(1.0)
    assert torch.equal(results[0], before.view(-1))


def test_a_full_range_slice_backward_returns_memory_of_its_own():
    """(x + 1)[0:4] of an x with 4 rows: the backward's slice_backward covers the whole gradient,
    so its value is the incoming gradient itself; returned, it must be a copy (an input is
    never a graph output), as eager's new tensor is."""
    def f(x):
        return (x + 1.0)[0:4]

    x = torch.randn(4, 3)
    leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(4, 3)
    _compiled(f)(leaf).backward(grad)
    f(eager_leaf).backward(grad)
    assert torch.equal(leaf.grad, eager_leaf.grad)
    assert leaf.grad.data_ptr() != grad.data_ptr()


def test_a_backward_of_views_only_runs():
    """(x.t() + 1).contiguous().view(-1): the backward is views of the incoming gradient only
    (view, t), every one applied in torch: a dnngraph graph with no ops must not fail to compile."""
    def f(x):
        return (x.t() + 1.0).contiguous().view(-1)

    x = torch.randn(4, 3)
    leaf, eager_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(12)
    out = _compiled(f)(leaf)
    out.backward(grad)
    f(eager_leaf).backward(grad)
    assert torch.equal(out, f(x))
    assert torch.equal(leaf.grad, eager_leaf.grad)


class _DetachedKeys(torch.nn.Module):
    """Attention whose keys are the queries detached: the backward's dk is read by nobody."""

    def __init__(self):
        super().__init__()
        self.qv, self.out = torch.nn.Linear(16, 32), torch.nn.Linear(16, 16)

    def forward(self, x):
        b, s, d = x.shape
        q, v = self.qv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        attended = torch.nn.functional.scaled_dot_product_attention(q, q.detach(), v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(b, s, d))


def test_attention_with_detached_keys_trains():
    torch.manual_seed(5)
    _train_step_matches(_DetachedKeys(), lambda: [torch.randn(2, 5, 16)], tolerance=1e-4)


def test_no_grad_inference_and_a_cnn_with_torch_convolutions():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 5 * 5, 10), torch.nn.LogSoftmax(-1))
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        got = _compiled(model)(x)
        want = model(x)
    assert rel_err(got, want) < 1e-5
    assert torch_backend.REPORTS[-1].dnngraph_ops > 0
    _train_step_matches(model, lambda: [torch.randn(2, 3, 5, 5)])


def test_a_new_shape_recompiles_and_stays_right():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())
    compiled = _compiled(model)
    for rows in (3, 7):
        x = torch.randn(rows, 4)
        with torch.no_grad():
            assert rel_err(compiled(x), model(x)) < 1e-5
    assert len(torch_backend.REPORTS) == 2


class _Mixed(torch.nn.Module):
    """layer norm, unsqueeze / slice / squeeze, expand and a convolution with bias."""

    def __init__(self):
        super().__init__()
        self.norm, self.conv = torch.nn.LayerNorm(8), torch.nn.Conv2d(2, 4, 3, padding=1, stride=2)

    def forward(self, x, image):
        y = self.norm(x).unsqueeze(1)[:, :, 1:7:2].squeeze(1)
        z = self.conv(image).flatten(1)
        return torch.cat([y * 2.0, z[:, :3], x[:, None, :3].expand(3, 2, 3).sum(1)], dim=1)


def test_norms_convolutions_views_and_expand():
    torch.manual_seed(6)
    _train_step_matches(_Mixed(), lambda: [torch.randn(3, 8), torch.randn(3, 2, 5, 5)])
    forward, backward = torch_backend.REPORTS
    assert forward.torch_ops == (), forward.torch_ops
    assert all("convolution" not in target and "layer_norm" not in target for target, _ in backward.torch_ops), \
        backward.torch_ops


class _SdpaBlock(torch.nn.Module):
    def __init__(self, dim=32, heads=2, causal=True):
        super().__init__()
        self.qkv, self.out, self.heads, self.causal = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads, causal

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention_becomes_sdpa(causal):
    torch.manual_seed(7)
    _train_step_matches(_SdpaBlock(causal=causal), lambda: [torch.randn(2, 19, 32)])
    forward, backward = torch_backend.REPORTS
    assert forward.torch_ops == () and backward.torch_ops == (), (forward.torch_ops, backward.torch_ops)


def test_llama_style_decoder_layer_forward_and_backward():
    """RMSNorm, RoPE (slices, cat, neg), grouped-query attention through expand and sdpa, SwiGLU:
    every op in dnngraph graphs, forward and backward."""
    torch.manual_seed(8)
    _train_step_matches(_decoder_layer(torch.float32, hidden=32), lambda: [torch.randn(2, 12, 32)], tolerance=2e-5)
    forward_report, backward_report = torch_backend.REPORTS
    # the rotary tables' arange and pow of a scalar base are made in torch; everything else converts
    assert {target for target, _ in forward_report.torch_ops} <= {"aten.arange.start_step", "aten.arange.default",
                                                                  "aten.pow.Scalar"}, forward_report.torch_ops
    assert backward_report.torch_ops == (), backward_report.torch_ops


def test_llama_style_decode_step_against_a_cache():
    """One token against a KV cache (cat, grouped-query attention with the query heads of a KV
    head as its rows): every op but the rotary angles in dnngraph, the output as eager's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from llama_layer import decode_step, make_layer

    torch.manual_seed(9)
    layer, _, _ = make_layer(32, 4, 2, 64, torch.float32, "cpu", use_transformers=False)
    token, k_cache, v_cache = torch.randn(1, 1, 32), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    with torch.no_grad():
        expected = decode_step(layer, token, k_cache, v_cache)
        got = _compiled(decode_step)(layer, token, k_cache, v_cache)
    assert rel_err(got, expected) < 2e-5
    (report,) = torch_backend.REPORTS
    # the rotary angles' arange and pow of a scalar base are made in torch; everything else converts
    assert {target for target, _ in report.torch_ops} <= {"aten.arange.start_step", "aten.pow.Scalar"}, report.torch_ops


class _Residual(torch.nn.Module):
    """conv -> batch norm -> relu -> conv -> batch norm + identity -> relu -> pool -> linear."""

    def __init__(self, channels=4):
        super().__init__()
        self.c1, self.c2 = (torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False) for _ in range(2))
        self.b1, self.b2 = torch.nn.BatchNorm2d(channels), torch.nn.BatchNorm2d(channels)
        self.head = torch.nn.Linear(channels, 3)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)) + x)
        return self.head(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def test_batch_norm_residual_block_training_and_running_statistics():
    torch.manual_seed(9)
    model = _Residual()
    _train_step_matches(copy.deepcopy(model), lambda: [torch.randn(3, 4, 6, 6)])
    assert all("batch_norm" not in t for r in torch_backend.REPORTS for t, _ in r.torch_ops)
    eager, x = copy.deepcopy(model), torch.randn(3, 4, 6, 6)
    _compiled(model)(x)  # one training step's forward each: the running statistics move alike
    eager(x)
    for ours, theirs in ((model.b1, eager.b1), (model.b2, eager.b2)):
        assert ours.num_batches_tracked.item() == theirs.num_batches_tracked.item() == 1
        assert rel_err(ours.running_mean, theirs.running_mean) < 1e-5
        assert rel_err(ours.running_var, theirs.running_var) < 1e-5


def test_relu_backward_reads_the_saved_activation_where_its_mask_is_used(monkeypatch):
    """AOTAutograd saves relu's output through detach (a view in torch): its value is the saved
    tensor itself, so no kernel copies an activation and each ReLU backward's cmp_le(x, 0) mask
    is computed in the kernel taking it (a convolution's dgrad, the pooling backward)."""
    modules = _recorded_modules(monkeypatch)
    torch.manual_seed(9)
    _train_step_matches(_Residual().to(memory_format=torch.channels_last),
                        lambda: [torch.randn(3, 4, 6, 6).to(memory_format=torch.channels_last)])
    groups = _built_groups(modules)
    copies = [g.describe() for g in groups if all(n.op == "cast" for n in g.nodes)]
    assert copies == []
    masks = [g for g in groups if any(n.op == "cmp_le" for n in g.nodes)]
    assert masks and all(g.kind != "pointwise" or len(g.nodes) > 1 for g in masks), [g.describe() for g in masks]


def test_batch_norm_inference_form():
    torch.manual_seed(10)
    model = _Residual()
    model(torch.randn(5, 4, 6, 6))  # running statistics away from their start
    model.eval()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        assert rel_err(_compiled(model)(x), model(x)) < 1e-5
    (report,) = torch_backend.REPORTS
    assert all("batch_norm" not in t for t, _ in report.torch_ops)
    # each conv -> batch norm (-> + identity) -> relu is one kernel, the norm in the conv's epilogue;
    # with the two per-channel scales (weight / sqrt(var + eps)), the pooling and the linear: 6
    assert report.kernels() == 6, report.kernels()


def test_batch_norm_inference_without_affine_parameters():
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3, bias=False), torch.nn.BatchNorm2d(5, affine=False),
                                torch.nn.ReLU())
    model(torch.randn(4, 3, 7, 7))
    model.eval()
    x = torch.randn(2, 3, 7, 9)
    with torch.no_grad():
        assert rel_err(_compiled(model)(x), model(x)) < 1e-5
    assert torch_backend.REPORTS[-1].kernels() == 2  # the scale [C], then conv + norm + relu


class _MaskedAttention(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(self.proj(q), k, v, attn_mask=self.mask)
        return torch.tanh(o)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_masks_become_the_sdpa_bias(kind):
    torch.manual_seed(11)
    keep = torch.rand(1, 2, 9, 13) > 0.3
    keep[..., 0] = True  # every row sees a key
    mask = keep if kind == "bool" else torch.randn(9, 13)
    _train_step_matches(_MaskedAttention(mask), lambda: [torch.randn(2, 2, 9, 16), torch.randn(2, 2, 13, 16),
                                                        torch.randn(2, 2, 13, 16)])
    assert all("attention" not in t for r in torch_backend.REPORTS for t, _ in r.torch_ops)


def test_dropout_keeps_its_mask_through_the_backward():
    """Training dropout: dnngraph's Philox with a seed from torch's generator per call. Kept
    values are scaled by 1/(1-p), the backward uses the forward's mask, the fraction kept is
    near 1-p, and torch.manual_seed repeats a run."""
    def f(x):
        return torch.nn.functional.dropout(x * 2.0, p=0.3, training=True)

    compiled = _compiled(f)
    x = torch.randn(64, 257).abs() + 0.1  # no zeros of its own
    runs = []
    for _ in range(2):
        torch.manual_seed(12)
        leaf = x.clone().requires_grad_()
        y = compiled(leaf)
        y.backward(torch.ones_like(y))
        runs.append((y.detach(), leaf.grad))
    (y, grad), (y_again, grad_again) = runs
    assert torch.equal(y, y_again) and torch.equal(grad, grad_again)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.02
    assert torch.allclose(y[kept], (x * 2.0 / 0.7)[kept], rtol=1e-6)
    assert torch.equal(grad != 0, kept) and torch.allclose(grad[kept], torch.full_like(grad[kept], 2.0 / 0.7))
    assert all("dropout" not in t for r in torch_backend.REPORTS for t, _ in r.torch_ops)


def _built_groups(modules) -> list:
    """The kernel groups of every dnngraph graph the modules ran (AOTAutograd runs them without
    autograd: the plain graph of each function)."""
    return [group for module in modules for group in module.function._plain_graph()[0].plan.groups]


def _lone_casts(groups) -> list:
    """Groups that only move values into a graph output (layout copies) or only change a float
    type: work that belongs in the kernel making the value. The attention log-sum-exp is the
    exception: torch's CPU form lays it out [B, S, H], not as the sdpa kernel writes it."""
    lone = []
    for group in groups:
        if group.kind == "copy":
            made_by = group.origin.inputs[0].producer
            if any(t.is_output for t in group.outputs) and (made_by is None or made_by.op != "sdpa"):
                lone.append(group.describe())
        elif all(n.op == "cast" and n.inputs[0].data_type.is_floating
                 and n.inputs[0].data_type != n.outputs[0].data_type for n in group.nodes):
            lone.append(group.describe())
    return lone


def _decoder_layer(dtype, hidden=64):
    """The equivalent Llama decoder layer (4 heads, 2 KV heads, MLP 2 x hidden) as a module of x."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from llama_layer import make_layer

    layer, forward, _ = make_layer(hidden, 4, 2, 2 * hidden, dtype, "cpu", use_transformers=False)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return forward(self.layer, x)
    return Wrapped()


def _recorded_modules(monkeypatch) -> list:
    """The list every DnngraphModule made from now on is appended to."""
    modules = []
    original = torch_backend.DnngraphModule.__init__

    def recording(self, sub, options=None):
        original(self, sub, options)
        modules.append(self)
    monkeypatch.setattr(torch_backend.DnngraphModule, "__init__", recording)
    return modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_kernels_have_no_lone_casts_or_output_copies(dtype, monkeypatch):
    """The tiny decoder layer's forward and backward: views of arguments and of values the graph
    makes are returned as torch views, reshapes into outputs are written in place, casts ride
    the kernels around them; fp32 matches eager (the interpreter's bf16 dot is not exact: bf16
    checks structure only)."""
    modules = _recorded_modules(monkeypatch)
    torch.manual_seed(13)
    if dtype == torch.float32:
        _train_step_matches(_decoder_layer(dtype), lambda: [torch.randn(2, 16, 64)], tolerance=2e-5)
    else:
        compiled = _compiled(_decoder_layer(dtype))
        x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
        out = compiled(x)
        out.backward(torch.randn_like(out))
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    forward_report, backward_report = torch_backend.REPORTS
    assert backward_report.torch_ops == () and backward_report.graphs == 1  # its casts convert
    assert _lone_casts(_built_groups(modules)) == []


def test_batch_norm_block_statistics_casts_join_the_norm_kernels(monkeypatch):
    """bf16 channels-last conv -> batch norm (training) -> relu: the running statistics' casts
    (AOTAutograd's _to_copy) and every reshape of a per-channel result ride the norm kernels."""
    modules = _recorded_modules(monkeypatch)
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU()).to(dtype=torch.bfloat16, memory_format=torch.channels_last)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 8, 6, 6, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    leaf = x.clone().requires_grad_()
    out = _compiled(model)(leaf)
    out.backward(torch.ones_like(out))
    assert all(r.torch_ops == () or all("_to_copy" not in t for t, _ in r.torch_ops) for r in torch_backend.REPORTS)
    groups = _built_groups(modules)
    # the one pointwise kernel is num_batches_tracked + 1 (a 0-d int64 buffer, once left to torch)
    counters = [g for g in groups if g.kind == "pointwise" and [t.dim for t in g.outputs] == [(1,)]
                and g.outputs[0].data_type.name == "int64"]
    assert len(counters) == 1
    groups = [g for g in groups if g not in counters]
    assert _lone_casts(groups) == [] and not any(g.kind in ("copy", "pointwise") for g in groups)
    assert sorted(g.kind for g in groups) == ["conv", "conv", "conv", "norm", "norm"]
    eager(x)  # running statistics (bf16 buffers) move alike
    assert rel_err(model[1].running_mean, eager[1].running_mean) < 1e-2
    assert rel_err(model[1].running_var, eager[1].running_var) < 1e-2


# --- max pooling ---------------------------------------------------------------------------------
def _pool_input(dtype, layout, seed=11):
    """[2, 5, 9, 7] of integer values (ties everywhere, zeros after a ReLU), NaN, inf and -inf."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (2, 5, 9, 7), generator=generator).float()
    x[0, 1, 4, 4] = x[0, 1, 4, 5] = x[1, 3, 8, 6] = float("nan")  # two NaNs share windows
    x[1, 2, 2, 2] = float("inf")
    x[0, 4, :3, :3] = float("-inf")  # a corner window of -inf only
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def _same(got, want) -> bool:
    return got.dtype == want.dtype and torch.equal(got.float().nan_to_num(), want.float().nan_to_num()) \
        and torch.equal(got.isnan(), want.isnan())


def _no_max_pool(report) -> bool:
    return not any("max_pool" in target for target, _ in report.torch_ops)


class _Stem(torch.nn.Module):
    """ResNet's stem tail: conv, ReLU, 3x3 stride-2 max pool with padding 1, then a 1x1 conv."""

    def __init__(self, relu_first=True):
        super().__init__()
        self.conv, self.pool, self.head = torch.nn.Conv2d(5, 5, 1), torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(5, 3, 1)
        self.relu_first = relu_first

    def forward(self, x):
        return self.head(self.pool(torch.relu(x) if self.relu_first else x) + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_max_pool_inference_runs_in_the_dnngraph_graph(layout, dtype):
    pool = torch.nn.MaxPool2d(3, 2, 1)
    x = _pool_input(dtype, layout)
    with torch.no_grad():
        got = _compiled(pool)(x)
    assert _same(got, pool(x))
    report = torch_backend.REPORTS[-1]
    assert report.torch_ops == () and report.graphs == 1 and report.kernels() == 1
    model = _Stem().to(dtype).to(memory_format=torch.channels_last if layout == "channels_last" else
                                 torch.contiguous_format)
    x = x.nan_to_num(nan=1.0, posinf=3.0)  # finite through the convolutions
    with torch.no_grad():
        got = _compiled(model)(x)
        want = model(x)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)
    report = torch_backend.REPORTS[-1]
    assert _no_max_pool(report) and report.graphs == 1, report.torch_ops  # one partition, not two


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("relu_first", [True, False])
def test_max_pool_training_gradients_route_as_eager(relu_first, layout, dtype):
    """Forward values and input gradients equal to eager's (integer gradients: exact sums) on
    inputs full of ties, NaN, inf and -inf; the forward pool and its backward run in dnngraph."""
    pool = torch.nn.MaxPool2d(3, 2, 1)
    module = torch.nn.Sequential(torch.nn.ReLU(), pool) if relu_first else pool
    x = _pool_input(dtype, layout)
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got = _compiled(module)(leaf)
    want = module(eager_leaf)
    assert _same(got, want)
    grad = torch.randint(1, 5, want.shape).to(dtype)
    got.backward(grad)
    want.backward(grad)
    assert _same(leaf.grad, eager_leaf.grad)
    forward, backward = torch_backend.REPORTS
    assert _no_max_pool(forward) and _no_max_pool(backward), (forward.torch_ops, backward.torch_ops)
    assert forward.graphs == 1 and backward.graphs == 1 and backward.kernels() >= 1


def _assert_pool_step_as_eager(module, x):
    """Compiled and eager forward and backward of `module` on x agree exactly (integer gradients)."""
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = _compiled(module)(leaf), module(eager_leaf)
    grad = torch.randint(1, 5, want.shape).float()
    got.backward(grad)
    want.backward(grad)
    assert _same(got, want) and _same(leaf.grad, eager_leaf.grad)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_max_pool_backward_reads_the_saved_indices_with_the_relu_mask_fused(layout):
    """The training backward routes dy by the indices the forward saved (no argmax recompute from
    x) and its ReLU mask (aten's threshold_backward, a where) rides the pooling kernel."""
    module = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    x = _pool_input(torch.float32, layout, seed=5)
    _assert_pool_step_as_eager(module, x)
    backward = torch_backend.REPORTS[-1]
    plans = [f._plain[0].plan for f in backward.functions if f._plain is not None]
    pooling = [launch for plan in plans for launch in plan.launches if launch.group.kind == "pooling"]
    assert len(pooling) == 1 and "argmax=indices" in pooling[0].config_text
    assert sorted(node.op for node in pooling[0].group.nodes) == ["cmp_le", "pooling_backward", "where"]
    assert pooling[0].group.anchor.inputs[2] is not None


def test_max_pool_indices_a_program_returns_are_torchs():
    def f(x):
        return torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)

    x = _pool_input(torch.float32, "channels_last")
    with torch.no_grad():
        (values, indices), (want_values, want_indices) = _compiled(f)(x), f(x)
    assert _same(values, want_values) and torch.equal(indices, want_indices)
    assert torch_backend.REPORTS[-1].torch_ops == ()


@pytest.mark.parametrize("module,shape", [(torch.nn.MaxPool1d(3, 2, 1), (2, 5, 13)),
                                          (torch.nn.MaxPool3d((3, 2, 3), (2, 1, 2), 1), (2, 3, 5, 7, 6)),
                                          (torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 5, 9, 7))])
def test_max_pool_1d_3d_and_ceil_mode_without_a_partial_window(module, shape):
    x = torch.randint(-2, 3, shape).float()
    x.view(-1)[::17] = float("nan")
    _assert_pool_step_as_eager(module, x)
    assert all(_no_max_pool(report) for report in torch_backend.REPORTS)


@pytest.mark.parametrize("module,why", [(torch.nn.MaxPool2d(3, 2, 1, dilation=2), "dilation")])
def test_max_pool_dnngraph_cannot_compute_stays_in_torch_with_why(module, why):
    x = torch.randn(2, 5, 9, 7)
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got, want = _compiled(module)(leaf), module(eager_leaf)
    got.backward(torch.ones_like(got))
    want.backward(torch.ones_like(want))
    assert torch.equal(got, want) and torch.equal(leaf.grad, eager_leaf.grad)
    for report in torch_backend.REPORTS:  # the forward and the backward each keep it, saying why
        reasons = [reason for target, reason in report.torch_ops if "max_pool" in target]
        assert len(reasons) == 1 and why in reasons[0], report.torch_ops


def test_max_pool_backward_with_indices_from_elsewhere_stays_in_torch():
    """dnngraph routes by indices only within their windows (torch routes any index): exact only
    for indices the pool of x made."""
    def f(grad, x, indices):
        return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, [3, 3], [2, 2], [1, 1], [1, 1], False,
                                                               indices)

    x, grad = torch.randn(2, 5, 9, 7), torch.randn(2, 5, 5, 4)
    indices = torch.zeros(2, 5, 5, 4, dtype=torch.int64)  # every window's gradient to element 0
    assert torch.equal(_compiled(f)(grad, x, indices), f(grad, x, indices))
    reasons = [reason for target, reason in torch_backend.REPORTS[-1].torch_ops if "max_pool" in target]
    assert reasons and "indices not made by the max pool" in reasons[0]


def test_relu_backward_passes_the_gradient_of_nan_as_aten_does():
    x = torch.tensor([[float("nan"), -1.0, 0.0, 2.0]])
    leaf, eager_leaf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    _compiled(torch.nn.ReLU())(leaf).backward(torch.full((1, 4), 3.0))
    torch.relu(eager_leaf).backward(torch.full((1, 4), 3.0))
    assert torch.equal(leaf.grad, eager_leaf.grad) and leaf.grad[0, 0] == 3.0


@pytest.mark.parametrize("mode, options, error", [
    ("max-autotune", None, ValueError), (None, {"cudagraph": True}, ValueError), (None, {"cudagraphs": 1}, TypeError)])
def test_backend_mode_and_options_are_checked(mode, options, error):
    with pytest.raises(error):
        torch_backend.backend(None, [], mode=mode, options=options)


def test_reduce_overhead_on_cpu_tensors_runs_without_replay_and_says_why(caplog):
    """CUDA-graph replay needs CUDA tensors: a CPU model compiled with mode="reduce-overhead"
    runs as in the default mode, forward and backward, and the log says why."""
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Tanh())
    x = torch.randn(5, 12)
    want = model(x)
    want.sum().backward()
    want_grad = model[0].weight.grad.clone()
    model.zero_grad()
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="dnngraph"):
        got = torch.compile(model, backend="dnngraph", dynamic=False, mode="reduce-overhead")(x)
        got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model[0].weight.grad, want_grad)
    assert any("no CUDA-graph replay" in r.getMessage() and "cpu" in r.getMessage() for r in caplog.records)


class _SwiGLUResidual(torch.nn.Module):
    """x + down(silu(gate(x)) * up(x)): Linears on [batch, seq, hidden] (views around aten.mm)."""

    def __init__(self, hidden=16, inner=24):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inner, bias=False)
        self.up = torch.nn.Linear(hidden, inner, bias=True)
        self.down = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _groups_of(report) -> list:
    return [g for f in report.functions for g in f._plain[0].plan.groups]


@pytest.mark.parametrize("batch", [1, 3])
def test_ops_after_a_linear_join_its_matmul_through_the_views(batch, monkeypatch):
    """A Linear on [batch, seq, hidden] is view -> mm -> view in aten: the product is computed on
    the unflattened input, so SwiGLU's product and the residual add are the matmuls' epilogues,
    the batches fold into one GEMM's rows, and the mm results the backward saves are written in
    place (no copy kernels); forward and backward match eager."""
    _train_step_matches(_SwiGLUResidual(), lambda: [torch.randn(batch, 7, 16)])
    forward, backward = torch_backend.REPORTS
    groups = _groups_of(forward)
    assert [g.kind for g in groups] == ["matmul"] * 3, [g.describe() for g in groups]
    epilogues = sorted(tuple(n.op for n in g.epilogue) for g in groups)
    assert ("add",) in epilogues and any("mul" in ops for ops in epilogues), epilogues
    for function in forward.functions:
        for launch in function._plain[0].plan.launches:
            assert "batch 1 x " in launch.reason, launch.reason  # the batches folded into rows
    assert all(g.kind != "copy" for g in _groups_of(backward)), [g.describe() for g in _groups_of(backward)]


@pytest.mark.parametrize("x_shape,bias_shape", [([3, 5, 7], [15, 9]), ([3, 5, 7], [15, 1]), ([5, 1, 7], [5, 9]),
                                                ([3, 5, 7], [1, 9]), ([3, 5, 7], [9])])
def test_addmm_of_a_flattened_input_with_a_bias_per_row(x_shape, bias_shape):
    """torch.addmm(bias, x.view(-1, K), w) with a bias of M rows: the product is computed on x
    [..., N], so the bias must be seen with x's leading axes too (not broadcast against them)."""
    torch.manual_seed(0)
    w, bias = torch.randn(7, 9), torch.randn(bias_shape)

    def f(x):
        return torch.addmm(bias, x.reshape(-1, 7), w)

    x = torch.randn(x_shape)
    got = _compiled(f)(x)
    torch.testing.assert_close(got, f(x))
    assert all(report.torch_ops == () for report in torch_backend.REPORTS)


# --- on the GPU: a bf16 Llama decoder layer, a channels-last CNN, attention forms ----------------
def _step(module, forward, x):
    x = x.clone().requires_grad_()
    out = forward(module, x)
    grad = torch.randn_like(out)
    out.backward(grad)
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    module.zero_grad()
    return out.detach(), grads


@pytest.mark.gpu
def test_bf16_llama_decoder_layer_matches_eager():
    from llama_layer import make_layer

    torch.manual_seed(0)
    layer, forward, _ = make_layer(256, 4, 2, 512, torch.bfloat16, "cuda")
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1)
    want, want_grads = _step(layer, forward, x)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    compiled = torch.compile(lambda m, h: forward(m, h), backend="dnngraph", dynamic=False)
    torch.manual_seed(1)
    got, got_grads = _step(layer, compiled, x)
    assert rel_err(got, want) < 2e-2
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 3e-2
    kept = [t for r in torch_backend.REPORTS for t, _ in r.torch_ops]
    assert not [t for t in kept if "mm" in t or "attention" in t or "rsqrt" in t], kept


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
def test_bf16_channels_last_cnn_is_as_close_to_float64_as_eager(norm):
    """A bf16 channels-last CNN (with batch norms in training form): dnngraph's outputs and
    gradients are no further from the float64 computation than eager torch's (cuDNN), within a
    small allowance."""
    torch.manual_seed(2)
    layers = [torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Conv2d(32, 32, 3, padding=1, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10)]
    model = torch.nn.Sequential(*[layer for layer in layers if norm or not isinstance(layer, torch.nn.BatchNorm2d)])
    model = model.to(device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
    exact = copy.deepcopy(model).double()
    x = torch.randn(8, 16, 16, 16, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    torch.manual_seed(3)
    grad = torch.randn(8, 10, device="cuda", dtype=torch.bfloat16)

    def step(module, fn, value, g):
        value = value.clone().requires_grad_()
        out = fn(value)
        out.backward(g)
        grads = [p.grad.clone() for p in module.parameters()] + [value.grad.clone()]
        module.zero_grad()
        return [out.detach()] + grads

    reference = step(exact, exact, x.double(), grad.double())
    eager = step(model, model, x, grad)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dnngraph", dynamic=False)
    ours = step(model, compiled, x, grad)
    for mine, theirs, truth in zip(ours, eager, reference):
        assert rel_err(mine, truth) <= 2 * rel_err(theirs, truth) + 1e-2, (rel_err(mine, truth), rel_err(theirs, truth))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_bf16_attention_through_flash_or_math_forms(masked):
    """F.scaled_dot_product_attention traced as torch's flash form (no mask: sdpa) or its math
    decomposition (a mask: an op-level chain), forward and backward, against eager in bf16."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 77, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = (torch.rand(77, 77, device="cuda") > 0.2) | torch.eye(77, dtype=torch.bool, device="cuda") if masked else None

    def attend(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=not masked) * 2.0

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    want = step(attend)
    torch._dynamo.reset()
    torch_backend.REPORTS.clear()
    got = step(torch.compile(attend, backend="dnngraph", dynamic=False))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 2e-2
    kept = [t for r in torch_backend.REPORTS for t, _ in r.torch_ops]
    assert not [t for t in kept if "attention" in t], kept
