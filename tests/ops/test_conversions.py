"""Conversions bit-exact with torch's Tensor.to: casts, plain stores and fused narrow stores.

The values cover every float class of every target: exact halfway points between neighbouring
values (ties) and the values just either side, the largest finite value, the halfway point past
it and beyond, infinities, NaN of both signs, +-0, subnormals of source and target, smallest
normals and large integers. Results are compared as integers (bit patterns), NaN included.
"""
import math

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.codegen.conversions import float8_rule

FLOATS = (dg.float32, dg.float16, dg.bfloat16, dg.float8_e4m3, dg.float8_e5m2)
INTEGERS = (dg.int32, dg.int64)
ALL = FLOATS + INTEGERS + (dg.bool,)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (bool as is)."""
    if tensor.dtype == torch.bool or not tensor.is_floating_point():
        return tensor
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _float_class_values(data_type) -> list:
    """Ties, their neighbours, overflow and subnormal edges of float `data_type`, in float64."""
    info = torch.finfo(data_type.torch_dtype)
    grid = [info.tiny, info.tiny * 2 ** -1, info.smallest_normal, info.max, 1.0, 1.5, 3.0, 100.0, 0.99999]
    if data_type.itemsize == 1:  # every fp8 value: the ties between all neighbours
        codes = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(data_type.torch_dtype)
        values = sorted({v for v in codes.double().tolist() if math.isfinite(v) and v >= 0})
    else:
        values = sorted(set(grid) | {info.tiny * k for k in (1, 2, 3, 5)})
        step = info.eps
        values += [v * (1 + step * k) for v in (1.0, 0.5, 1024.0) for k in (0, 1, 2, 3)]
        values.sort()
    halves = [(a + b) / 2 for a, b in zip(values, values[1:])]
    step = info.max - float(torch.tensor(info.max, dtype=torch.float64).to(data_type.torch_dtype)
                            .view(torch.int16 if data_type.itemsize == 2 else
                                  (torch.uint8 if data_type.itemsize == 1 else torch.int32)).sub(1)
                            .view(data_type.torch_dtype).double())
    past = [info.max + step / 2, info.max + step / 2 * 0.999, info.max + step, info.max * 2, info.max * 1e3]
    return values + halves + past


def corpus(source) -> torch.Tensor:
    """The test values for `source`: every target's float classes, rounded to `source`."""
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, 2.0 ** 40 + 2.0 ** 29 + 1, 2.0 ** 24 + 2 ** 16 + 1,
              2.0 ** 31, 2.0 ** 31 - 128, -(2.0 ** 31), 3e9, 123456789.0, 2.5, -2.5, 0.5, 1e-3, 1e-40, 2.0 ** -149]
    for target in FLOATS:
        values += _float_class_values(target)
    values += [-v for v in values]
    values = torch.tensor(values, dtype=torch.float64)
    if source is dg.bool:
        return values != 0
    if not source.is_floating:
        values = values.clamp(-2.0 ** 62, 2.0 ** 62).nan_to_num(0.0, 2.0 ** 62, -(2.0 ** 62))
        big = [2 ** 24 + 2 ** 16 + 1, 2 ** 53 + 1, 2 ** 62 + 2 ** 38 + 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 31 + 5]
        tail = torch.tensor(big, dtype=torch.int64)
        return torch.cat([values.to(torch.int64), tail]).to(source.torch_dtype)
    values = values.to(torch.float32).to(source.torch_dtype)
    negative_nan = torch.tensor([-math.nan], dtype=torch.float32).to(source.torch_dtype)
    return torch.cat([values, negative_nan])


def poisoned_like(shape, data_type, device="cpu") -> torch.Tensor:
    if data_type.is_floating:
        return torch.full(shape, math.nan, dtype=data_type.torch_dtype, device=device)
    if data_type is dg.bool:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.full(shape, -7, dtype=data_type.torch_dtype, device=device)


def _cast_and_store_graph(source, count):
    """x (source) cast to every type, and stored to every type by an identity op (x * 1)."""
    g = dg.Graph(name="convert", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    x = g.tensor(name="x", dim=[count], data_type=source)
    outputs = {}
    for target in ALL:
        outputs[f"cast_{target.name}"] = g.cast(x, target).set_output(True)
        if source is not dg.bool:
            identity = g.mul(x, 1 if not source.is_floating else 1.0)
            outputs[f"store_{target.name}"] = identity.set_output(True).set_data_type(target)
    return g, x, outputs


def assert_same_bits(out: torch.Tensor, want: torch.Tensor, what: str, values: torch.Tensor):
    """Bit for bit, except that a NaN matches any NaN: torch itself gives NaN different bits by
    its position in a tensor (its vectorized fp16 -> fp32 keeps the sign, the scalar tail makes
    0x7fffffff), so a NaN's payload is no property of the conversion."""
    nan = want.isnan() if want.is_floating_point() else torch.zeros_like(want, dtype=torch.bool)
    got_nan = out.isnan() if out.is_floating_point() else torch.zeros_like(out, dtype=torch.bool)
    wrong = ((bits(out) != bits(want)) & ~nan) | (got_nan != nan)
    wrong = wrong.nonzero().flatten().tolist()
    assert not wrong, (f"{what}: {len(wrong)} values differ, e.g. "
                       f"{[(values.flatten()[i].item(), out.flatten()[i].item(), want.flatten()[i].item()) for i in wrong[:5]]}")


def check_conversions(source, device="cpu"):
    values = corpus(source).to(device)
    g, x, outputs = _cast_and_store_graph(source, values.numel())
    g.build()
    bound = {name: poisoned_like(values.shape, tensor.data_type, device) for name, tensor in outputs.items()}
    g.execute({x: values, **{outputs[name]: out for name, out in bound.items()}})
    for name, out in bound.items():
        assert_same_bits(out, values.to(outputs[name].data_type.torch_dtype), f"{source.name} -> {name}", values)


@pytest.mark.parametrize("source", ALL, ids=lambda t: t.name)
def test_cast_and_store_bit_exact(source):
    check_conversions(source)


@pytest.mark.gpu
@pytest.mark.parametrize("source", ALL, ids=lambda t: t.name)
def test_cast_and_store_bit_exact_gpu(source):
    check_conversions(source, device="cuda")


def _narrow_products(device):
    """a [M, 1], b [1, N] whose products are exact in float32: the corpus times powers of two."""
    a = corpus(dg.float32).to(device)
    b = torch.tensor([1.0, 0.5, 2.0], device=device)
    return a[:, None], b[None, :], 0.0 + a[:, None] * b[None, :]


@pytest.mark.parametrize("target", FLOATS[1:], ids=lambda t: t.name)
def test_matmul_stores_narrow_bit_exact(target, device="cpu"):
    """The GEMM family's epilogue stores through the same conversion (a K=1 product is exact)."""
    a, b, product = _narrow_products(device)
    g = dg.Graph(io_data_type=dg.float32)
    at, bt = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    y = g.matmul(at, bt).set_output(True).set_data_type(target)
    g.build()
    out = poisoned_like(product.shape, target, device)
    g.execute({at: a, bt: b, y: out})
    assert_same_bits(out.flatten(), product.to(target.torch_dtype).flatten(), f"matmul -> {target.name}", product)


@pytest.mark.parametrize("target", FLOATS[1:], ids=lambda t: t.name)
def test_matmul_exit_stores_narrow_bit_exact(target, device="cpu"):
    """A matmul's row-reduction exit (folded in a kernel of its own) stores through it too."""
    a, b, product = _narrow_products(device)
    g = dg.Graph(io_data_type=dg.float32)
    at, bt = g.tensor_like(a, name="a"), g.tensor_like(b, name="b")
    y = g.matmul(at, bt)
    y.set_output(True)
    peak = g.reduction(y, "max", axes=[1]).set_output(True).set_data_type(target)
    g.build()
    out = poisoned_like([product.shape[0], 1], target, device)
    g.execute({at: a, bt: b, y: torch.empty_like(product), peak: out})
    want = product.amax(1, keepdim=True)
    want = torch.where(product.isnan().any(1, keepdim=True), math.nan, want).to(target.torch_dtype)
    assert_same_bits(out.flatten(), want.flatten(), f"matmul exit -> {target.name}", want)


@pytest.mark.parametrize("target", FLOATS[1:], ids=lambda t: t.name)
def test_reduction_stores_narrow_bit_exact(target, device="cpu"):
    """The rows family's stores: max over an axis whose other entry is -inf keeps x."""
    x = corpus(dg.float32).to(device)
    pair = torch.stack([x, torch.full_like(x, -math.inf)], 1).t()  # [2, n]: a strided view
    g = dg.Graph(io_data_type=dg.float32)
    xt = g.tensor_like(pair, name="x")
    y = g.reduction(xt, "max", axes=[0]).set_output(True).set_data_type(target)
    g.build()
    out = poisoned_like([1, x.numel()], target, device)
    g.execute({xt: pair, y: out})
    want = torch.maximum(x, torch.full_like(x, -math.inf))[None, :].to(target.torch_dtype)
    assert_same_bits(out.flatten(), want.flatten(), f"max -> {target.name}", x)


@pytest.mark.gpu
@pytest.mark.parametrize("target", FLOATS[1:], ids=lambda t: t.name)
def test_fused_narrow_stores_gpu(target):
    test_matmul_stores_narrow_bit_exact(target, device="cuda")
    test_matmul_exit_stores_narrow_bit_exact(target, device="cuda")
    test_reduction_stores_narrow_bit_exact(target, device="cuda")


def test_float8_rule_read_from_torch():
    """The overflow encodings the GPU helper applies are torch's own."""
    for target in (dg.float8_e4m3, dg.float8_e5m2):
        rule = float8_rule(target)
        largest = torch.finfo(target.torch_dtype).max
        below = torch.tensor([rule.first_overflow], dtype=torch.float32).nextafter(torch.tensor(0.0))
        assert bits(below.to(target.torch_dtype)).item() == bits(torch.tensor([largest]).to(target.torch_dtype)).item()
        assert bits(torch.tensor([rule.first_overflow]).to(target.torch_dtype)).item() == rule.overflow_bits
        assert bits(torch.tensor([math.inf]).to(target.torch_dtype)).item() == rule.infinity_bits


def test_interpreter_conversions_refuse_other_triton(monkeypatch):
    """The interpreter patch is written against Triton 3.6.0's internals and says so."""
    import triton
    from triton.runtime import interpreter

    from dnngraph.runtime import interpreter_casts
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    with pytest.raises(dg.UnsupportedError, match="3.6.0"):
        interpreter_casts._check_triton(interpreter)


def test_interpreter_conversion_of_buffers():
    """torch_convert round-trips the interpreter's buffers (bf16 as uint16, fp8 as uint8)."""
    import numpy as np
    import triton.language as tl

    from dnngraph.runtime.interpreter_casts import torch_convert
    data = np.array([[0.99999, 500.0], [1e-3, -math.inf]], dtype=np.float32)
    got = torch_convert(data, tl.float32, tl.bfloat16)
    assert got.dtype == np.uint16 and got.shape == (2, 2)
    assert torch.equal(torch.from_numpy(got).view(torch.bfloat16), torch.from_numpy(data).to(torch.bfloat16))
    got = torch_convert(data, tl.float32, tl.float8e4nv)
    assert torch.equal(torch.from_numpy(got), torch.from_numpy(data).to(torch.float8_e4m3fn).view(torch.uint8))


def test_interpreter_process_converts_exactly(monkeypatch):
    """CPU tensors on a GPU machine run in the interpreter process: the same exact conversions
    are installed there (no kernel may run in this process)."""
    from dnngraph.runtime import interpreter as runtime
    from dnngraph.runtime.launch import KernelLaunch

    def here(self, tensors):
        raise AssertionError("a kernel ran through the interpreter in the test process")

    monkeypatch.setattr(KernelLaunch, "interpret", here)
    runtime.force_interpreter_worker(True)
    try:
        check_conversions(dg.float32)
        check_conversions(dg.int64)
    finally:
        runtime.force_interpreter_worker(False)


def test_casts_between_integer_types_wrap_in_the_reference_as_in_the_kernel():
    """float -> int64 -> int32: torch (and the kernel) wrap the int64 into int32; the reference
    held the int64 in float64 and saturated instead."""
    values = torch.tensor([math.inf, 3e9, -5e9, 2.5, -2.5, 2.0 ** 40 + 7])
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[values.numel()])
    y = g.cast(g.cast(x, dg.int64), dg.int32).set_output(True)
    g.build()
    out = torch.full([values.numel()], -7, dtype=torch.int32)
    g.execute({x: values, y: out})
    want = values.to(torch.int64).to(torch.int32)
    assert out.tolist() == want.tolist()
    assert g.reference({x: values})[y.name].tolist() == want.tolist()
