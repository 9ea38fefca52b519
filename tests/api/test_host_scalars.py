"""Host scalars as the cuDNN frontend passes them: one-element inputs declared is_pass_by_value
(bound to a Python number or a CPU tensor at execute, one build for every value), and the norms'
epsilon and momentum given as tensors, read by the kernels (every row mode)."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, run

ROW_MODES = [None, "one_pass", "looped", "split"]


def test_pass_by_value_inputs_take_numbers_and_cpu_tensors_on_one_build():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 7])
    shift = g.tensor(name="shift", dim=[1, 1], is_pass_by_value=True)
    count = g.tensor(name="count", dim=[1], data_type=dg.int32, is_pass_by_value=True)
    y = g.mul(g.add(x, shift), count).set_output(True)
    g.build()
    plan = g.plan
    x_t = torch.randn(5, 7)
    for shift_value, count_value in [(1.5, 3), (-0.25, -2), (torch.tensor(2.0), torch.tensor([4], dtype=torch.int32))]:
        out = run(g, {x: x_t, shift: shift_value, "count": count_value})[y.name]
        want = (x_t.double() + float(shift_value)) * int(count_value)
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g.reference({x: x_t, shift: shift_value, "count": count_value})[y.name], want)
    assert g.plan is plan, "a new value needs no new build"


@pytest.mark.parametrize("value, match", [("1.0", "number"), (torch.ones(2), "one element"), (2.5, "no integer"),
                                          (None, "missing binding|no binding")])
def test_bad_pass_by_value_bindings_are_refused_and_write_nothing(value, match):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3])
    n = g.tensor(name="n", dim=[1], data_type=dg.int64, is_pass_by_value=True)
    y = g.add(x, n).set_output(True)
    g.build()
    out = torch.full((3,), float("nan"))
    bindings = {x: torch.randn(3), y: out, **({} if value is None else {n: value})}
    with pytest.raises(dg.ExecutionError, match=match):
        g.execute(bindings)
    assert torch.isnan(out).all()
    with pytest.raises(dg.ExecutionError, match=match):
        g.reference({k: v for k, v in bindings.items() if k is not y})


def test_pass_by_value_declarations_are_checked_and_round_trip():
    g = dg.Graph()
    with pytest.raises(dg.ValidationError, match="one"):
        g.tensor(name="v", dim=[2, 1], is_pass_by_value=True)
    assert not g.tensors
    x = g.tensor(name="x", dim=[4])
    y = g.relu(x)
    with pytest.raises(dg.ValidationError, match="graph inputs"):
        y.set_is_pass_by_value(True)
    with pytest.raises(dg.ValidationError, match="elements"):
        x.set_is_pass_by_value(True)
    scale = g.tensor(name="scale", dim=[1]).set_is_pass_by_value()
    g.mul(y, scale).set_output(True)
    g2 = dg.Graph.from_json(g.to_json())
    assert g2.tensor_by_name("scale").is_pass_by_value and not g2.tensor_by_name("x").is_pass_by_value
    x_t = torch.randn(4)
    out = run(g2, {"x": x_t, "scale": 3.0})
    torch.testing.assert_close(next(iter(out.values())), F.relu(x_t) * 3.0)


def _norm_graph(op, eps_tensor, dims=(6, 4, 5)):
    g = dg.Graph(name=op)
    x = g.tensor(name="x", dim=list(dims))
    rank = len(dims)
    if op in ("layernorm", "rmsnorm"):
        param = [1] + list(dims[1:])
    elif op == "adalayernorm":
        param = [dims[0], 1] + list(dims[2:])
    else:
        param = [1, dims[1]] + [1] * (rank - 2)
    scale, bias = g.tensor(name="scale", dim=param), g.tensor(name="bias", dim=param)
    eps = g.tensor(name="eps", dim=[1] * rank, is_pass_by_value=True) if eps_tensor == "by_value" else \
        g.tensor(name="eps", dim=[1] * rank)
    if op == "groupnorm":
        outputs = g.groupnorm(x, scale, bias, groups=2, epsilon=eps)
    elif op == "rmsnorm":
        outputs = g.rmsnorm(x, scale, bias, epsilon=eps)
    else:
        outputs = getattr(g, op)(x, scale, bias, epsilon=eps)
    for t in outputs:
        if t is not None:
            t.set_output(True)
    return g, x, scale, bias, eps, outputs[0], param


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm", "instancenorm", "groupnorm", "adalayernorm"])
@pytest.mark.parametrize("mode", ROW_MODES)
def test_norm_epsilon_tensor_in_every_row_mode(op, mode):
    g, x, scale, bias, eps, y, param = _norm_graph(op, "device")
    x_t, scale_t, bias_t = torch.randn(6, 4, 5) * 0.01, torch.randn(param), torch.randn(param)
    eps_value = 0.5  # large against the variance of x: a wrong epsilon shows
    inputs = {x: x_t, scale: scale_t, bias: bias_t, eps: torch.full([1, 1, 1], eps_value)}
    outs = check(g, inputs, options=dg.BuildOptions(row_mode=mode) if mode else None)
    x64 = x_t.double()
    torch_norm = {
        "layernorm": lambda: F.layer_norm(x64, (4, 5), eps=eps_value),
        "adalayernorm": lambda: F.layer_norm(x64, (5,), eps=eps_value),
        "rmsnorm": lambda: x64 * (x64.square().mean((1, 2), keepdim=True) + eps_value).rsqrt(),
        "instancenorm": lambda: F.instance_norm(x64, eps=eps_value),
        "groupnorm": lambda: F.group_norm(x64, 2, eps=eps_value)}[op]
    want = torch_norm() * scale_t.double() + bias_t.double()
    torch.testing.assert_close(outs[y.name].double(), want, rtol=1e-5, atol=1e-5)


def test_norm_epsilon_passed_by_value_and_its_gradient():
    g, x, scale, bias, eps, y, param = _norm_graph("layernorm", "by_value")
    x_t, scale_t, bias_t = torch.randn(6, 4, 5), torch.randn(param), torch.randn(param)
    for eps_value in (1e-5, 2.0):
        outs = run(g, {x: x_t, scale: scale_t, bias: bias_t, eps: eps_value})
        want = F.layer_norm(x_t.double(), (4, 5), eps=eps_value) * scale_t.double() + bias_t.double()
        torch.testing.assert_close(outs[y.name].double(), want, rtol=1e-5, atol=1e-5)
    # autodiff: the backward graph reads the forward's statistics, made with the tensor epsilon
    gf = dg.Graph()
    xf, sf = gf.tensor(name="x", dim=[3, 8]), gf.tensor(name="scale", dim=[1, 8])
    ef = gf.tensor(name="eps", dim=[1, 1])
    yf = gf.layernorm(xf, sf, None, epsilon=ef)[0].set_output(True)
    fn = gf.as_function([xf, sf, ef], [yf])
    x_t, s_t = torch.randn(3, 8, requires_grad=True), torch.randn(1, 8)
    (got,) = torch.autograd.grad(fn(x_t, s_t, torch.full((1, 1), 0.3)), x_t, torch.ones(3, 8) * torch.arange(8.0))
    leaf = x_t.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(F.layer_norm(leaf, (8,), eps=0.3) * s_t.double(), leaf,
                                  torch.ones(3, 8, dtype=torch.float64) * torch.arange(8.0, dtype=torch.float64))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ROW_MODES)
def test_batchnorm_epsilon_and_momentum_tensors(mode):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 3, 4, 3])
    scale, bias, running_mean, running_var = (g.tensor(name=n, dim=[1, 3, 1, 1]) for n in ("s", "b", "rm", "rv"))
    eps, momentum = g.tensor(name="eps", dim=[1, 1, 1, 1]), g.tensor(name="momentum", dim=[1], is_pass_by_value=True)
    with pytest.raises(dg.ValidationError, match="one element"):
        g.batchnorm(x, scale, bias, running_mean, running_var, epsilon=scale, momentum=momentum)
    y, _, _, next_mean, next_var = g.batchnorm(x, scale, bias, running_mean, running_var, epsilon=eps,
                                               momentum=momentum)
    for t in (y, next_mean, next_var):
        t.set_output(True)
    x_t = torch.randn(5, 3, 4, 3)
    params = [torch.randn(1, 3, 1, 1) for _ in range(2)]
    mean_t, var_t = torch.randn(1, 3, 1, 1), torch.rand(1, 3, 1, 1) + 0.5
    inputs = {x: x_t, scale: params[0], bias: params[1], running_mean: mean_t, running_var: var_t,
              eps: torch.full((1, 1, 1, 1), 0.2), momentum: torch.tensor(0.3)}  # a CPU scalar
    outs = check(g, inputs, options=dg.BuildOptions(row_mode=mode) if mode else None)
    torch_mean, torch_var = mean_t.view(3).double().clone(), var_t.view(3).double().clone()
    want = F.batch_norm(x_t.double(), torch_mean, torch_var, params[0].view(3).double(), params[1].view(3).double(),
                        training=True, momentum=0.3, eps=0.2)
    torch.testing.assert_close(outs[y.name].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[next_mean.name].double().view(3), torch_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[next_var.name].double().view(3), torch_var, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims, data_type, match", [([1, 2], dg.float32, "one element"),
                                                    ([1, 1], dg.int32, "floating")])
def test_bad_epsilon_tensors_are_refused(dims, data_type, match):
    g = dg.Graph()
    x, scale = g.tensor(name="x", dim=[3, 2]), g.tensor(name="scale", dim=[1, 2])
    eps = g.tensor(name="eps", dim=dims, data_type=data_type)
    with pytest.raises(dg.ValidationError, match=match):
        g.layernorm(x, scale, None, epsilon=eps)
    assert not g.nodes


@pytest.mark.gpu
def test_host_scalars_on_gpu():
    """Values passed by value are staged onto the GPU; an epsilon tensor on the GPU kernels."""
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, scale = g.tensor(name="x", dim=[64, 1024]), g.tensor(name="scale", dim=[1, 1024])
    eps = g.tensor(name="eps", dim=[1, 1], data_type=dg.float32, is_pass_by_value=True)
    shift = g.tensor(name="shift", dim=[1, 1], data_type=dg.float32, is_pass_by_value=True)
    y = g.add(g.layernorm(x, scale, None, epsilon=eps)[0], shift).set_output(True)
    x_t = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    scale_t = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    for eps_value, shift_value in ((1e-5, 0.5), (3.0, torch.tensor(-1.0))):
        out = run(g, {x: x_t, scale: scale_t, eps: eps_value, shift: shift_value}, device="cuda")[y.name]
        want = F.layer_norm(x_t.double(), (1024,), eps=eps_value) * scale_t.double() + float(shift_value)
        assert ((out.double() - want).norm() / want.norm()).item() < 1.6e-2
