"""pow against torch: every C99 special case, integral exponents exact, integer pow exact and
wrapping as torch's, g.reference agreeing with torch, on CPU (the interpreter) and the GPU."""
import itertools
import math

import pytest
import torch

import dnngraph as dg
from dnngraph.dtypes import from_torch

nan, inf = math.nan, math.inf

# bases and exponents whose every pairing is one of C99 pow's special cases or an exact result:
# +-0, +-1, +-inf, NaN, odd/even/non-integral exponents of both signs, |x| < 1 and > 1
SPECIAL_BASES = (0.0, -0.0, 1.0, -1.0, inf, -inf, nan, 0.5, -0.5, 2.0, -2.0, 7.0, -3.0, 10.0, 1e-30, -1e30)
SPECIAL_EXPONENTS = (0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.5, -0.5, 2.5, -2.5, inf, -inf, nan,
                     127.0, 1e10, -1e10, 31.0, 16777217.0)


def _pow_graph(count, data_type=dg.float32):
    g = dg.Graph(io_data_type=data_type, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    a = g.tensor(name="a", dim=[count], data_type=data_type)
    b = g.tensor(name="b", dim=[count], data_type=data_type)
    y = g.pow(a, b).set_output(True)
    return g, a, b, y


def run_pow(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    g, a, b, y = _pow_graph(base.numel(), from_torch(base.dtype))
    g.build()
    out = torch.full_like(base, -7) if not base.is_floating_point() else torch.full_like(base, nan)
    g.execute({a: base, b: exponent, y: out})
    return out


def _same(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Element-wise: the same value, -0.0 apart from +0.0, NaN matching NaN."""
    same_bits = out.view(torch.int32) == want.view(torch.int32)
    return same_bits | (out.isnan() & want.isnan())


def _special_table(device):
    pairs = list(itertools.product(SPECIAL_BASES, SPECIAL_EXPONENTS))
    base = torch.tensor([p[0] for p in pairs], dtype=torch.float32, device=device)
    exponent = torch.tensor([p[1] for p in pairs], dtype=torch.float32, device=device)
    return base, exponent


def check_special_cases(device="cpu"):
    base, exponent = _special_table(device)
    out, want = run_pow(base, exponent), torch.pow(base, exponent)
    same = _same(out, want)
    # where the result is an ordinary number (no 0, 1, inf or NaN), one ulp: torch's CUDA pow is
    # not correctly rounded (7 ** -1 is 0.14285713 there; 1/7 rounds to 0.14285715)
    ordinary = torch.isfinite(want) & (want != 0) & (want.abs() != 1)
    same |= ordinary & ((out.double() - want.double()).abs() <= want.double().abs() * 2.0 ** -23)
    wrong = [(base[i].item(), exponent[i].item(), out[i].item(), want[i].item())
             for i in (~same).nonzero().flatten().tolist()]
    assert not wrong, f"pow differs from torch at (base, exponent, got, torch): {wrong[:10]}"


def test_float_special_cases_match_torch():
    check_special_cases()


def check_integral_exponents_exact(device="cpu"):
    """Small integer powers of integers are exact (7 ** 2 is 49, not 49.0000038), and random
    bases to integral exponents are torch's to its own rounding (one ulp: torch's CPU and CUDA
    pow themselves differ there)."""
    gen = torch.Generator().manual_seed(5)
    small = torch.randint(-12, 13, (301,), generator=gen).float()
    powers = torch.randint(0, 6, (301,), generator=gen).float()
    out = run_pow(small.to(device), powers.to(device)).cpu()
    assert torch.equal(out, torch.pow(small.double(), powers.double()).float())
    base = torch.randn(257, generator=gen) * 3
    exponent = torch.randint(-20, 21, (257,), generator=gen).float()
    out = run_pow(base.to(device), exponent.to(device)).cpu()
    want = torch.pow(base.double(), exponent.double()).float()
    assert torch.allclose(out, want, rtol=2.5e-7, atol=0, equal_nan=True)


def test_integral_exponents_exact():
    check_integral_exponents_exact()


def test_non_integral_exponents_near_torch():
    gen = torch.Generator().manual_seed(6)
    base = torch.rand(199, generator=gen) * 10
    exponent = torch.randn(199, generator=gen) * 4
    out = run_pow(base, exponent)
    assert torch.allclose(out, torch.pow(base, exponent), rtol=2.5e-7, atol=0, equal_nan=True)
    negative = run_pow(-base - 0.25, exponent + 0.25)  # non-integral exponents of negatives: NaN
    assert torch.equal(negative.isnan(), torch.pow(-base - 0.25, exponent + 0.25).isnan())


INTEGER_SPECIALS = (0, 1, -1, 2, -2, 3, 5, 7, 10, -3, 46341, 2 ** 31 - 1, -(2 ** 31))
INTEGER_EXPONENTS = (0, 1, 2, 3, -1, -2, -3, -5, 5, 20, 21, 31, 32, 40, 63, 2 ** 31 - 1, -(2 ** 31))


def check_integer_pow(dtype, device="cpu"):
    """Integer pow is exact and wraps as torch's does; negative exponents as torch: 1 ** -n is
    1, (-1) ** -n is +-1 by parity, anything else 0 (0 ** -1 included); 0 ** 0 is 1."""
    pairs = list(itertools.product(INTEGER_SPECIALS, INTEGER_EXPONENTS))
    base = torch.tensor([p[0] for p in pairs], dtype=dtype)
    exponent = torch.tensor([p[1] for p in pairs], dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    info = torch.iinfo(dtype)
    base = torch.cat([base, torch.randint(-50, 51, (211,), generator=gen, dtype=dtype),
                      torch.randint(info.min, info.max, (97,), generator=gen, dtype=dtype)])
    exponent = torch.cat([exponent, torch.randint(-4, 70, (211,), generator=gen, dtype=dtype),
                          torch.randint(0, 200, (97,), generator=gen, dtype=dtype)])
    out = run_pow(base.to(device), exponent.to(device)).cpu()
    want = torch.pow(base, exponent)
    wrong = (out != want).nonzero().flatten().tolist()
    assert not wrong, [(base[i].item(), exponent[i].item(), out[i].item(), want[i].item()) for i in wrong[:8]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_pow_exact_and_wrapping(dtype):
    check_integer_pow(dtype)


def test_integer_pow_mixed_widths_and_constants():
    """int32 ** int64 computes in int64, an integral constant keeps it integer, a float constant
    makes it float (as in torch)."""
    g = dg.Graph(io_data_type=dg.int32)
    a = g.tensor(name="a", dim=[5], data_type=dg.int32)
    b = g.tensor(name="b", dim=[5], data_type=dg.int64)
    wide = g.pow(a, b).set_output(True).set_data_type(dg.int64)
    cube = g.pow(a, 3).set_output(True)
    root = g.pow(a, 0.5).set_output(True).set_data_type(dg.float32)
    g.build()
    at = torch.tensor([3, -2, 0, 1291, 7], dtype=torch.int32)
    bt = torch.tensor([39, 63, 0, 5, -1], dtype=torch.int64)
    outs = {wide: torch.zeros(5, dtype=torch.int64), cube: torch.zeros(5, dtype=torch.int32),
            root: torch.full((5,), nan)}
    g.execute({a: at, b: bt, **outs})
    assert torch.equal(outs[wide], torch.pow(at, bt))
    assert torch.equal(outs[cube], torch.pow(at, 3))
    assert torch.allclose(outs[root], torch.pow(at, 0.5), equal_nan=True)


def test_reference_pow_agrees_with_torch():
    base, exponent = _special_table("cpu")
    g, a, b, y = _pow_graph(base.numel())
    ref = g.reference({a: base, b: exponent})[y.name]
    assert torch.equal(ref.isnan(), torch.pow(base, exponent).isnan())
    assert torch.equal(ref.float()[~ref.isnan()], torch.pow(base, exponent)[~ref.isnan()])
    ints = torch.tensor([5, 10, 0, 2, -1, 46341], dtype=torch.int32)
    powers = torch.tensor([3, 3, -1, -1, -5, 2], dtype=torch.int32)
    g, a, b, y = _pow_graph(6, dg.int32)
    assert torch.equal(g.reference({a: ints, b: powers})[y.name], torch.pow(ints, powers))


@pytest.mark.gpu
def test_pow_gpu():
    check_special_cases("cuda")
    check_integral_exponents_exact("cuda")
    for dtype in (torch.int32, torch.int64):
        check_integer_pow(dtype, "cuda")


SPECIAL_VALUES = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, inf, -inf, nan]


def _pow_with_a_number(base, exponent, device="cpu"):
    """pow(base, exponent) with one side a number (a constant of the op): kernel and reference."""
    tensor = torch.tensor(SPECIAL_VALUES, device=device)
    g = dg.Graph(io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[tensor.numel()])
    y = g.pow(x if base is None else base, x if exponent is None else exponent).set_output(True)
    g.build()
    out = torch.full_like(tensor, nan)
    g.execute({x: tensor, y: out})
    return tensor, out.cpu(), g.reference({x: tensor})[y.name].float().cpu()


@pytest.mark.parametrize("number", [0.5, -0.5, 2.0, -1.0, 3.0, inf, -inf, nan, 0.0, -0.0])
@pytest.mark.parametrize("side", ["base", "exponent"])
def test_pow_with_a_number_on_either_side_matches_torch(number, side, device="cpu"):
    """torch.pow(t, 0.5) is sqrt(t) ((-0.0) ** 0.5 is -0.0, (-inf) ** 0.5 NaN; -0.5 rsqrt);
    an infinite number as the base broadcast as any other (it raised inside the kernel)."""
    tensor, out, reference = _pow_with_a_number(number if side == "base" else None,
                                                number if side == "exponent" else None, device)
    want = torch.pow(number, tensor.cpu()) if side == "base" else torch.pow(tensor.cpu(), number)
    assert _same(out, want).all(), (number, side, out.tolist(), want.tolist())
    assert _same(reference, want).all(), (number, side, reference.tolist(), want.tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("number", [0.5, -0.5, inf, -inf])
def test_pow_with_a_number_matches_torch_gpu(number):
    test_pow_with_a_number_on_either_side_matches_torch(number, "exponent", "cuda")
    test_pow_with_a_number_on_either_side_matches_torch(number, "base", "cuda")
