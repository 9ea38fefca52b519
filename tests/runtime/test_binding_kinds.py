"""Kinds of torch tensors kernels cannot read as raw strided memory, on every entry point: execute
(its first, checking call and its fast path over a binding set checked before), as_function
(eager, its autograd forward and backward, its torch.library ops as torch.compile runs them) and
the torch.compile backend. A lazily negated input (torch's negative bit) is resolved; a negated
output, a conjugate view, sparse, mkldnn, nested and meta tensors raise ExecutionError and
nothing is written. On the GPU (marked gpu): lazily negated inputs on the fast path (never bound
by address) and negated outputs refused."""
import warnings

import pytest
import torch

import dnngraph as dg
from helpers import poisoned, rel_err

GEN = torch.Generator().manual_seed(26)
ROWS, COLS = 4, 6


def _randn(*dims, device="cpu"):
    return torch.randn(*dims, generator=GEN).to(device)


def _negated(rows=ROWS, cols=COLS):
    """A lazily negated float32 view (stride 2 over a complex tensor's imaginary parts) and the
    values it holds."""
    z = torch.complex(_randn(rows, cols), _randn(rows, cols))
    view = z.conj().imag
    assert view.is_neg() and view.stride() == (2 * cols, 2)
    return view, -z.imag.clone()


def _quiet(make):
    def made():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse CSR and nested tensors warn that they are beta
            return make()
    return made


# every kind of tensor no binding accepts, as a [ROWS, COLS] float32 value where torch has one
UNBINDABLE = {
    "conjugate": _quiet(lambda: torch.complex(_randn(ROWS, COLS), _randn(ROWS, COLS)).conj()),
    "sparse_coo": _quiet(lambda: _randn(ROWS, COLS).to_sparse()),
    "sparse_csr": _quiet(lambda: _randn(ROWS, COLS).to_sparse_csr()),
    "sparse_csc": _quiet(lambda: _randn(ROWS, COLS).to_sparse_csc()),
    "sparse_bsr": _quiet(lambda: _randn(ROWS, COLS).to_sparse_bsr((2, 2))),
    "mkldnn": _quiet(lambda: _randn(ROWS, COLS).to_mkldnn()),
    "nested": _quiet(lambda: torch.nested.nested_tensor([_randn(COLS) for _ in range(ROWS)])),
    "nested_jagged": _quiet(lambda: torch.nested.nested_tensor([_randn(COLS) for _ in range(ROWS)],
                                                               layout=torch.jagged)),
    "meta": lambda: torch.empty(ROWS, COLS, device="meta"),
}
REASONS = {"conjugate": "conjugate", "mkldnn": "layout", "nested": "nested", "nested_jagged": "nested"}


def _refusal(kind, role, name):
    """The pattern of the error refusing `kind` bound as `role` `name` (a meta tensor is refused
    by the device check, which names the tensors on each device)."""
    if kind == "meta":
        return f"'{name}' is on meta|'{name}' on meta"
    return f"{role} '{name}' is .*{REASONS.get(kind, 'layout')}"


def _graph(x_stride=None, y_stride=None):
    """y = x * w, built; x [ROWS, COLS] (strides `x_stride`), w [1, COLS], y (`y_stride`)."""
    g = dg.Graph(name="kinds")
    x = g.tensor(name="x", dim=[ROWS, COLS], stride=x_stride)
    w = g.tensor(name="w", dim=[1, COLS])
    y = g.mul(x, w).set_output(True).set_name("y")
    if y_stride is not None:
        y.set_stride(y_stride)
    return g.build(), x, w, y


def _plain_twin(view):
    """A tensor without the negative bit over the same memory, shape and strides as `view`."""
    twin = torch.empty(0, dtype=view.dtype, device=view.device).set_(view.untyped_storage(), view.storage_offset(), view.shape,
                                                 view.stride())
    assert not twin.is_neg() and twin.data_ptr() == view.data_ptr()
    return twin


# --- execute ------------------------------------------------------------------------------------
def test_a_negated_input_is_resolved_on_first_and_on_repeated_executes():
    view, values = _negated()
    g, x, w, y = _graph(list(view.stride()))
    wt, out = _randn(1, COLS), poisoned(y)
    for step in range(2):  # the second call takes the fast path of the checked set
        out.fill_(float("nan"))
        g.execute({x: view, w: wt, y: out})
        assert rel_err(out, values * wt) < 1e-6, step


def test_a_negated_view_of_memory_bound_before_is_another_binding():
    """The fast path keys a binding set by addresses, dtypes, shapes and strides: the negated view
    of memory executed before has them all equal, and must still read negated."""
    view, values = _negated()
    g, x, w, y = _graph(list(view.stride()))
    wt, out = _randn(1, COLS), poisoned(y)
    g.execute({x: _plain_twin(view), w: wt, y: out})
    assert rel_err(out, -values * wt) < 1e-6
    out.fill_(float("nan"))
    g.execute({x: view, w: wt, y: out})
    assert rel_err(out, values * wt) < 1e-6


def test_a_negated_broadcast_input_keeps_its_layout():
    z = torch.complex(_randn(COLS), _randn(COLS))
    view = z.conj().imag.expand(ROWS, COLS)
    assert view.is_neg() and view.stride() == (0, 2)
    g, x, w, y = _graph([0, 2], [COLS, 1])
    wt, out = _randn(1, COLS), poisoned(y)
    g.execute({x: view, w: wt, y: out})
    assert rel_err(out, -z.imag * wt) < 1e-6


def test_a_negated_output_is_refused_and_nothing_is_written():
    out, _ = _negated()
    memory = out._base
    g, x, w, y = _graph(y_stride=list(out.stride()))
    xt, wt = _randn(ROWS, COLS), _randn(1, COLS)
    before = memory.clone()
    with pytest.raises(dg.ExecutionError, match="output 'y' is a lazily negated view"):
        g.execute({x: xt, w: wt, y: out})
    assert torch.equal(memory, before)
    g.execute({x: xt, w: wt, y: _plain_twin(out)})  # the same memory, plain: checked and written
    assert rel_err(_plain_twin(out), xt * wt) < 1e-6
    before = memory.clone()
    with pytest.raises(dg.ExecutionError, match="lazily negated"):  # not taken for the checked set
        g.execute({x: xt, w: wt, y: out})
    assert torch.equal(memory, before)


@pytest.mark.parametrize("kind", sorted(UNBINDABLE))
@pytest.mark.parametrize("role", ["input", "output"])
def test_execute_refuses_unbindable_tensors_and_writes_nothing(kind, role):
    g, x, w, y = _graph()
    xt, wt, out = _randn(ROWS, COLS), _randn(1, COLS), poisoned(y)
    g.execute({x: xt, w: wt, y: out})  # a checked set first: the bad one must not pass as it
    out.fill_(float("nan"))
    bad = UNBINDABLE[kind]()
    bindings = {x: bad, w: wt, y: out} if role == "input" else {x: xt, w: wt, y: bad}
    with pytest.raises(dg.ExecutionError, match=_refusal(kind, role, "x" if role == "input" else "y")):
        g.execute(bindings)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("kind", ["sparse_coo", "mkldnn_like", "nested"])
def test_a_caller_workspace_of_an_unbindable_kind_is_refused(kind):
    g, x, w, y = _graph()
    out = poisoned(y)
    raw = torch.zeros(1024, dtype=torch.uint8)
    workspace = {"sparse_coo": lambda: raw.to_sparse(), "mkldnn_like": lambda: raw.float().to_mkldnn(),
                 "nested": _quiet(lambda: torch.nested.nested_tensor([raw, raw]))}[kind]()
    with pytest.raises(dg.ExecutionError, match="the workspace"):
        g.execute({x: _randn(ROWS, COLS), w: _randn(1, COLS), y: out}, workspace=workspace)
    assert torch.isnan(out).all()


# --- as_function: eager, autograd, its torch.library ops, torch.compile ---------------------------
def _function():
    g, x, w, y = _graph()
    return g, g.as_function([x, w], [y])


def test_as_function_resolves_a_negated_input_eager_and_through_its_op():
    _, fn = _function()
    view, values = _negated()
    wt = _randn(1, COLS)
    assert rel_err(fn(view, wt), values * wt) < 1e-6
    # the op torch.compile's graphs call at run time (no __call__ before it)
    assert rel_err(fn._plain_op([view, wt])[0], values * wt) < 1e-6
    # an input already in the declared layout: passed as it is, the negation aside
    contiguous = torch._neg_view(values.neg().contiguous())
    assert contiguous.is_neg() and contiguous.is_contiguous()
    assert rel_err(fn(contiguous, wt), values * wt) < 1e-6


def test_as_function_gradients_of_and_through_negated_tensors():
    _, fn = _function()
    z = torch.complex(_randn(ROWS, COLS), _randn(ROWS, COLS)).requires_grad_()
    view = z.conj().imag  # negated, and wants a gradient through the view
    wt = _randn(1, COLS)
    out = fn(view, wt)
    assert rel_err(out, -z.detach().imag * wt) < 1e-6
    grad, grad_values = _negated()
    out.backward(grad)  # the incoming gradient negated as well
    expected = torch.complex(torch.zeros(ROWS, COLS), -(grad_values * wt))  # d(-imag)/dz
    assert rel_err(torch.view_as_real(z.grad), torch.view_as_real(expected)) < 1e-6


@pytest.mark.parametrize("kind", sorted(UNBINDABLE))
def test_as_function_refuses_unbindable_inputs(kind):
    _, fn = _function()
    wt = _randn(1, COLS)
    bad = UNBINDABLE[kind]()
    with pytest.raises(dg.ExecutionError, match=_refusal(kind, "input", "x")):
        fn(bad, wt)
    if kind != "meta":  # a meta tensor passed to the op itself is torch's shape propagation
        trained = bad.requires_grad_() if bad.is_floating_point() and kind != "mkldnn" else bad
        with pytest.raises(dg.ExecutionError):
            fn(trained, wt)


def test_as_function_backward_refuses_a_sparse_gradient():
    """(torch's autograd itself refuses compressed sparse and meta gradients of a strided output;
    a COO one reaches the function's backward.)"""
    _, fn = _function()
    xt = _randn(ROWS, COLS).requires_grad_()
    out = fn(xt, _randn(1, COLS))
    with pytest.raises(dg.ExecutionError, match="gradient of output 'y' is .*layout"):
        out.backward(UNBINDABLE["sparse_coo"]())
    assert xt.grad is None


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "mkldnn", "conjugate"])
def test_the_function_ops_refuse_unbindable_inputs_at_run_time(kind):
    """What a compiled graph calls: the ops, not __call__. (For nested tensors torch's dispatcher
    finds no kernel of the op and raises NotImplementedError before any of dnngraph's code runs;
    a meta tensor runs the op's fake implementation, as for any torch op.)"""
    _, fn = _function()
    bad = UNBINDABLE[kind]()
    with pytest.raises(dg.ExecutionError):
        fn._plain_op([bad, _randn(1, COLS)])
    with pytest.raises(dg.ExecutionError):
        fn._training_op([bad, _randn(1, COLS)], [False, False])


@pytest.mark.parametrize("kind", ["negated", "sparse_coo", "sparse_csr", "mkldnn", "nested", "conjugate"])
def test_the_torch_compile_backend_runtime(kind, monkeypatch):
    """What a graph compiled with backend="dnngraph" runs per partition: DnngraphModule.forward
    on the tensors of the call, through the partition's graph function."""
    from test_torch_backend import _recorded_modules
    modules = _recorded_modules(monkeypatch)
    torch._dynamo.reset()
    model = torch.compile(lambda a, b: torch.relu(a * b), backend="dnngraph")
    wt = _randn(1, COLS)
    model(_randn(ROWS, COLS), wt)
    (module,) = [m for m in modules if m.function is not None]
    if kind == "negated":
        view, values = _negated()
        assert rel_err(module(view, wt), torch.relu(values * wt)) < 1e-6
        return
    with pytest.raises(dg.ExecutionError, match=r"input '\w+' is a (conjugate|nested|tensor of layout)"):
        module(UNBINDABLE[kind](), wt)


def test_torch_compile_of_the_function_and_the_backend_read_negated_inputs():
    _, fn = _function()
    view, values = _negated()
    wt = _randn(1, COLS)
    compiled = torch.compile(lambda a, b: fn(a, b), backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(view, wt), values * wt) < 1e-6
    import dnngraph.torch_backend  # noqa: F401  (registers the backend)
    model = torch.compile(lambda a, b: torch.relu(a * b), backend="dnngraph")
    assert rel_err(model(view, wt), torch.relu(values * wt)) < 1e-6


# --- on the GPU: negated tensors through the prepared launches of repeated executes --------------
def _mul_graph(x_stride, y_stride=None):
    g = dg.Graph(name="kinds_gpu")
    x = g.tensor(name="x", dim=[64, 96], stride=x_stride)
    w = g.tensor(name="w", dim=[1, 96])
    y = g.mul(x, w).set_output(True).set_name("y")
    if y_stride is not None:
        y.set_stride(y_stride)
    return g.build(), x, w, y


@pytest.mark.gpu
def test_negated_inputs_on_the_fast_path():
    z = torch.complex(_randn(64, 96, device="cuda"), _randn(64, 96, device="cuda"))
    view = z.conj().imag
    g, x, w, y = _mul_graph(list(view.stride()))
    wt, out = _randn(1, 96, device="cuda"), poisoned(y, "cuda")
    g.execute({x: _plain_twin(view), w: wt, y: out})  # bound by address
    assert rel_err(out, z.imag * wt) < 1e-6
    for _ in range(2):
        out.fill_(float("nan"))
        g.execute({x: view, w: wt, y: out})
        assert rel_err(out, -z.imag * wt) < 1e-6
    fn = g.as_function()
    assert rel_err(fn(view, wt), -z.imag * wt) < 1e-6


@pytest.mark.gpu
def test_a_negated_output_is_refused_on_cuda():
    z = torch.complex(_randn(64, 96, device="cuda"), _randn(64, 96, device="cuda"))
    out = z.conj().imag
    g, x, w, y = _mul_graph(None, list(out.stride()))
    before = z.clone()
    with pytest.raises(dg.ExecutionError, match="lazily negated"):
        g.execute({x: _randn(64, 96, device="cuda"), w: _randn(1, 96, device="cuda"), y: out})
    torch.cuda.synchronize()
    assert torch.equal(z, before)
