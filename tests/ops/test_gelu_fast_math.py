"""GELU's 16-bit epilogue math (triton_math.gelu_fast, gelu_tanh_fast) and where it is chosen.

- accuracy: every 64th float32 in [2^-24, 64] (both signs) through the interpreter, against
  float64 values of x * sigmoid(2u) and x * erfc(-x / sqrt 2) / 2 (forms without cancellation),
  in units of the bf16 and fp16 spacing at the true value; relative to the value over every
  float32 magnitude (subnormals, the switch points, |x| up to 3e38), on the interpreter and on the
  GPU, where ex2.approx.ftz flushes a factor below 2^-126 (the far tail reads -0.0 there);
  special values as the precise forms;
- the decision (problems/base.py fast_math_outputs): GELU of a GEMM-shaped group stored in a
  float type narrower than float32 (bf16, fp16, fp8; blended too), itself or through casts to
  such types, and read by no other node of its group; fp32 and integer outputs, values read
  inside the group (a row exit too) and other families keep the precise math; both backends
  render what it says, in every kernel of a split-K plan; it is derived at build (a JSON round
  trip and a graph differing only in its output type decide alike and apart);
- matmul and conv epilogues with it against g.reference, outputs poisoned, odd sizes, a
  transposed operand, the negative tail and NaN / inf inputs, fp8 outputs, a cancelling blend
  (within float32 math's error), and torch.compile of a bf16 Linear + GELU; an ulp plus what
  the float32 accumulation's error bound moves the GELU (a pre-activation that cancels near
  zero keeps only that absolute accuracy, which an fp16 ulp there is far below);
- the math alone, apart from the accumulation: the GEMM built with it and with the float32
  forms at one config (one order of sums), within an ulp of each other, on the interpreter
  and on the GPU (both backends).
"""
import contextlib
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import dnngraph as dg
from dnngraph.backends.triton.codegen import triton_math as tm
from dnngraph.fusion import partition
from dnngraph.backends import registry
from dnngraph.problems import problem_of
from dnngraph.problems import base as problems_base
from dnngraph.problems.base import fast_math_outputs
from dnngraph.runtime import plan_cache
from dnngraph.runtime.interpreter import interpreting, run_interpreted
from helpers import check, poisoned

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# 0.003 of an ulp measured (both types, both forms): the bound leaves room for the GPU's ex2.approx
# and div.full (2 ulp of float32 each, 2.4e-7 relative: 0.002 of an fp16 ulp) and nothing more
MAX_ULPS = 0.01
TAIL = 1e-9
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
# relative to the value: float32 math's own size for x >= -3 (measured 8.5e-7 on the interpreter,
# and ex2.approx and div.full add 2.4e-7 each on the GPU), the tail's growth with |t| below
RELATIVE_HEAD, RELATIVE_TAIL, HEAD_FROM = 2.0**-19, 2.0**-16, -3.0
SMALLEST_NORMAL = 2.0**-126  # below it ex2.approx.ftz returns 0 (the GPU's tl.exp2)
# |gelu'| and |gelu_tanh'| peak at 1.1290 (near x = sqrt 2): an error in a pre-activation moves the value
# at most this much more
GELU_SLOPE = 1.13
FLOAT32_EPS = 2.0**-23


@triton.jit
def _apply(x_ptr, out_ptr, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    if TANH:
        y = tm.gelu_tanh_fast(x)
    else:
        y = tm.gelu_fast(x)
    tl.store(out_ptr + offsets, y, mask=offsets < n)


def _fast(x: torch.Tensor, tanh: bool, device="cpu") -> torch.Tensor:
    x = x.to(device)
    out = torch.full_like(x, float("nan"))
    block = 1 << 16 if device == "cpu" else 1024  # the interpreter's cost is per program, a GPU's per element
    grid = (triton.cdiv(x.numel(), block),)
    if device == "cpu" and not interpreting():  # a GPU machine's process compiles: CPU tensors are interpreted
        run_interpreted(_apply, grid, [x, out, x.numel(), tanh, block])
    else:
        _apply[grid](x, out, x.numel(), TANH=tanh, BLOCK=block)
    return out.cpu()


def _sweep() -> torch.Tensor:
    """Every 64th float32 bit pattern from 2^-24 to 64, with both signs."""
    low = torch.tensor(2.0**-24).view(torch.int32).item()
    high = torch.tensor(64.0).view(torch.int32).item()
    positive = torch.arange(low, high, 64, dtype=torch.int32).view(torch.float32)
    return torch.cat([positive, -positive])


def _true(x: torch.Tensor, tanh: bool) -> torch.Tensor:
    x = x.double()
    if tanh:
        return x * torch.sigmoid(2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x**3))
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2.0))


def _spacing(value: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of `dtype` at |value| (its subnormal spacing below the normal range)."""
    magnitude = value.abs().clamp(min=torch.finfo(dtype).smallest_normal)
    return torch.pow(2.0, torch.floor(torch.log2(magnitude)) - MANTISSA_BITS[dtype])


@pytest.mark.parametrize("tanh", [True, False], ids=["gelu_tanh", "gelu"])
def test_fast_gelu_is_within_a_hundredth_of_a_16_bit_ulp_everywhere(tanh):
    x = _sweep()
    got, true = _fast(x, tanh).double(), _true(x, tanh)
    for dtype in (torch.bfloat16, torch.float16):
        inside = true.abs() < torch.finfo(dtype).max
        ulps = ((got - true).abs() / _spacing(true, dtype))[inside]
        worst = ulps.argmax()
        assert ulps.max().item() < MAX_ULPS, (dtype, x[inside][worst].item(), ulps.max().item())


def _every_magnitude() -> torch.Tensor:
    """Every 4096th float32 bit pattern from the smallest subnormal to the largest finite, both
    signs, and the points where the forms switch or saturate: 0 (the branch on t or x), the
    tail where 2^-|t| leaves float32's normal range (gelu_tanh near -10.1, gelu near -13.2),
    exp's overflow (88, 89), and magnitudes whose square overflows."""
    patterns = torch.arange(1, 0x7F7FFFFF, 4096, dtype=torch.int64).to(torch.int32).view(torch.float32)
    points = torch.tensor([2.0**-149, 1e-45, 1e-40, 2.0**-126, 1e-30, 1e-7, 0.5, 1.0, 3.0, 5.9, 10.0, 10.1,
                           10.2, 13.1, 13.2, 13.3, 14.0, 88.0, 88.7, 89.0, 1e4, 1e19, 1.9e19, 1e20, 1e38, 3.4e38])
    magnitudes = torch.cat([patterns, points])
    return torch.cat([magnitudes, -magnitudes])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tanh", [True, False], ids=["gelu_tanh", "gelu"])
def test_fast_gelu_is_as_close_as_float32_math_at_every_magnitude(tanh, device):
    """Relative to the value: RELATIVE_HEAD for x >= -3 (where the float32 forms are as close),
    RELATIVE_TAIL below (where they keep no digit), plus float32's subnormal spacing times
    1 + |x| for a result (or a factor 2^-|t|, then multiplied by x) that rounds there. On the
    GPU ex2.approx.ftz makes a factor 2^-|t| (erfc's exp) below 2^-126 zero: a value below
    |x| 2^-126 (reachable in bf16 only) may read -0.0 there, as torch's float32 GELU reads it
    from x = -5.9 on."""
    x = _every_magnitude()
    got, true = _fast(x, tanh, device).double(), _true(x, tanh)
    xd = x.double()
    bound = torch.where(xd >= HEAD_FROM, RELATIVE_HEAD, RELATIVE_TAIL) * true.abs() + (1 + xd.abs()) * 2.0**-149
    close = (got - true).abs() <= bound
    close |= (got == true)  # +inf
    if device == "cuda":
        # the factor's exponent t carries the tail's own error (RELATIVE_TAIL): a factor just above
        # 2^-126 may be computed just below it, and flushed
        flushable = true.abs() < xd.abs() * SMALLEST_NORMAL * (1 + RELATIVE_TAIL)
        close |= flushable & (got == 0) & torch.signbit(got)
    finite = torch.isfinite(true)
    worst = ((got - true).abs() / bound)[finite & ~close]
    assert close[finite].all(), (x[finite & ~close][:8].tolist(), worst[:8].tolist())
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(true[finite]) | (got[finite] == 0) & (xd[finite] < 0))


# compiled for sm_90 in a process without the interpreter; prints the f32 instructions of the PTX
_PTX_PROGRAM = """
import json, re, sys, triton
from triton.compiler import ASTSource
from sm90_compile import TARGET
from test_gelu_fast_math import _apply
signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "TANH": "constexpr", "BLOCK": "constexpr"}
compiled = triton.compile(ASTSource(_apply, signature, {"TANH": sys.argv[1] == "1", "BLOCK": 128}),
                          target=TARGET, options={"num_warps": 4})
print(json.dumps(sorted(set(re.findall(r"\\b[a-z0-9]+(?:\\.[a-z0-9]+)*\\.f32\\b", compiled.asm["ptx"])))))
"""


@pytest.mark.parametrize("tanh", [True, False], ids=["gelu_tanh", "gelu"])
def test_the_gpu_computes_what_the_accuracy_bounds_assume(tanh):
    """Compiled for sm_90 here (no GPU needed): tl.exp2 is ex2.approx.ftz (2 ulp; the flush below
    2^-126 the GPU sweep allows), each division div.full (2 ulp, subnormals kept), and nothing else
    flushes subnormals or approximates: a Triton that compiled otherwise would move the bounds."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([os.path.dirname(here), here, os.path.join(here, "ops"), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", _PTX_PROGRAM, "1" if tanh else "0"], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path))
    assert result.returncode == 0, result.stderr[-3000:]
    instructions = set(json.loads(result.stdout.splitlines()[-1]))
    assert {i for i in instructions if i.startswith("ex2")} == {"ex2.approx.ftz.f32"}
    assert {i for i in instructions if i.startswith(("div", "rcp"))} == {"div.full.f32"}
    assert {i for i in instructions if ".ftz" in i or ".approx" in i} == {"ex2.approx.ftz.f32"}
    assert not {i for i in instructions if i.startswith(("tanh", "lg2", "sqrt", "sin", "cos"))}


@pytest.mark.parametrize("tanh", [True, False], ids=["gelu_tanh", "gelu"])
def test_fast_gelu_keeps_the_special_values_of_the_precise_form(tanh):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e30, -1e30, 3e38, -3e38])
    got = _fast(x, tanh)
    expected = torch.nn.functional.gelu(x.double(), approximate="tanh" if tanh else "none").float()
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    same = ~torch.isnan(expected)
    assert torch.equal(got[same], expected[same])
    assert torch.equal(torch.signbit(got[same]), torch.signbit(expected[same]))  # -0.0 stays -0.0


# -- the decision ---------------------------------------------------------------------------------

def _matmul_gelu(out_type, op="gelu", m=37, n=24, k=40, then=None, store_gelu=True, transposed_a=False):
    """y = op(a @ b + bias) (then `then`(g, y), stored) in bf16 operands, y stored in out_type."""
    g = dg.Graph(name="fast", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    a = g.tensor(name="a", dim=[m, k], stride=[1, m] if transposed_a else None)
    b = g.tensor(name="b", dim=[k, n])
    bias = g.tensor(name="bias", dim=[1, n])
    y = getattr(g, op)(g.add(g.matmul(a, b), bias))
    if store_gelu:
        y.set_output(True).set_data_type(out_type)
    if then is not None:
        then(g, y).set_output(True).set_data_type(out_type)
    return g, (a, b, bias), y


def _anchored_group(g):
    (group,) = [x for x in partition(g, registry.families()) if x.anchor is not None]
    return group


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("out_type,fast", [(dg.bfloat16, True), (dg.float16, True), (dg.float8_e4m3, True),
                                           (dg.float8_e5m2, True), (dg.float32, False), (dg.int32, False)])
def test_the_16_bit_math_is_chosen_for_outputs_narrower_than_float32_only(op, out_type, fast):
    g, _, y = _matmul_gelu(out_type, op)
    group = _anchored_group(g)
    assert fast_math_outputs(group) == (frozenset({y.uid}) if fast else frozenset())
    assert problem_of(g, group).fast_math == fast_math_outputs(group)  # the Problem carries it


def test_a_gelu_read_inside_its_group_keeps_the_precise_math():
    # stored in bf16, but also multiplied in the same epilogue: the product sees the fp32 value
    g, _, y = _matmul_gelu(dg.bfloat16, then=lambda g, y: g.mul(y, y))
    assert fast_math_outputs(_anchored_group(g)) == frozenset()
    # not stored at all, only read by the next op
    g, _, _ = _matmul_gelu(dg.bfloat16, then=lambda g, y: g.add(y, y), store_gelu=False)
    assert fast_math_outputs(_anchored_group(g)) == frozenset()


def _cast_to(data_type):
    return lambda g, y: g.cast(y, data_type=data_type)


@pytest.mark.parametrize("then,out_type,fast", [
    (_cast_to(dg.bfloat16), dg.bfloat16, True),  # an fp32 intermediate rounded as it is stored
    (lambda g, y: g.cast(g.cast(y, data_type=dg.bfloat16), data_type=dg.float16), dg.float16, True),
    (_cast_to(dg.float8_e4m3), dg.float8_e4m3, True),
    (_cast_to(dg.float32), dg.float32, False),  # no rounding at all
    # a virtual bf16 value may be held wider (DESIGN: at least intermediate_data_type): only a store rounds
    (lambda g, y: g.cast(g.cast(y, data_type=dg.bfloat16), data_type=dg.float32), dg.float32, False),
    (lambda g, y: g.mul(g.cast(y, data_type=dg.bfloat16), y), dg.bfloat16, False),  # read past the cast too
    (lambda g, y: g.add(g.cast(y, data_type=dg.bfloat16), y), dg.bfloat16, False),
], ids=["cast_bf16", "cast_bf16_fp16", "cast_fp8", "cast_fp32", "cast_bf16_fp32", "cast_and_mul", "cast_and_add"])
def test_a_virtual_gelu_only_cast_to_a_narrow_stored_type_takes_the_16_bit_math(then, out_type, fast):
    g, _, y = _matmul_gelu(out_type, then=then, store_gelu=False)
    assert y.data_type == dg.float32  # the intermediate type: the rounding is the cast's
    assert fast_math_outputs(_anchored_group(g)) == (frozenset({y.uid}) if fast else frozenset())


def test_a_stored_gelu_read_by_a_cast_keeps_the_precise_math():
    # stored in bf16 and cast to fp16 for a second output: the cast reads the stored value
    g, _, y = _matmul_gelu(dg.bfloat16, then=_cast_to(dg.float16))
    assert fast_math_outputs(_anchored_group(g)) == frozenset()


def test_a_gelu_also_stored_in_fp32_keeps_the_precise_math():
    # a second output: the fp32 one shows the value unrounded, whatever its bf16 cast does
    g, _, y = _matmul_gelu(dg.float32)
    g.cast(y, data_type=dg.bfloat16).set_output(True)
    assert fast_math_outputs(_anchored_group(g)) == frozenset()


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_matmul_with_gelu_cast_to_bf16_matches_the_reference(op):
    g, handles, _ = _matmul_gelu(dg.bfloat16, op, then=_cast_to(dg.bfloat16), store_gelu=False)
    (stored,) = g.outputs()
    inputs = _inputs(handles)
    g.build()
    assert f"tm.{op}_fast(" in g.plan.launches[0].source_path.read_text()
    _check_within_an_ulp(g, inputs, stored, torch.bfloat16, _gemm_accumulation(inputs, handles))


def test_a_blended_16_bit_gelu_takes_the_16_bit_math():
    # alpha * gelu + beta * prior may cancel, but the float32 forms' error cancels as much
    # (test_a_cancelling_blend_stays_within_float32_math_of_the_reference checks the numbers)
    g, _, y = _matmul_gelu(dg.bfloat16)
    y.set_blend(alpha=1.0, beta=-1.0)
    assert fast_math_outputs(_anchored_group(g)) == frozenset({y.uid})


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_the_decision_is_made_at_build_from_the_graph_alone(op):
    """Nothing carries it but the graph: a JSON round trip decides as the original, and two graphs
    differing only in the output's type, built in one process (one kernel cache), get each its
    own kernel, named by content."""
    sources = {}
    for out_type in (dg.bfloat16, dg.float32, dg.bfloat16):
        g, _, _ = _matmul_gelu(out_type, op)
        g = dg.Graph.from_json(g.to_json())
        g.build()
        (launch,) = g.plan.launches
        source = launch.source_path.read_text()
        assert (f"tm.{op}_fast(" in source) == (out_type != dg.float32)
        sources.setdefault(out_type.name, set()).add((launch.source_path.name, source))
    assert len(sources["bfloat16"]) == 1  # the same graph twice: one kernel
    assert sources["bfloat16"].isdisjoint(sources["float32"])


def test_a_pointwise_gelu_keeps_the_precise_math():
    g = dg.Graph(name="pw", io_data_type=dg.bfloat16)
    y = g.gelu(g.tensor(name="x", dim=[7, 9]))
    y.set_output(True)
    (group,) = partition(g, registry.families())
    assert fast_math_outputs(group) == frozenset()
    g.build()
    assert "gelu_fast" not in g.plan.launches[0].source_path.read_text()


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("out_type", [dg.bfloat16, dg.float32])
def test_the_triton_backend_renders_the_decision(op, out_type):
    g, _, _ = _matmul_gelu(out_type, op)
    g.build()
    source = g.plan.launches[0].source_path.read_text()
    fast = out_type != dg.float32
    assert (f"tm.{op}_fast(" in source) == fast
    assert (f"tm.{op}(" in source) == (not fast)


@pytest.mark.parametrize("out_type,cast", [(dg.bfloat16, False), (dg.float16, False), (dg.float32, False),
                                           (dg.bfloat16, True), (dg.float32, True)],
                         ids=["bf16", "fp16", "fp32", "fp32_cast_to_bf16", "fp32_cast_to_fp32"])
def test_the_gluon_backend_renders_the_decision(out_type, cast):
    from gluon_cases import lowered  # tests/backends: gluon launches lowered without a GPU
    for op in ("gelu", "gelu_tanh"):
        if cast:  # the GELU an fp32 intermediate, cast to out_type as it is stored
            g, _, _ = _matmul_gelu(out_type, op, m=64, n=64, k=64, then=_cast_to(out_type), store_gelu=False)
        else:
            g, _, _ = _matmul_gelu(out_type, op, m=64, n=64, k=64)
        (launch,) = lowered(g)
        source = launch.source_path.read_text()
        fast = out_type != dg.float32
        assert (f"lib.{op}_fast(" in source) == fast
        assert (f"lib.{op}(" in source) == (not fast)


# -- kernels against the reference ----------------------------------------------------------------

def _inputs(handles, tail_scale=4.0):
    a, b, bias = handles
    transposed = a.stride[0] == 1  # [m, k] as the transpose of a dense [k, m]
    return {a: torch.randn(list(reversed(a.dim))).to(torch.bfloat16).t() if transposed else
            torch.randn(a.dim).to(torch.bfloat16),
            b: torch.randn(b.dim).to(torch.bfloat16),
            # wide enough to reach far into the negative tail (pre-activations down to about -40)
            bias: (torch.randn(bias.dim) * tail_scale).to(torch.bfloat16)}


def _accumulated(combine, x, w, bias, terms: int):
    """(the pre-activation combine(x, w) + bias in float64, a bound on a kernel's float32 error in
    it): (terms + 1) FLOAT32_EPS (sum |x| |w| + |bias|), Higham's bound for a sum of `terms`
    exact products (16-bit operands multiply exactly in float32) and the bias, with eps rather
    than the unit roundoff because tensor cores truncate their sums. A value near zero that
    cancels in float32 keeps only this absolute accuracy: the GELU cannot give it back."""
    x, w, bias = (t.detach().cpu().double() for t in (x, w, bias))
    exact = combine(x, w) + bias
    magnitude = combine(x.abs(), w.abs()) + bias.abs()
    return exact, (terms + 1) * FLOAT32_EPS * magnitude


def _gemm_accumulation(inputs, handles):
    """_accumulated for y = op(a @ b + bias) (_matmul_gelu's graph)."""
    a, b, bias = handles
    return _accumulated(torch.matmul, inputs[a], inputs[b], inputs[bias], terms=a.dim[-1])


def _worst(misses, got, want, allowed, pre_activation, dtype) -> str:
    """The element of `misses` farthest outside `allowed`, for an assertion's message."""
    excess = torch.where(misses, (got - want).abs() / allowed, -1.0).nan_to_num(nan=float("inf"))
    index = tuple(torch.unravel_index(excess.argmax(), got.shape))
    spacing = _spacing(want[index], dtype).item()
    return (f"{int(misses.sum())} elements outside; worst at {[int(i) for i in index]}: got {got[index].item()!r}, "
            f"want {want[index].item()!r} ({(got[index] - want[index]).item() / spacing:.3g} ulps, "
            f"allowed {allowed[index].item() / spacing:.3g}), pre-activation {pre_activation[index].item()!r}")


def _an_ulp_and_the_accumulation(want, error, dtype):
    """How far a GELU output rounded to `dtype` may lie from the float64 value `want` when its
    pre-activation is off by up to `error`: GELU_SLOPE times that, and one ulp at the value so
    moved (the output's rounding, and the reference's where it is rounded as stored)."""
    moved = GELU_SLOPE * error
    return _spacing(want.abs() + moved, dtype) + moved


def _executed(g, inputs, y, device):
    """y as g computes it from `inputs`, into a poisoned buffer, on the host as float64."""
    out = poisoned(y, device)
    g.execute({**{t.name: v for t, v in inputs.items()}, y.name: out})  # by name: `inputs` may be another graph's
    return out.cpu().double()


def _check_within_an_ulp(g, inputs, y, dtype, accumulation, device="cpu"):
    """Each element within one `dtype` ulp of the float64 reference, and as much more as the
    kernel's float32 accumulation error (`accumulation`: the pre-activation and its bound, as
    _accumulated gives them) moves the GELU (GELU_SLOPE times it): the matmul's own error is
    no fault of the GELU math (test_the_fast_math_is_within_an_ulp_of_the_precise_math checks
    that alone). NaN where the reference is NaN. Below TAIL in magnitude the reference itself
    has cancelled (0.5 x (1 + erf) in float64: no digit left past x = -8), so there the output
    need only be as small."""
    out = _executed(g, inputs, y, device)
    ref = g.reference({k: v.cpu() for k, v in inputs.items()})[y.name]
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    pre_activation, error = accumulation
    allowed = _an_ulp_and_the_accumulation(ref, error.expand(ref.shape), dtype)
    finite = ~torch.isnan(ref)
    head = finite & (ref.abs() >= TAIL)
    near = (out == ref) | ((out - ref).abs() <= allowed)  # inf == inf
    misses = head & ~near
    assert not misses.any(), _worst(misses, out, ref, allowed, pre_activation.expand(ref.shape), dtype)
    assert (out.abs()[finite & ~head] <= 2 * TAIL).all()


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("out_type", [dg.bfloat16, dg.float16])
@pytest.mark.parametrize("transposed_a", [False, True])
def test_matmul_with_16_bit_gelu_matches_the_reference(op, out_type, transposed_a):
    g, handles, y = _matmul_gelu(out_type, op, m=37, n=24, k=40, transposed_a=transposed_a)
    inputs = _inputs(handles)
    check(g, inputs, dtype=out_type.torch_dtype)
    _check_within_an_ulp(g, inputs, y, out_type.torch_dtype, _gemm_accumulation(inputs, handles))


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_a_split_k_plan_renders_the_decision_in_the_kernel_that_applies_the_epilogue(op):
    """Partial products in one kernel, the combine and the epilogue in another: the decision
    reaches every kernel of the plan, and the numbers stay within an ulp."""
    from dnngraph.backends.triton.heuristics import matmul as mm
    g, handles, y = _matmul_gelu(dg.bfloat16, op, m=37, n=24, k=40)
    g.build(options=dg.BuildOptions(matmul_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3)))
    sources = [launch.source_path.read_text() for launch in g.plan.launches]
    assert len(sources) == 2
    assert [f"tm.{op}_fast(" in source for source in sources].count(True) == 1
    assert not any(f"tm.{op}(" in source for source in sources)
    inputs = _inputs(handles)
    _check_within_an_ulp(g, inputs, y, torch.bfloat16, _gemm_accumulation(inputs, handles))


def test_a_gelu_a_row_exit_reads_keeps_the_precise_math():
    # stored in bf16 and summed along its rows in the same kernel: the sum reads the value
    g, _, y = _matmul_gelu(dg.bfloat16, then=lambda g, y: g.reduction(y, mode="sum", axes=[1]))
    group = _anchored_group(g)
    assert group.exits and fast_math_outputs(group) == frozenset()


@pytest.mark.parametrize("out_type", [dg.float8_e4m3, dg.float8_e5m2])
def test_matmul_with_gelu_stored_in_fp8_matches_the_reference(out_type):
    g, handles, y = _matmul_gelu(out_type, "gelu_tanh", m=37, n=24, k=40)
    inputs = _inputs(handles, tail_scale=2.0)  # within e4m3's 448
    g.build()
    assert "tm.gelu_tanh_fast(" in g.plan.launches[0].source_path.read_text()
    _check_within_an_ulp(g, inputs, y, out_type.torch_dtype, _gemm_accumulation(inputs, handles))


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_a_cancelling_blend_stays_within_float32_math_of_the_reference(op):
    """y = gelu - prior with prior the fp16 rounding of the true gelu: the stored difference is
    the rounding residue, so the whole error of the gelu shows. Integer operands make the matmul
    exact, leaving the gelu's own error, which must stay within RELATIVE_HEAD of the gelu (what
    the float32 forms achieve; pre-activations from -8 up) plus the result's fp16 rounding."""
    g, (a, b, bias), y = _matmul_gelu(dg.float16, op, m=19, n=24, k=8)
    y.set_blend(alpha=1.0, beta=-1.0)
    integers = lambda t, low, high: torch.randint(low, high, t.dim).to(torch.bfloat16)
    inputs = {a: integers(a, -2, 3), b: integers(b, -1, 2), bias: integers(bias, -4, 5)}
    pre_activation = inputs[a].double() @ inputs[b].double() + inputs[bias].double()  # exact
    exact = _true(pre_activation, tanh=op == "gelu_tanh")  # g.reference rounds an output as stored
    prior = exact.to(torch.float16)
    out = prior.clone()
    g.build()
    assert f"tm.{op}_fast(" in g.plan.launches[0].source_path.read_text()
    g.execute({**inputs, y: out})
    want = exact - prior.double()
    bound = RELATIVE_HEAD * exact.abs() + _spacing(want, torch.float16)
    assert ((out.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_matmul_with_16_bit_gelu_passes_nan_and_inf_as_the_reference(op):
    g, handles, y = _matmul_gelu(dg.bfloat16, op, m=5, n=8, k=8)
    inputs = _inputs(handles)
    bias = inputs[handles[2]]
    bias[0, 0], bias[0, 1], bias[0, 2] = float("nan"), float("inf"), -float("inf")
    g.build()
    _check_within_an_ulp(g, inputs, y, torch.bfloat16, _gemm_accumulation(inputs, handles))


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_conv_with_16_bit_gelu_matches_the_reference(op):
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 6, 7, 5])
    w = g.tensor(name="w", dim=[10, 6, 3, 3])
    bias = g.tensor(name="bias", dim=[1, 10, 1, 1])
    y = getattr(g, op)(g.add(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]), bias))
    y.set_output(True)
    assert fast_math_outputs(_anchored_group(g)) == frozenset({y.uid})
    inputs = {x: torch.randn(x.dim).to(torch.bfloat16), w: torch.randn(w.dim).to(torch.bfloat16),
              bias: (torch.randn(bias.dim) * 6).to(torch.bfloat16)}
    check(g, inputs, dtype=torch.bfloat16)
    assert f"tm.{op}_fast(" in g.plan.launches[-1].source_path.read_text()
    convolved = lambda x, w: torch.nn.functional.conv2d(x, w, padding=1)
    _check_within_an_ulp(g, inputs, y, torch.bfloat16, _accumulated(convolved, inputs[x], inputs[w], inputs[bias],
                                                                     terms=6 * 3 * 3))


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
def test_conv_dgrad_with_16_bit_gelu_in_channels_last_matches_the_reference(op):
    # the data gradient's implicit GEMM, NHWC strides, a stride-2 forward: the same decision
    g = dg.Graph(name="dgrad", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    dy = g.tensor(name="dy", dim=[2, 10, 4, 3], stride=[120, 1, 30, 10])
    w = g.tensor(name="w", dim=[10, 6, 3, 3])
    bias = g.tensor(name="bias", dim=[1, 6, 1, 1])
    dx = g.conv_dgrad(dy, w, x_dim=[2, 6, 7, 5], padding=[1, 1], stride=[2, 2], dilation=[1, 1])
    y = getattr(g, op)(g.add(dx, bias))
    y.set_output(True)
    assert fast_math_outputs(_anchored_group(g)) == frozenset({y.uid})
    inputs = {dy: torch.randn(2, 4, 3, 10).to(torch.bfloat16).permute(0, 3, 1, 2),
              w: torch.randn(w.dim).to(torch.bfloat16), bias: (torch.randn(bias.dim) * 6).to(torch.bfloat16)}
    check(g, inputs, dtype=torch.bfloat16)
    assert f"tm.{op}_fast(" in g.plan.launches[-1].source_path.read_text()
    # the data gradient is the forward's transpose; each element sums at most 10 x 3 x 3 products
    transposed = lambda dy, w: torch.nn.functional.conv_transpose2d(dy, w, stride=2, padding=1)
    _check_within_an_ulp(g, inputs, y, torch.bfloat16, _accumulated(transposed, inputs[dy], inputs[w], inputs[bias],
                                                                     terms=10 * 3 * 3))


def test_depthwise_conv_with_16_bit_gelu_matches_the_reference():
    # one channel per group: the direct depthwise kernel renders the epilogue, with the same decision
    g = dg.Graph(name="depthwise", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 5, 9, 7])
    w = g.tensor(name="w", dim=[5, 1, 3, 3])
    bias = g.tensor(name="bias", dim=[1, 5, 1, 1])
    y = g.gelu_tanh(g.add(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=5), bias))
    y.set_output(True)
    inputs = {x: torch.randn(x.dim).to(torch.bfloat16), w: torch.randn(w.dim).to(torch.bfloat16),
              bias: (torch.randn(bias.dim) * 6).to(torch.bfloat16)}
    check(g, inputs, dtype=torch.bfloat16)
    source = g.plan.launches[-1].source_path.read_text()
    assert "depthwise" in g.explain() and "tm.gelu_tanh_fast(" in source
    convolved = lambda x, w: torch.nn.functional.conv2d(x, w, padding=1, groups=5)
    _check_within_an_ulp(g, inputs, y, torch.bfloat16, _accumulated(convolved, inputs[x], inputs[w], inputs[bias],
                                                                     terms=3 * 3))


# -- the GELU math apart from the GEMM's accumulation, on the interpreter and on the GPU ----------------

ON_THE_GPU = [pytest.param("cuda", ("triton",), marks=pytest.mark.gpu, id="cuda-triton"),
              pytest.param("cuda", ("gluon",), marks=pytest.mark.gpu, id="cuda-gluon")]


def _sized_gemm_gelu(out_type, op, device, backends):
    """_matmul_gelu's graph built for `backends`: on the GPU M and N off the tiles (TMA-legal rows
    for gluon, the Gluon kernel where the GPU is sm_90), small on the interpreter."""
    if "gluon" in backends and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("gluon kernels are built for sm_90a")
    m, n, k = (300, 264, 136) if device == "cuda" else (37, 24, 40)
    g, handles, y = _matmul_gelu(out_type, op, m=m, n=n, k=k)
    g.build(options=dg.BuildOptions(backends=backends))
    assert {launch.backend for launch in g.plan.launches} == {backends[0]}
    return g, handles, y


@contextlib.contextmanager
def _precise_math_only(monkeypatch):
    """Builds inside take the float32 forms for every GELU (FAST_MATH_OPS emptied). The plan
    cache is cleared on the way in and out: its key holds the graph, not this table
    (runtime/plan_cache.py), so no plan may cross the change."""
    with monkeypatch.context() as patch:
        patch.setattr(problems_base, "FAST_MATH_OPS", frozenset())
        plan_cache.clear()
        try:
            yield
        finally:
            plan_cache.clear()


def _accumulation_order(g) -> list:
    """What fixes the order of each launch's float32 sums: its backend, config, warps, stages,
    grid and multiply-add contraction."""
    return [(launch.backend, launch.config_text, launch.num_warps, launch.num_stages, launch.programs,
             launch.fp_fusion) for launch in g.plan.launches]


@pytest.mark.parametrize("device,backends", [("cpu", ("triton",))] + ON_THE_GPU)
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("out_type", [dg.bfloat16, dg.float16])
def test_the_fast_math_is_within_an_ulp_of_the_precise_math(device, backends, op, out_type, monkeypatch):
    """The same GEMM built twice, with the 16-bit math and with the float32 forms, at the same
    config: one order of float32 sums gives both the same pre-activation, so their outputs
    differ by the GELU math alone. Each form is within a few 1e-5 of the value (2^-19 on the
    interpreter; the GPU's erf and tanh cancel a little near -3) and rounds once: at most one
    ulp apart (a value near a rounding boundary may round either way). Below HEAD_FROM the
    float32 forms keep no digit: there test_fast_gelu_is_as_close_as_float32_math_at_every_magnitude
    and the float64 reference judge the tail."""
    dtype = out_type.torch_dtype
    g, handles, y = _sized_gemm_gelu(out_type, op, device, backends)
    with _precise_math_only(monkeypatch):
        precise_graph, _, _ = _sized_gemm_gelu(out_type, op, device, backends)
    assert f"{op}_fast(" in g.plan.launches[0].source_path.read_text()
    precise_source = precise_graph.plan.launches[0].source_path.read_text()
    assert f".{op}(" in precise_source and f"{op}_fast(" not in precise_source
    assert _accumulation_order(precise_graph) == _accumulation_order(g)
    inputs = {t: v.to(device) for t, v in _inputs(handles).items()}
    fast, precise = _executed(g, inputs, y, device), _executed(precise_graph, inputs, y, device)
    assert torch.equal(torch.isnan(fast), torch.isnan(precise)) and not torch.isnan(fast).any()
    pre_activation, _ = _gemm_accumulation(inputs, handles)
    head = pre_activation >= HEAD_FROM
    assert head.double().mean() > 0.5  # most of the output is judged
    allowed = _spacing(torch.maximum(fast.abs(), precise.abs()), dtype)
    misses = head & (fast - precise).abs().gt(allowed)
    assert not misses.any(), _worst(misses, fast, precise, allowed, pre_activation, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backends", [("triton",), ("gluon",)], ids=["triton", "gluon"])
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("out_type", [dg.bfloat16, dg.float16, dg.float32])
def test_gemm_gelu_on_the_gpu_is_within_an_ulp(backends, op, out_type):
    """Against the float64 reference: an ulp and the float32 accumulation's bound
    (_check_within_an_ulp); float32 outputs keep the precise math."""
    g, handles, y = _sized_gemm_gelu(out_type, op, "cuda", backends)
    inputs = {t: v.cuda() for t, v in _inputs(handles).items()}
    source = g.plan.launches[0].source_path.read_text()
    assert (f"{op}_fast(" in source) == (out_type != dg.float32)
    if out_type == dg.float32:
        check(g, inputs, dtype=torch.float32, device="cuda", tolerance=1e-5)
    else:
        _check_within_an_ulp(g, inputs, y, out_type.torch_dtype, _gemm_accumulation(inputs, handles), device="cuda")


# -- through torch.compile -------------------------------------------------------------------------

@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_torch_compile_of_a_bf16_linear_gelu_takes_the_16_bit_math(approximate, monkeypatch):
    """nn.Linear + nn.GELU in bf16 through backend="dnngraph": one matmul kernel whose GELU takes
    the cheaper math, within one bf16 ulp (and the accumulation's bound) of the float64 value of
    the same math, and as close to eager as eager's own rounding of the linear's output allows."""
    from test_torch_backend import _built_groups, _compiled, _recorded_modules
    from helpers import rel_err
    modules = _recorded_modules(monkeypatch)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.GELU(approximate=approximate)).to(torch.bfloat16)
    x = torch.randn(37, 40).to(torch.bfloat16) * 4
    with torch.no_grad():
        out = _compiled(model)(x)
        eager = model(x)
    (group,) = _built_groups(modules)
    assert group.anchor.op == "matmul" and len(fast_math_outputs(group)) == 1
    linear = model[0]
    pre_activation, error = _accumulated(lambda x, w: x @ w.t(), x, linear.weight, linear.bias, terms=40)
    true = _true(pre_activation, tanh=approximate == "tanh")
    allowed = _an_ulp_and_the_accumulation(true, error, torch.bfloat16)
    misses = (out.double() - true).abs() > allowed
    assert not misses.any(), _worst(misses, out.double(), true, allowed, pre_activation, torch.bfloat16)
    assert rel_err(out, eager) < 1e-2
