"""sdpa_fp8 and sdpa_fp8_backward (ops/sdpa_fp8.py) against the float64 reference, which rounds P,
dS and the outputs where the kernels do: float32 outputs agree to float32 accuracy, fp8 outputs
code for code but for a few neighbours (a float32 sum in another order may land across a
rounding boundary)."""
import math

import pytest
import torch

import dnngraph as dg
from helpers import poisoned

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BACKWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                   "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
# float32 outputs: the kernels' float32 sums against float64. On the GPU the fp8 tensor cores may
# accumulate with fewer bits than float32 and exp2 is approximate: a P or dS landing beside a
# rounding boundary then takes the neighbouring code (a share f of them, each off by an fp8 step
# of ~6%, moves a sum of many keys by about 0.06 sqrt(f): 2e-3 at f = 1e-3), still far below
# what a misplaced rounding point gives (fp8's own ~3%). fp8 outputs: the share of codes one
# step off.
# The GPU's fp8 tensor-core products accumulate with fewer bits than float32 (Hopper keeps about
# 14 to 22 of them between the MMA's partial sums), so GPU results differ from the float64
# reference by accumulation noise: 5.8e-3 and 6.8e-3 of the norm measured on an H200 (2026-11-28).
FLOAT_TOLERANCE = {"cpu": 1e-5, "cuda": 1.5e-2}
FP8_FLIPS = {"cpu": 0.002}
# On the GPU an fp8 output is judged by value (fp8_value_error), against the reference's own fp8
# codes. Two sources move a GPU code off the reference's: a P or dS rounded to fp8 beside a
# rounding boundary, which the GPU's shorter fp8 accumulation and approximate exp2 put on the
# other side (each such flip moves o by P_ij v_j times one fp8 step of P, 2^-3 of it in e4m3),
# and the output's own rounding of a value that noise moved across a boundary (one step, at most
# 2^-3 of the value in e4m3, 2^-2 in e5m2). So:
# * in norm, |got - want| / |want| <= FP8_NORM_BOUND (half the largest relative step): one-step
#   flips of a tenth of o's codes measured 0.030 of the norm in e4m3 and 0.063 in e5m2, of every
#   code 0.094 and 0.196 (B1 H2 S200 D64), so about two codes in five may flip; the float32
#   outputs of the same kernels were 5.8e-3 and 6.8e-3 off on an H200, which flips far fewer. A
#   dropped scale (0.5 at a factor of 2), a partly missing 1/l normalization or unwritten rows
#   move the norm by tens of percent and fail (test_fp8_value_criterion_catches_broken_outputs);
# * per element, |got - want| <= FP8_ELEMENT_STEPS fp8 steps at the largest |want|: a flipped P near
#   1 moves o by about one step of the largest value and the output's rounding by one more. Near
#   zero a code step is tiny (and -0 against +0 is 128 codes away), hence the largest, not each.
FP8_NORM_BOUND = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
FP8_ELEMENT_STEPS = 2


def fp8_values(shape, dtype, seed: int, device="cpu", spread: float = 4.0):
    """Random fp8 values (never all zero), generated in float32 and rounded."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * spread).to(dtype).to(device)


def scale_tensors(values: dict, device="cpu") -> dict:
    return {name: torch.tensor([float(v)], device=device).view(1, 1, 1, 1) for name, v in values.items()}


def top_power(dtype) -> float:
    """The largest power of two the fp8 type holds: P * scale_s below its max, and P = 1 times it
    and the descale exact, so no float32 product lands beside an exact rounding tie (a row that
    sees one key has P = 1: with scale_s = 57344, e5m2's max, O * scale_o fell on ties
    that float32 and float64 break apart)."""
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max))


def forward_scales(dtype, top=None) -> dict:
    top = top or top_power(dtype)
    return {"descale_q": 0.25, "descale_k": 0.5, "descale_v": 0.75, "descale_s": 1.0 / top, "scale_s": top,
            "scale_o": 3.0}


def backward_scales(dtype) -> dict:
    top = top_power(dtype)
    return {"descale_q": 0.25, "descale_k": 0.5, "descale_v": 0.75, "descale_o": 1.0 / 3.0, "descale_dO": 0.125,
            "descale_s": 1.0 / top, "descale_dP": 1.0 / 64, "scale_s": top, "scale_dQ": 0.5, "scale_dK": 0.5,
            "scale_dV": 2.0, "scale_dP": 64.0}


def forward_graph(q, k, v, causal=False, is_inference=False, o_type=None, attn_scale=None):
    """(graph, bindings without scales): q, k, v declared like the given tensors, every output marked."""
    g = dg.Graph(name="fp8 attention")
    tq, tk, tv = (g.tensor_like(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
    scales = [g.tensor(name=name, dim=[1, 1, 1, 1], data_type=dg.float32) for name in FORWARD_SCALES]
    outputs = g.sdpa_fp8(tq, tk, tv, *scales, is_inference=is_inference, attn_scale=attn_scale,
                         use_causal_mask=causal)
    for tensor in outputs:
        if tensor is not None:
            tensor.set_output(True)
    if o_type is not None:
        outputs[0].set_data_type(o_type)
    return g, {"q": q, "k": k, "v": v}


def backward_graph(tensors: dict, causal=False, grad_type=None):
    g = dg.Graph(name="fp8 attention backward")
    handles = [g.tensor_like(tensors[name], name) for name in ("q", "k", "v", "o", "dO", "stats")]
    scales = [g.tensor(name=name, dim=[1, 1, 1, 1], data_type=dg.float32) for name in BACKWARD_SCALES]
    outputs = g.sdpa_fp8_backward(*handles, *scales, use_causal_mask=causal)
    for tensor in outputs:
        tensor.set_output(True)
    if grad_type is not None:
        for tensor in outputs[:3]:
            tensor.set_data_type(grad_type)
    return g


def execute(g, bindings: dict, device="cpu", options=None) -> dict:
    """The graph's outputs (poisoned first) after one execute on a workspace of NaN bytes (0xFF is
    NaN in every float type, fp8 included): a kernel reading workspace bytes no launch wrote
    (a keys-minor copy's padding, say) gives NaN here, as uninitialised memory may on a GPU.
    `options`: BuildOptions of the build (target=H200: the GPU's tiles, run interpreted on CPU)."""
    if g.plan is None:
        g.build(options=options)
    outputs = {t.name: poisoned(t, device) for t in g.outputs()}
    workspace = torch.full((g.plan.workspace_size(),), 0xFF, dtype=torch.uint8, device=device)
    g.execute({**bindings, **outputs}, workspace)
    return outputs


def fp8_step(magnitude: float, fp8) -> float:
    """The spacing of fp8 codes at `magnitude` (normal range; the subnormals' below it)."""
    mantissa_bits = 3 if fp8 is E4M3 else 2
    smallest_normal = torch.finfo(fp8).smallest_normal
    return 2.0 ** (math.floor(math.log2(max(magnitude, smallest_normal))) - mantissa_bits)


def fp8_value_error(out: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when fp8 output `out` is within FP8_NORM_BOUND of the float64 reference `ref` in norm
    and FP8_ELEMENT_STEPS steps at the largest |ref| per element (NaN positions already checked
    equal); else what broke it, the worst element's value, reference, bound and index."""
    fp8 = out.dtype
    got, want = out.double(), ref.to(fp8).double()  # the reference rounds its outputs already
    finite = torch.isfinite(want)
    if not bool((got[~finite & ~torch.isnan(want)] == want[~finite & ~torch.isnan(want)]).all()):
        return "an infinity of the reference not matched"
    got, want = torch.where(finite, got, 0.0), torch.where(finite, want, 0.0)
    difference = (got - want).abs()
    if not bool(torch.isfinite(difference).all()):
        return "an infinity where the reference is finite"
    norm_error = difference.norm().item() / (want.norm().item() or 1.0)
    if norm_error > FP8_NORM_BOUND[fp8]:
        return f"relative L2 error {norm_error:.4g} past {FP8_NORM_BOUND[fp8]:.4g}"
    allowed = FP8_ELEMENT_STEPS * fp8_step(want.abs().max().item(), fp8)
    worst = int(difference.argmax())
    if difference.reshape(-1)[worst].item() > allowed:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape))
        return (f"value {got.reshape(-1)[worst].item():.6g} against the reference's "
                f"{want.reshape(-1)[worst].item():.6g} at {index}, allowed {allowed:.4g} "
                f"({FP8_ELEMENT_STEPS} steps at the largest value); relative L2 error {norm_error:.4g}")
    return ""


def assert_matches(outputs: dict, refs: dict, device="cpu"):
    """Every output against the reference: NaN where it is NaN, float32 ones to FLOAT_TOLERANCE,
    fp8 ones code for code but a FP8_FLIPS share of neighbours on the CPU, by value on the GPU
    (fp8_value_error); nothing left unwritten."""
    for name, out in outputs.items():
        ref = refs[name].cpu()
        out = out.cpu()
        assert torch.equal(torch.isnan(out.double()), torch.isnan(ref)), f"{name}: NaN where the reference has none"
        finite = ~torch.isnan(ref)
        if out.dtype in (E4M3, E5M2) and device != "cpu":
            problem = fp8_value_error(out, ref)
            assert not problem, f"{name}: {problem}"
            continue
        if out.dtype in (E4M3, E5M2):
            codes = out.view(torch.uint8).long()
            expected = ref.to(out.dtype).view(torch.uint8).long()
            steps = (codes - expected).abs()[finite]
            assert steps.max().item() <= 1 if steps.numel() else True, f"{name}: a code more than one step off"
            share = (steps > 0).double().mean().item() if steps.numel() else 0.0
            assert share <= FP8_FLIPS[device], f"{name}: {share:.3%} of codes one step off"
            continue
        # equal values (infinities too) are exact; the rest against the norm of the finite reference
        got = out.double()
        differ = finite & (got != ref)
        scale = torch.where(torch.isfinite(ref), ref, 0.0).norm().item() or 1.0
        err = (got[differ] - ref[differ]).norm().item() / scale
        assert err <= FLOAT_TOLERANCE[device], f"{name}: relative error {err:.3g}"


def forward_case(dtype, batch, heads, kv_heads, s_q, s_kv, dim, causal, o_type=None, device="cpu", seed=0,
                 options=None):
    q = fp8_values((batch, heads, s_q, dim), dtype, seed, device)
    k = fp8_values((batch, kv_heads, s_kv, dim), dtype, seed + 1, device)
    v = fp8_values((batch, kv_heads, s_kv, dim), dtype, seed + 2, device)
    g, bindings = forward_graph(q, k, v, causal, o_type=o_type)
    bindings.update(scale_tensors(forward_scales(dtype), device))
    outputs = execute(g, bindings, device, options)
    assert_matches(outputs, g.reference({n: t.cpu() for n, t in bindings.items()}), device)
    return outputs


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_value_criterion_catches_broken_outputs(dtype):
    """The GPU's criterion for fp8 outputs (fp8_value_error) passes the interpreter's o and o with
    a tenth of its codes one step off (what accumulation noise does), and fails o as kernels with
    a defect would give it: a scale dropped (o * scale_o at half scale_o), rows missing their 1/l
    normalization in part (scaled by 1.2 to 2), a row unwritten (0), one element three steps off."""
    o = forward_case(dtype, 1, 2, 2, 37, 45, 24, False)["sdpa_fp8.o"]
    q, k, v = (fp8_values(shape, dtype, seed) for shape, seed in (((1, 2, 37, 24), 0), ((1, 2, 45, 24), 1),
                                                                   ((1, 2, 45, 24), 2)))
    g, bindings = forward_graph(q, k, v)
    bindings.update(scale_tensors(forward_scales(dtype)))
    ref = g.reference(bindings)["sdpa_fp8.o"]
    assert fp8_value_error(o, ref) == ""
    codes = o.view(torch.uint8).clone()
    flipped = torch.rand(codes.shape, generator=torch.Generator().manual_seed(5)) < 0.1
    nudged = torch.where((codes & 0x7F) > 1, codes.int() + torch.where(codes % 2 == 0, 1, -1), codes.int())
    noisy = torch.where(flipped, nudged, codes.int()).to(torch.uint8).view(dtype)
    assert fp8_value_error(noisy, ref) == ""
    rows = 1.2 + 0.8 * torch.rand(o.shape[:3] + (1,), generator=torch.Generator().manual_seed(6))
    unwritten = o.double().clone()
    unwritten[0, 1, 7] = 0.0
    broken = {"scale dropped": o.double() / 2, "1/l missing in part": o.double() * rows, "a row unwritten": unwritten}
    for defect, value in broken.items():
        assert "relative L2 error" in fp8_value_error(value.to(dtype), ref), defect
    one_off = o.double().clone()
    largest = ref.abs().max().item()
    one_off[0, 0, 3, 5] = ref[0, 0, 3, 5] + 3 * fp8_step(largest, dtype)
    problem = fp8_value_error(one_off.to(dtype), ref)
    assert "at (0, 0, 3, 5)" in problem and "allowed" in problem, problem


# --- forward ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_matches_reference(dtype, causal):
    forward_case(dtype, 2, 4, 2, 37, 45, 24, causal)  # GQA (2 query heads per k/v head), odd sizes


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_blocks_seen_whole_and_masked(causal):
    """Sequences past one interpreter tile (64): the key blocks every row of a query tile sees
    whole run without the mask, the rest (the diagonal, the keys' ragged end) with it; both walks
    of the forward. o in fp8, compared code for code but a few neighbours: at these lengths some P
    lands beside an fp8 rounding boundary, where float32 and float64 pick different codes (a
    float32 o then moved 1.2e-4 of its norm, before and after the split alike)."""
    forward_case(E4M3, 1, 2, 1, 150, 170, 16, causal)
    forward_case(E5M2, 1, 1, 1, 131, 129, 16, causal)


@pytest.mark.parametrize("o_type", [dg.float32, dg.bfloat16, dg.float8_e5m2], ids=["f32", "bf16", "e5m2"])
def test_forward_output_types(o_type):
    """o stored in another type: float32 shows the quantized P times v to float32 accuracy."""
    forward_case(E4M3, 1, 2, 1, 33, 70, 16, True, o_type=o_type)


def test_forward_fp8_max_scales_float32_output():
    """scale_s at the type's max (not a power of two, the frontend's samples' choice), o in float32:
    quantized P times v to float32 accuracy."""
    q = fp8_values((1, 2, 31, 16), E5M2, 40)
    k = fp8_values((1, 1, 26, 16), E5M2, 41)
    g, bindings = forward_graph(q, k, k, causal=True, o_type=dg.float32)
    bindings.update(scale_tensors(forward_scales(E5M2, torch.finfo(E5M2).max)))
    assert_matches(execute(g, bindings), g.reference(bindings))


def test_forward_more_queries_than_keys_and_size_one_axes():
    forward_case(E4M3, 1, 1, 1, 50, 1, 16, True)  # every row sees key 0 alone: P = 1
    forward_case(E4M3, 1, 3, 3, 1, 33, 8, False)


def test_forward_strided_bshd_layout():
    """q, k, v and o stored [B, S, H, D] (BSHD: a stride choice), outputs poisoned."""
    dtype = E4M3
    q = fp8_values((2, 29, 4, 32), dtype, 3).transpose(1, 2)
    k = fp8_values((2, 40, 2, 32), dtype, 4).transpose(1, 2)
    v = fp8_values((2, 40, 2, 32), dtype, 5).transpose(1, 2)
    g, bindings = forward_graph(q, k, v, causal=True)
    assert list(g.outputs()[0].stride) == [29 * 4 * 32, 32, 4 * 32, 1]  # o follows q's layout
    bindings.update(scale_tensors(forward_scales(dtype)))
    assert_matches(execute(g, bindings), g.reference(bindings))


def test_forward_broadcast_kv_and_infinity():
    """k and v broadcast over the batch (stride 0); an infinity in e5m2 v reaches o and amax_o
    as in the reference (inf, or NaN where a P rounds to 0)."""
    q = fp8_values((3, 2, 19, 16), E4M3, 50)
    k = fp8_values((1, 1, 23, 16), E4M3, 51).expand(3, 1, 23, 16)
    g, bindings = forward_graph(q, k, k, causal=True)
    bindings.update(scale_tensors(forward_scales(E4M3)))
    assert_matches(execute(g, bindings), g.reference(bindings))
    q, k, v = (fp8_values((1, 2, 9 + i, 16), E5M2, 52 + i) for i in range(3))
    v = fp8_values((1, 2, 10, 16), E5M2, 55)
    v[0, 0, 4, 2] = float("inf")
    g, bindings = forward_graph(q, k[:, :, :10], v, o_type=dg.float32)
    bindings.update(scale_tensors(forward_scales(E5M2)))
    outputs = execute(g, bindings)
    assert torch.isinf(outputs["sdpa_fp8.o"][0, 0, :, 2]).any() and math.isinf(outputs["sdpa_fp8.amax_o"].item())
    assert_matches(outputs, g.reference(bindings))


def test_forward_amax_and_stats_values():
    """amax_s is the largest probability (1 where a row sees one key), amax_o the largest |O|."""
    q = fp8_values((1, 2, 20, 16), E4M3, 6)
    k = fp8_values((1, 2, 30, 16), E4M3, 7)
    v = fp8_values((1, 2, 30, 16), E4M3, 8)
    g, bindings = forward_graph(q, k, v, causal=True, o_type=dg.float32)
    bindings.update(scale_tensors(forward_scales(E4M3)))
    outputs = execute(g, bindings)
    assert outputs["sdpa_fp8.amax_s"].item() == 1.0
    o = outputs["sdpa_fp8.o"] / forward_scales(E4M3)["scale_o"]
    assert math.isclose(outputs["sdpa_fp8.amax_o"].item(), o.abs().max().item(), rel_tol=1e-6)
    assert torch.isfinite(outputs["sdpa_fp8.stats"]).all()


def test_forward_is_inference_has_no_stats():
    q = fp8_values((1, 1, 17, 16), E4M3, 9)
    k = fp8_values((1, 1, 17, 16), E4M3, 10)
    g, bindings = forward_graph(q, k, k, is_inference=True)
    assert [t.name for t in g.outputs()] == ["sdpa_fp8.o", "sdpa_fp8.amax_s", "sdpa_fp8.amax_o"]
    bindings.update(scale_tensors(forward_scales(E4M3)))
    assert_matches(execute(g, bindings), g.reference(bindings))


def test_forward_nan_in_q_propagates():
    """A NaN in q makes its row's o NaN and both amaxes NaN, as torch's softmax and amax do."""
    q = fp8_values((1, 2, 19, 16), E4M3, 11)
    q[0, 1, 7, 3] = float("nan")
    k = fp8_values((1, 2, 21, 16), E4M3, 12)
    v = fp8_values((1, 2, 21, 16), E4M3, 13)
    g, bindings = forward_graph(q, k, v)
    bindings.update(scale_tensors(forward_scales(E4M3)))
    outputs = execute(g, bindings)
    assert torch.isnan(outputs["sdpa_fp8.o"].float()[0, 1, 7]).all()
    assert not torch.isnan(outputs["sdpa_fp8.o"].float()[0, 0]).any()
    assert math.isnan(outputs["sdpa_fp8.amax_s"].item()) and math.isnan(outputs["sdpa_fp8.amax_o"].item())
    assert_matches(outputs, g.reference(bindings))


def test_forward_row_of_minus_infinity_scores_is_nan():
    """A row whose visible scores are all -inf (an e5m2 -inf in q against positive keys) has no
    softmax: o is NaN there as torch's softmax makes it (the kernel gave 0, as for a row that
    sees no key), stats -inf; the other rows are untouched."""
    q = fp8_values((1, 2, 5, 16), E5M2, 42)
    k = fp8_values((1, 1, 7, 16), E5M2, 43).abs()
    q[0, 1, 2] = 0.0
    q[0, 1, 2, 0] = float("-inf")
    g, bindings = forward_graph(q, k, k, o_type=dg.float32)
    bindings.update(scale_tensors(forward_scales(E5M2)))
    outputs = execute(g, bindings)
    assert torch.isnan(outputs["sdpa_fp8.o"][0, 1, 2]).all()
    assert outputs["sdpa_fp8.stats"][0, 1, 2].item() == float("-inf")
    assert not torch.isnan(outputs["sdpa_fp8.o"][0, 0]).any()
    assert_matches(outputs, g.reference(bindings))


def test_backward_size_one_axes():
    """One key (every row sees it alone: P = 1, dS = dP - delta = 0 up to rounding) and one query,
    head dim 1. amax_dP is left out where it is the residue of that cancellation (the float64
    reference keeps ~1e-8 of the float32 descales' rounding, the kernel's float32 sums 0)."""
    for s_q, s_kv, dim in ((3, 1, 1), (1, 33, 8)):
        tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, s_q, s_kv, dim, True)
        g = backward_graph(tensors, True, grad_type=dg.float32)
        bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
        outputs = execute(g, bindings)
        refs = g.reference(bindings)
        if s_kv == 1:
            assert abs(outputs.pop("sdpa_fp8_backward.amax_dP").item()) < 1e-6
        assert_matches(outputs, refs)


def test_amaxes_restart_at_every_execute():
    """The amaxes are atomic maxima: a second execute with smaller values (same built graph, same
    output tensors, which still hold the first maxima) gets its own, not the first's."""
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, 19, 23, 16, True)
    g = backward_graph(tensors, True)
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    outputs = execute(g, bindings)
    assert_matches(outputs, g.reference(bindings))
    smaller = {**bindings, "dO": (tensors["dO"].float() / 8).to(E4M3), "v": (tensors["v"].float() / 4).to(E4M3)}
    g.execute({**smaller, **outputs})
    refs = g.reference(smaller)
    for name in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"):
        got, expected = outputs[f"sdpa_fp8_backward.{name}"].item(), refs[f"sdpa_fp8_backward.{name}"].item()
        assert math.isclose(got, expected, rel_tol=1e-5), (name, got, expected)


def test_unmarked_amax_goes_to_the_workspace():
    """An amax the graph does not mark is written to a workspace buffer, the rest as usual."""
    q = fp8_values((1, 2, 25, 16), E4M3, 14)
    k = fp8_values((1, 2, 25, 16), E4M3, 15)
    g = dg.Graph()
    tq, tk = g.tensor_like(q, "q"), g.tensor_like(k, "k")
    scales = [g.tensor(name=name, dim=[1, 1, 1, 1], data_type=dg.float32) for name in FORWARD_SCALES]
    o, _, _, amax_o = g.sdpa_fp8(tq, tk, tk, *scales)
    o.set_output(True)
    amax_o.set_output(True)
    bindings = {"q": q, "k": k, **scale_tensors(forward_scales(E4M3))}
    assert_matches(execute(g, bindings), g.reference(bindings))


# --- backward ---------------------------------------------------------------------------------------------
def backward_tensors(dtype, do_dtype, batch, heads, kv_heads, s_q, s_kv, dim, causal, device="cpu", seed=20):
    """q, k, v, dO and the forward's o and stats (from the float64 reference of sdpa_fp8)."""
    q = fp8_values((batch, heads, s_q, dim), dtype, seed)
    k = fp8_values((batch, kv_heads, s_kv, dim), dtype, seed + 1)
    v = fp8_values((batch, kv_heads, s_kv, dim), dtype, seed + 2)
    g, bindings = forward_graph(q, k, v, causal)
    bindings.update(scale_tensors(forward_scales(dtype)))
    refs = g.reference(bindings)
    tensors = {"q": q, "k": k, "v": v, "o": refs["sdpa_fp8.o"].to(dtype),
               "dO": fp8_values((batch, heads, s_q, dim), do_dtype, seed + 3),
               "stats": refs["sdpa_fp8.stats"].float()}
    return {name: t.to(device) for name, t in tensors.items()}


def backward_case(dtype, do_dtype, batch, heads, kv_heads, s_q, s_kv, dim, causal, grad_type=None, device="cpu",
                  options=None):
    tensors = backward_tensors(dtype, do_dtype, batch, heads, kv_heads, s_q, s_kv, dim, causal, device)
    g = backward_graph(tensors, causal, grad_type)
    bindings = {**tensors, **scale_tensors(backward_scales(dtype), device)}
    outputs = execute(g, bindings, device, options)
    assert_matches(outputs, g.reference({n: t.cpu() for n, t in bindings.items()}), device)
    return outputs


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_matches_reference(dtype, causal):
    backward_case(dtype, dtype, 2, 4, 2, 37, 45, 24, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_blocks_seen_whole_and_masked(causal):
    """Sequences past one interpreter tile: the dQ kernel's key blocks every row sees whole run
    without the mask (amax_dP too), the rest with it; fp8 gradients (see the forward's case)."""
    backward_case(E4M3, E4M3, 1, 2, 1, 150, 170, 16, causal)
    backward_case(E4M3, E5M2, 1, 2, 2, 131, 129, 16, causal)


def test_backward_strided_bshd_and_sliced_inputs():
    """q, o, dO stored BSHD, k and v sliced out of wider buffers (row stride past D), stats
    strided: the gradients take q's, k's and v's layouts, every output poisoned first."""
    tensors = backward_tensors(E4M3, E5M2, 2, 4, 2, 27, 31, 16, True)

    def bshd(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def sliced(t):
        wide = torch.zeros(t.shape[:3] + (t.shape[3] + 8,), dtype=t.dtype)
        wide[..., 4:4 + t.shape[3]] = t
        return wide[..., 4:4 + t.shape[3]]

    stats = torch.full(tensors["stats"].shape[:3] + (2,), float("nan"))
    stats[..., :1] = tensors["stats"]
    tensors.update(q=bshd(tensors["q"]), o=bshd(tensors["o"]), dO=bshd(tensors["dO"]), k=sliced(tensors["k"]),
                   v=sliced(tensors["v"]), stats=stats[..., :1])
    g = backward_graph(tensors, True)
    assert list(g.outputs()[0].stride) == list(bshd(tensors["q"]).stride())
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    assert_matches(execute(g, bindings), g.reference(bindings))


def test_backward_broadcast_inputs():
    """Every input broadcast over the batch (stride 0): the gradients are dense per batch element
    and match the reference."""
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, 11, 13, 16, True)
    tensors = {name: t.expand(3, -1, -1, -1) for name, t in tensors.items()}
    g = backward_graph(tensors, True)
    assert all(t.stride[0] > 0 for t in g.outputs()[:3])
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    assert_matches(execute(g, bindings), g.reference(bindings))


def test_fp8_outputs_past_their_range_convert_as_torch():
    """o * scale_o past the fp8 range: e4m3 saturates to 448 and e5m2 overflows to inf, as
    torch's .to does (conversions.float8_rule; cuDNN's satfinite would give e5m2 57344)."""
    for o_type, dtype in ((dg.float8_e4m3, E4M3), (dg.float8_e5m2, E5M2)):
        q = fp8_values((1, 1, 13, 16), E4M3, 47)
        k = fp8_values((1, 1, 15, 16), E4M3, 48)
        g, bindings = forward_graph(q, k, k, o_type=o_type)
        bindings.update(scale_tensors({**forward_scales(E4M3), "scale_o": 1e5}))
        outputs = execute(g, bindings)
        o = outputs["sdpa_fp8.o"].float()
        top = torch.finfo(dtype).max
        assert (o.abs() == (top if dtype is E4M3 else float("inf"))).float().mean() > 0.5
        assert_matches(outputs, g.reference(bindings))


# scale_s around the bound where P * scale_s may overflow q's fp8 type (P = 1 on a causal graph's
# first row): below it the kernels convert P with the hardware's instruction alone, at and above
# it with torch's overflow encodings (quantize_probabilities); e4m3's first overflow is 464
P_SCALES = [(E4M3, 460.0), (E4M3, 470.0), (E4M3, 4000.0), (E5M2, 57344.0), (E5M2, 1e6)]


P_SCALE_IDS = [f"{d}-{s:g}".replace("torch.float8_", "") for d, s in P_SCALES]


def probabilities_case(dtype, scale_s, device="cpu", sizes=(21, 19, 16), options=None):
    """Forward and backward (P feeds dV) of a small causal graph at scale_s, against the
    reference; sizes = (Sq, Skv, D); options: the builds' BuildOptions."""
    s_q, s_kv, dim = sizes
    scales = {"scale_s": scale_s, "descale_s": 1.0 / scale_s}
    q = fp8_values((1, 2, s_q, dim), dtype, 60, device)
    k = fp8_values((1, 1, s_kv, dim), dtype, 61, device)
    g, bindings = forward_graph(q, k, k, causal=True, o_type=dg.float32)
    bindings.update(scale_tensors({**forward_scales(dtype), **scales}, device))
    outputs = execute(g, bindings, device, options)
    assert_matches(outputs, g.reference({n: t.cpu() for n, t in bindings.items()}), device)
    tensors = backward_tensors(dtype, dtype, 1, 2, 1, s_q, s_kv, dim, True, device)
    g = backward_graph(tensors, True, grad_type=dg.float32)
    bindings = {**tensors, **scale_tensors({**backward_scales(dtype), **scales}, device)}
    assert_matches(execute(g, bindings, device, options), g.reference({n: t.cpu() for n, t in bindings.items()}),
                   device)


def gradient_scores_case(do_dtype, device="cpu"):
    """A backward whose dS * scale_dP passes dO's fp8 range on many pairs (e4m3 saturates to 448
    in recent torch, e5m2 overflows to inf and the dots then give NaN), against the reference."""
    tensors = backward_tensors(E4M3, do_dtype, 1, 2, 1, 23, 29, 16, False, device)
    g = backward_graph(tensors, False, grad_type=dg.float32)
    bindings = {**tensors, **scale_tensors({**backward_scales(E4M3), "scale_dP": 1e7, "descale_dP": 1e-7}, device)}
    outputs = execute(g, bindings, device)
    assert_matches(outputs, g.reference({n: t.cpu() for n, t in bindings.items()}), device)
    return outputs


@pytest.mark.parametrize("do_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gradient_scores_past_the_fp8_range(do_dtype):
    """dS rounds to dO's type as torch converts, past its range too (quantize_operand: the
    hardware conversion alone where torch saturates as satfinite does)."""
    amax = gradient_scores_case(do_dtype)["sdpa_fp8_backward.amax_dP"]
    assert amax.item() * 1e7 > torch.finfo(do_dtype).max  # the case does pass the range


@pytest.mark.parametrize("dtype, scale_s", P_SCALES, ids=P_SCALE_IDS)
def test_probabilities_near_and_past_the_fp8_range(dtype, scale_s):
    """P * scale_s at, below and past the first overflow of q's type match the reference, which
    converts as torch does (saturating, or overflowing to inf and then NaN through the dots). On
    CPU the interpreter's conversion is torch's; the GPU test below is the one that tells the
    hardware's satfinite conversion apart (e5m2: 57344 where torch gives inf)."""
    probabilities_case(dtype, scale_s)


# short sequences (Sq, Skv, D), odd and shorter than every GPU tile: the GPU lowering shrinks
# the tiles' other axes to them (tiles_for). (21, 19, 16) is the H200's failing shape of 2026-11-29.
SMALL_SHAPES = [(21, 19, 16), (5, 40, 24), (40, 5, 24)]


@pytest.mark.parametrize("dtype, scale_s", [(E4M3, 64.0), (E5M2, 32768.0)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("sizes", SMALL_SHAPES, ids=[f"{q}x{kv}x{d}" for q, kv, d in SMALL_SHAPES])
def test_gpu_tiles_at_small_shapes_interpreted(dtype, scale_s, sizes):
    """The kernels at the tiles an H200 plans (BuildOptions target, run in the interpreter) at
    short odd sequences, on a NaN workspace: the rows and keys past the sequences, and the
    keys-minor copies' padding, stay out of every output."""
    probabilities_case(dtype, scale_s, sizes=sizes, options=dg.BuildOptions(target=dg.target.H200))


# odd sequences past one GPU tile (forward 64x128, dQ 64x64, dK/dV 32x64): key blocks seen whole
# (unmasked loops) and masked ones, more queries than keys and the reverse
GPU_TILE_SHAPES = [(150, 130, 24), (130, 150, 24)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sizes", GPU_TILE_SHAPES, ids=[f"{q}x{kv}x{d}" for q, kv, d in GPU_TILE_SHAPES])
def test_gpu_tiles_across_whole_and_masked_blocks_interpreted(sizes, causal):
    """Forward and the hybrid backward (GQA, float32 gradients) at the H200's tiles, interpreted
    on a NaN workspace."""
    s_q, s_kv, dim = sizes
    h200 = dg.BuildOptions(target=dg.target.H200)
    forward_case(E4M3, 1, 2, 1, s_q, s_kv, dim, causal, o_type=dg.float32, options=h200)
    backward_case(E4M3, E5M2, 1, 2, 1, s_q, s_kv, dim, causal, grad_type=dg.float32, options=h200)


def test_gpu_tiles_keep_the_dot_rows_of_the_table():
    """On the GPU, short sequences shrink only the tile axis that is not the rows (M) of the
    kernels' dots (DOT_ROWS_AXIS): query tiles stay 64 rows in the forward and dQ, key tiles 64
    in dK/dV; the interpreter's tiles shrink both axes."""
    from dnngraph.backends.triton.lower.sdpa_fp8 import GPU_TILES, Fp8Tiles, tiles_for
    assert tiles_for("forward", 21, 19, False, 16) == Fp8Tiles(GPU_TILES["forward"].block_m, 32, 4, 3)
    assert tiles_for("dq", 5, 40, False, 24) == Fp8Tiles(GPU_TILES["dq"].block_m, 64, 4, 4)
    assert tiles_for("dkdv", 40, 5, False, 24) == Fp8Tiles(32, GPU_TILES["dkdv"].block_n, 8, 3)
    assert tiles_for("forward", 21, 19, True, 16).block_m == 32
    # the build's target picks them: an H200's for CPU tensors, run interpreted
    q, k = fp8_values((1, 2, 21, 16), E4M3, 0), fp8_values((1, 1, 19, 16), E4M3, 1)
    g = forward_graph(q, k, k, True)[0].build(options=dg.BuildOptions(target=dg.target.H200))
    assert "BLOCK_M=64 BLOCK_N=32 num_warps=4" in g.explain()
    assert "BLOCK_M=32 BLOCK_N=32" in forward_graph(q, k, k, True)[0].build().explain()


def satfinite(values: torch.Tensor, fp8) -> torch.Tensor:
    """float32 values converted as sm_90's cvt.rn.satfinite (Triton's x.to(fp8) on the GPU):
    rounded to nearest even, every magnitude past the largest finite value (infinity too) the
    largest finite value with the input's sign, NaN the positive NaN code 0x7F."""
    top = torch.finfo(fp8).max
    codes = values.clamp(-top, top).to(fp8).view(torch.uint8)
    return torch.where(torch.isnan(values), torch.full_like(codes, 0x7F), codes).view(fp8)


def test_satfinite_emulation():
    """The emulation below matches the PTX ISA's satfinite: 500 and inf saturate in e4m3 (448),
    70000 and inf in e5m2 (57344, where torch gives inf), ties round to even, NaN stays NaN."""
    x = torch.tensor([500.0, float("inf"), -float("inf"), 464.0, 455.0, float("nan"), -1.0e-3])
    assert satfinite(x, E4M3).float()[:5].tolist() == [448.0, 448.0, -448.0, 448.0, 448.0]
    assert torch.isnan(satfinite(x, E4M3).float()[5]) and satfinite(x, E4M3).float()[6].item() < 0
    y = torch.tensor([70000.0, float("inf"), 61440.0, 57344.0])
    assert satfinite(y, E5M2).float().tolist() == [57344.0] * 4


def overflow_to_nan_rule(data_type):
    """e4m3fn's conversion rule in torch releases where magnitudes from 464 on became NaN (0x7F)
    rather than 448 (conversions.py): the rule the GPU machine's torch may read."""
    from dnngraph.backends.triton.codegen.conversions import Float8Rule, float8_rule
    if data_type is not dg.float8_e4m3:
        return float8_rule(data_type)
    first = float(torch.nextafter(torch.tensor(464.0), torch.tensor(math.inf)))
    return Float8Rule(first, 0x7F, 0x7F, 0x7F)


@pytest.fixture(params=["running torch", "e4m3 overflow to NaN"])
def gpu_conversions(request, monkeypatch):
    """The interpreter converting float32 to fp8 as the GPU's instruction does (satfinite), under
    torch's rule as read here and under the other rule torch has had (e4m3fn overflow to NaN):
    the kernels' choice between the bare instruction and the full correction must give the
    reference's codes under either."""
    from dnngraph.backends.triton.codegen import sdpa_fp8 as codegen
    from dnngraph.ops import sdpa_fp8 as op
    from dnngraph.runtime import interpreter_casts, plan_cache
    import triton.language as tl

    original = interpreter_casts.torch_convert
    fp8_types = {tl.float8e4nv: E4M3, tl.float8e5: E5M2}

    def converted(data, source, target):
        if source != tl.float32 or target not in fp8_types:
            return original(data, source, target)
        values = torch.from_numpy(data.copy()).reshape(-1)
        return satfinite(values, fp8_types[target]).view(torch.uint8).numpy().reshape(data.shape)

    monkeypatch.setattr(interpreter_casts, "torch_convert", converted)
    if request.param != "running torch":
        rounded = op.quantized

        def quantized(value, data_type):  # the reference under that rule
            out = rounded(value, data_type)
            if data_type is dg.float8_e4m3:
                out = out.masked_fill(value.to(torch.float32).abs() >= overflow_to_nan_rule(data_type).first_overflow,
                                      math.nan)
            return out

        monkeypatch.setattr(codegen, "float8_rule", overflow_to_nan_rule)
        monkeypatch.setattr(op, "quantized", quantized)
    plan_cache.clear()
    yield request.param
    plan_cache.clear()


@pytest.mark.parametrize("dtype, scale_s", P_SCALES, ids=P_SCALE_IDS)
def test_probabilities_under_the_gpus_conversion(gpu_conversions, dtype, scale_s):
    """P * scale_s near and past the range's end with the GPU's satfinite conversion emulated:
    where the kernels take the bare instruction (|scale_s| * P_BOUND below the first overflow, or
    a type whose torch rule saturates) it gives torch's codes, elsewhere the full correction does,
    under both of torch's e4m3fn rules. (Taking the bare instruction at every scale fails here:
    e5m2 1e6 gives 57344 where torch gives inf.)"""
    probabilities_case(dtype, scale_s)


@pytest.mark.parametrize("do_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gradient_scores_under_the_gpus_conversion(gpu_conversions, do_dtype):
    """dS * scale_dP past dO's range with the GPU's conversion emulated (quantize_operand's
    bare instruction only where torch's rule saturates), under both of torch's e4m3fn rules."""
    gradient_scores_case(do_dtype)


def test_backward_hybrid_e5m2_gradient_and_float32_outputs():
    """dO in e5m2 against e4m3 q, k, v (the hybrid recipe), the gradients stored in float32."""
    outputs = backward_case(E4M3, E5M2, 1, 2, 1, 30, 41, 16, True, grad_type=dg.float32)
    assert all(outputs[f"sdpa_fp8_backward.amax_{n}"].item() > 0 for n in ("dQ", "dK", "dV", "dP"))


def test_backward_nan_in_d_o_propagates():
    """A NaN in dO (every pair visible) makes its row of dq, every dk and dv's column of it NaN,
    and amax_dP NaN, as the reference's sums do. (Under a mask, a NaN at a pair the mask hides
    reaches the result only where a kernel's tile holds the pair, as 0 * NaN: ops/sdpa_fp8.py.)"""
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 2, 17, 19, 16, False)
    tensors["dO"][0, 1, 9, 5] = float("nan")
    g = backward_graph(tensors, False, grad_type=dg.float32)
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    outputs = execute(g, bindings)
    d_q, d_v = outputs["sdpa_fp8_backward.dq"][0, 1], outputs["sdpa_fp8_backward.dv"][0, 1]
    assert torch.isnan(d_q[9]).all() and not torch.isnan(d_q[:9]).any()
    assert torch.isnan(outputs["sdpa_fp8_backward.dk"][0, 1]).all()
    assert torch.isnan(d_v[:, 5]).all() and not torch.isnan(d_v[:, :5]).any()
    assert not torch.isnan(outputs["sdpa_fp8_backward.dq"][0, 0]).any()  # the other head
    assert math.isnan(outputs["sdpa_fp8_backward.amax_dP"].item())
    assert_matches(outputs, g.reference(bindings))



@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["NaN", "-inf"])
def test_backward_special_stats(value):
    """A NaN in stats reaches that row's dq and the dk, dv of the keys it sees (P = exp(S - NaN)),
    as any NaN input does; -inf, the forward's stats of a row that sees no key, makes the row's
    P zero (the row adds nothing), in the kernels and the reference alike."""
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, 21, 19, 16, True)
    tensors["stats"][0, 1, 6, 0] = value
    g = backward_graph(tensors, True, grad_type=dg.float32)
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    outputs = execute(g, bindings)
    d_q = outputs["sdpa_fp8_backward.dq"][0, 1]
    if math.isnan(value):
        assert torch.isnan(d_q[6]).all() and not torch.isnan(d_q[:6]).any()
        assert torch.isnan(outputs["sdpa_fp8_backward.dv"][0, 0, :7]).any()
        assert not torch.isnan(outputs["sdpa_fp8_backward.dv"][0, 0, 7:]).any()  # keys row 6 does not see
    else:
        assert (d_q[6] == 0).all()
    assert_matches(outputs, g.reference(bindings))


def test_backward_nan_in_v_reaches_only_the_rows_that_see_its_key():
    """A NaN in v at key 15 (causal: rows 0..14 do not see it) makes dP = dO v^T NaN in its whole
    column; dS is 0 at hidden pairs, so dq of rows 0..14 stays finite in the kernels (the tile
    holds the hidden pairs) and in the reference alike; dk of key 15 is NaN."""
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, 21, 19, 16, True)
    tensors["v"][0, 0, 15, 3] = float("nan")
    g = backward_graph(tensors, True, grad_type=dg.float32)
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    outputs = execute(g, bindings)
    d_q = outputs["sdpa_fp8_backward.dq"][0]
    assert not torch.isnan(d_q[:, :15]).any() and torch.isnan(d_q[:, 15:]).all()
    assert torch.isnan(outputs["sdpa_fp8_backward.dk"][0, 0, 15]).all()
    assert_matches(outputs, g.reference(bindings))


@pytest.mark.parametrize("o_marked", [True, False], ids=["o output", "o virtual"])
def test_forward_then_backward_in_one_graph_and_as_function(o_marked):
    """o and stats of sdpa_fp8 feed sdpa_fp8_backward in one graph (o read as stored, e4m3, in the
    workspace when not marked), run through as_function: every output against the reference of
    the whole graph."""
    q = fp8_values((1, 4, 21, 16), E4M3, 60)
    k = fp8_values((1, 2, 27, 16), E4M3, 61)
    v = fp8_values((1, 2, 27, 16), E4M3, 62)
    d_o = fp8_values((1, 4, 21, 16), E5M2, 63)
    g = dg.Graph()
    tq, tk, tv, t_do = (g.tensor_like(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (d_o, "dO")))
    forward = {n: g.tensor(name=n, dim=[1, 1, 1, 1], data_type=dg.float32) for n in FORWARD_SCALES}
    backward = {n: forward.get(n) or g.tensor(name=n, dim=[1, 1, 1, 1], data_type=dg.float32)
                for n in BACKWARD_SCALES}
    o, stats, _, _ = g.sdpa_fp8(tq, tk, tv, *forward.values(), is_inference=False, use_causal_mask=True)
    grads = g.sdpa_fp8_backward(tq, tk, tv, o, t_do, stats, *backward.values(), use_causal_mask=True)
    for tensor in ((o,) if o_marked else ()) + grads:
        tensor.set_output(True)
    values = {**forward_scales(E4M3), **backward_scales(E4M3), "descale_o": 1.0 / 3.0}  # o's scale_o is 3
    bindings = {"q": q, "k": k, "v": v, "dO": d_o, **scale_tensors({n: values[n] for n in {**forward, **backward}})}
    results = g.as_function()(*[bindings[t.name] for t in g.inputs()])
    assert_matches(dict(zip([t.name for t in g.outputs()], results)), g.reference(bindings))



def composed_forward(tensors: dict, scales: dict, causal: bool, attn_scale: float) -> dict:
    """The frontend's sdpa_fp8 graph (include/cudnn_frontend/node/sdpa_fp8.h) op by op in float64,
    apart from the op's reference: S = q k^T attn_scale descale_q descale_k (causal: top-left),
    P = softmax(S), amax_s = max |P|, P rounded at scale_s to q's type, O = P v descale_s
    descale_v, amax_o = max |O| (O unscaled: before scale_o)."""
    s = {name: float(value) for name, value in scales.items()}
    q, k, v = (tensors[n].double() for n in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k_full.transpose(-1, -2) * attn_scale * s["descale_q"] * s["descale_k"]
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, -1)
    probs8 = (probs * s["scale_s"]).float().to(tensors["q"].dtype).double()
    out = probs8 @ v_full * s["descale_s"] * s["descale_v"]
    return {"o": out, "stats": torch.logsumexp(scores, -1, keepdim=True), "amax_s": probs.abs().max(),
            "amax_o": out.abs().max()}


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_forward_follows_the_frontends_graph(dtype):
    """Kernels and reference against the frontend's forward graph composed apart (o in float32
    to the fp8 rounding flips a float32 sum may make)."""
    q = fp8_values((1, 4, 41, 16), dtype, 44)
    k = fp8_values((1, 2, 23, 16), dtype, 45)
    v = fp8_values((1, 2, 23, 16), dtype, 46)
    g, bindings = forward_graph(q, k, v, True, o_type=dg.float32)
    scales = scale_tensors(forward_scales(dtype))
    bindings.update(scales)
    expected = composed_forward(bindings, scales, True, 16 ** -0.5)
    for results in (execute(g, bindings), g.reference(bindings)):
        for name in ("amax_s", "amax_o"):
            assert math.isclose(results[f"sdpa_fp8.{name}"].item(), expected[name].item(), rel_tol=1e-5), name
        assert _relative_error(results["sdpa_fp8.stats"], expected["stats"]) < 1e-6
        error = _relative_error(results["sdpa_fp8.o"] / forward_scales(dtype)["scale_o"], expected["o"])
        assert error < 2e-3, f"o: relative error {error:.3g}"


def composed_backward(tensors: dict, scales: dict, causal: bool, attn_scale: float) -> dict:
    """The frontend's sdpa_fp8_backward graph (include/cudnn_frontend/node/sdpa_fp8_bwd.h) op by op in
    float64, written apart from the op's reference: P = exp(S - stats) rounded at scale_S to q's
    type; dS ("dP" there) = P (dO V^T - rowsum(dO o)) attn_scale, amax_dP = max |dS| before
    scale_dP, and dS rounded at scale_dP to dO's type. Gradients unscaled (before scale_dQ, ...)."""
    s = {name: float(value) for name, value in scales.items()}
    q, k, v, o, d_o = (tensors[n].double() for n in ("q", "k", "v", "o", "dO"))
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k_full.transpose(-1, -2) * attn_scale * s["descale_q"] * s["descale_k"]
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.exp(scores - tensors["stats"].double())
    probs8 = (probs * s["scale_s"]).float().to(tensors["q"].dtype).double()
    delta = (d_o * o).sum(-1, keepdim=True) * s["descale_dO"] * s["descale_o"]
    d_scores = (d_o @ v_full.transpose(-1, -2) * s["descale_dO"] * s["descale_v"] - delta) * probs * attn_scale
    d_scores8 = (d_scores * s["scale_dP"]).float().to(tensors["dO"].dtype).double()

    def folded(grad):  # the query heads of each k/v head summed
        return grad.reshape(k.shape[0], k.shape[1], group, *grad.shape[2:]).sum(2)

    return {"dq": d_scores8 @ k_full * s["descale_dP"] * s["descale_k"],
            "dk": folded(d_scores8.transpose(-1, -2) @ q) * s["descale_dP"] * s["descale_q"],
            "dv": folded(probs8.transpose(-1, -2) @ d_o) * s["descale_s"] * s["descale_dO"],
            "amax_dP": d_scores.abs().max()}


def _relative_error(got, expected) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("do_dtype", [E4M3, E5M2], ids=["dO e4m3", "dO e5m2 (hybrid)"])
@pytest.mark.parametrize("sizes", [(29, 35), (70, 20)], ids=["Sq<Skv", "Sq>Skv"])
def test_backward_follows_the_frontends_graph(do_dtype, sizes):
    """amax_dP is max |dS| (the value scale_dP scales: the frontend's "dP" is the softmax input's
    gradient), and dS is rounded to dO's type. Kernels and reference both against the frontend's
    graph composed apart (the float32 gradients to the fp8 rounding flips a float32 sum may make;
    rounding dS to the other type, or taking amax of dO V^T, is off by far more)."""
    tensors = backward_tensors(E4M3, do_dtype, 1, 4, 2, *sizes, 16, True)
    g = backward_graph(tensors, True, grad_type=dg.float32)
    scales = scale_tensors(backward_scales(E4M3))
    bindings = {**tensors, **scales}
    outputs = execute(g, bindings)
    refs = g.reference(bindings)
    expected = composed_backward(tensors, scales, True, 16 ** -0.5)
    for results in (outputs, refs):
        amax = results["sdpa_fp8_backward.amax_dP"].item()
        assert math.isclose(amax, expected["amax_dP"].item(), rel_tol=1e-5), (amax, expected["amax_dP"].item())
        for name in ("dq", "dk", "dv"):
            scale = backward_scales(E4M3)[f"scale_d{name[1].upper()}"]
            error = _relative_error(results[f"sdpa_fp8_backward.{name}"] / scale, expected[name])
            assert error < 2e-3, f"{name}: relative error {error:.3g}"


# --- errors -----------------------------------------------------------------------------------------------
def _declared(g, dtype=dg.float8_e4m3, q_dim=(1, 2, 8, 16), kv_dim=(1, 1, 8, 16), scale_dims=None, scale_type=None):
    q = g.tensor(name="q", dim=list(q_dim), data_type=dtype)
    k = g.tensor(name="k", dim=list(kv_dim), data_type=dg.float8_e4m3)
    v = g.tensor(name="v", dim=list(kv_dim), data_type=dg.float8_e4m3)
    scales = [g.tensor(name=n, dim=list(scale_dims or (1, 1, 1, 1)), data_type=scale_type or dg.float32)
              for n in FORWARD_SCALES]
    return q, k, v, scales


@pytest.mark.parametrize("case", ["bf16 q", "e5m2 q with e4m3 k", "two-element scale", "float16 scale",
                                  "rank 3", "heads", "head dims", "int q"])
def test_bad_forward_inputs_are_validation_errors(case):
    g = dg.Graph()
    q, k, v, scales = {
        "bf16 q": lambda: _declared(g, dg.bfloat16),
        "e5m2 q with e4m3 k": lambda: _declared(g, dg.float8_e5m2),
        "two-element scale": lambda: _declared(g, scale_dims=(1, 1, 1, 2)),
        "float16 scale": lambda: _declared(g, scale_type=dg.float16),
        "rank 3": lambda: _declared(g, q_dim=(2, 8, 16), kv_dim=(1, 8, 16)),
        "heads": lambda: _declared(g, q_dim=(1, 3, 8, 16), kv_dim=(1, 2, 8, 16)),
        "head dims": lambda: _declared(g, q_dim=(1, 2, 8, 32)),
        "int q": lambda: _declared(g, dg.int32),
    }[case]()
    before = len(g.nodes)
    with pytest.raises(dg.ValidationError):
        g.sdpa_fp8(q, k, v, *scales)
    assert len(g.nodes) == before  # a failed call changes nothing


def test_bad_backward_inputs_are_validation_errors():
    tensors = backward_tensors(E4M3, E4M3, 1, 2, 1, 8, 8, 16, False)
    for name, replacement in (("stats", tensors["stats"].half()), ("stats", tensors["stats"][:, :, :4]), ("dO", tensors["dO"].float()),
                              ("o", tensors["o"][..., :8])):
        g = dg.Graph()
        handles = [g.tensor_like(replacement if n == name else tensors[n], n)
                   for n in ("q", "k", "v", "o", "dO", "stats")]
        scales = [g.tensor(name=n, dim=[1, 1, 1, 1], data_type=dg.float32) for n in BACKWARD_SCALES]
        with pytest.raises(dg.ValidationError):
            g.sdpa_fp8_backward(*handles, *scales)
        assert len(g.nodes) == 0



@pytest.mark.parametrize("case", ["amax_o bf16", "amax_s fp8", "stats bf16", "o int32", "o bool",
                                  "dq bool", "amax_dP float16"])
def test_output_types_set_after_the_call_are_validation_errors(case):
    """set_data_type on an output after the op call: the amaxes (atomics on float32 bits) and stats
    stay float32, o and the gradients floating; build refuses the rest with a ValidationError
    (a 2-byte amax took a 4-byte atomic, a bool o crashed untyped), and the graph builds once
    the type is put back."""
    output, data_type = {"amax_o bf16": ("sdpa_fp8.amax_o", dg.bfloat16),
                         "amax_s fp8": ("sdpa_fp8.amax_s", dg.float8_e4m3),
                         "stats bf16": ("sdpa_fp8.stats", dg.bfloat16), "o int32": ("sdpa_fp8.o", dg.int32),
                         "o bool": ("sdpa_fp8.o", dg.bool), "dq bool": ("sdpa_fp8_backward.dq", dg.bool),
                         "amax_dP float16": ("sdpa_fp8_backward.amax_dP", dg.float16)}[case]
    if output.startswith("sdpa_fp8_backward"):
        g = backward_graph(backward_tensors(E4M3, E4M3, 1, 2, 1, 8, 8, 16, False))
    else:
        q = fp8_values((1, 2, 9, 16), E4M3, 36)
        g, _ = forward_graph(q, q, q)
    tensor = next(t for t in g.outputs() if t.name == output)
    before = tensor.data_type
    tensor.set_data_type(data_type)
    with pytest.raises(dg.ValidationError, match=output.split(".")[1]):
        g.build()
    tensor.set_data_type(before)
    g.build()


@pytest.mark.parametrize("changed", ["q k v to e5m2", "dO to e4m3", "q to bf16"])
def test_input_types_set_after_the_call_are_validation_errors(changed):
    """The op fixes the fp8 types P and dS round to (q's, dO's) at the call: an input whose type
    set_data_type changes afterwards is refused at build (the kernels would round in the new
    type, the reference in the old), and the graph builds once it is put back."""
    tensors = backward_tensors(E4M3, E5M2, 1, 2, 1, 8, 8, 16, False)
    g = backward_graph(tensors)
    inputs = {t.name: t for t in g.inputs()}
    names, data_type = {"q k v to e5m2": (("q", "k", "v"), dg.float8_e5m2), "dO to e4m3": (("dO",), dg.float8_e4m3),
                        "q to bf16": (("q",), dg.bfloat16)}[changed]
    before = {name: inputs[name].data_type for name in names}
    for name in names:
        inputs[name].set_data_type(data_type)
    with pytest.raises(dg.ValidationError):
        g.build()
    for name in names:
        inputs[name].set_data_type(before[name])
    g.build()


def test_wrong_binding_is_an_execution_error_and_writes_nothing():
    q = fp8_values((1, 2, 9, 16), E4M3, 30)
    k = fp8_values((1, 2, 9, 16), E4M3, 31)
    g, bindings = forward_graph(q, k, k)
    bindings.update(scale_tensors(forward_scales(E4M3)))
    g.build()
    outputs = {t.name: poisoned(t) for t in g.outputs()}
    with pytest.raises(dg.ExecutionError):
        g.execute({**bindings, "k": k.float(), **outputs})
    assert all(torch.isnan(t.float()).all() for t in outputs.values())


def test_head_dim_not_contiguous_is_unsupported():
    q = fp8_values((1, 2, 9, 16), E4M3, 32)
    strided = fp8_values((1, 2, 16, 9), E4M3, 33).transpose(2, 3)  # head dim stride 9
    g, bindings = forward_graph(q, strided, strided)
    with pytest.raises(dg.UnsupportedError):
        g.build()


def test_head_offsets_past_int32_are_unsupported():
    """One batch element spanning more than 2^31 elements (the kernels' int32 offsets) is refused
    at build, before anything runs."""
    g = dg.Graph()
    q = g.tensor(name="q", dim=[1, 2, 8, 16], stride=[2**32, 2**31, 16, 1], data_type=dg.float8_e4m3)
    k = g.tensor(name="k", dim=[1, 2, 8, 16], data_type=dg.float8_e4m3)
    scales = [g.tensor(name=n, dim=[1, 1, 1, 1], data_type=dg.float32) for n in FORWARD_SCALES]
    o, *_ = g.sdpa_fp8(q, k, k, *scales)
    o.set_output(True)
    with pytest.raises(dg.UnsupportedError, match="2\\^31"):
        g.build()


def test_json_round_trip_runs():
    q = fp8_values((1, 2, 12, 16), E5M2, 34)
    k = fp8_values((1, 1, 12, 16), E5M2, 35)
    g, bindings = forward_graph(q, k, k, causal=True)
    copy = dg.Graph.from_json(g.to_json())
    bindings.update(scale_tensors(forward_scales(E5M2)))
    assert_matches(execute(copy, bindings), g.reference(bindings))



def test_json_round_trip_keeps_the_hybrid_gradient_type():
    """The backward's dS type (dO's, e5m2 here) survives to_json / from_json: the copy runs and
    matches the reference of the original."""
    tensors = backward_tensors(E4M3, E5M2, 1, 2, 1, 13, 17, 16, True)
    g = backward_graph(tensors, True, grad_type=dg.float32)
    copy = dg.Graph.from_json(g.to_json())
    (node,) = [n for n in copy.nodes if n.op == "sdpa_fp8_backward"]
    assert node.attrs.ds_type() is dg.float8_e5m2
    bindings = {**tensors, **scale_tensors(backward_scales(E4M3))}
    assert_matches(execute(copy, bindings), g.reference(bindings))


# --- sm_90 compiles -------------------------------------------------------------------------------------------
def _gpu_lowered(label: str, g):
    """(label, launches, dtypes) of the graph's one group lowered as for a GPU (its tiles), the
    graph built here for the tensors' dtypes and groups."""
    from types import SimpleNamespace
    from dnngraph.backends.triton.lower.sdpa_fp8 import build_sdpa_fp8
    from dnngraph.dtypes import kernel_torch_dtype
    g.build()
    (group,) = list(g.plan.groups)
    launches = build_sdpa_fp8(g, group, SimpleNamespace(device=torch.device("cuda"), target=dg.target.H200, budget=None))
    return f"{label} (GPU tiles)", launches, {t.uid: kernel_torch_dtype(t.data_type) for t in g.tensors}


def sm90_graphs():
    """Each kernel form (both fp8 types, causal, GQA, the hybrid backward, fp8 and float outputs),
    with the interpreter's tiles and the GPU's, for tests/sm90_compile.py."""
    for dtype, label in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        for causal in (False, True):
            q = fp8_values((1, 4, 256, 128), dtype, 0)
            k = fp8_values((1, 2, 256, 128), dtype, 1)
            g, _ = forward_graph(q, k, k, causal)
            g.build()
            yield f"forward {label} causal={causal}", g
            yield _gpu_lowered(f"forward {label} causal={causal}", forward_graph(q, k, k, causal)[0])
    g, _ = forward_graph(q, k, k, o_type=dg.bfloat16)  # a 16-bit o: the conversion store_as does
    g.build()
    yield "forward e5m2 o=bf16", g
    yield _gpu_lowered("forward e5m2 o=bf16", forward_graph(q, k, k, o_type=dg.bfloat16)[0])
    tensors = backward_tensors(E4M3, E5M2, 1, 4, 2, 256, 256, 128, True)
    for grad_type in (None, dg.bfloat16):
        g = backward_graph(tensors, True, grad_type)
        g.build()
        yield f"backward hybrid grads={grad_type}", g
        yield _gpu_lowered(f"backward hybrid grads={grad_type}", backward_graph(tensors, True, grad_type))


def test_kernels_compile_for_sm90(monkeypatch):
    """The interpreter skips Triton's type checks (fp8 dot operands, constexpr tuples): compile
    every kernel form for sm_90 in a process without the interpreter. Every tile load inside a
    key or query loop is pipelined (no synchronous tt.load left in a loop: sm90_compile's
    loop_register_loads): a dot operand read from a row-major tensor along its rows (v for P v,
    k for dS k, q and dO for dK and dV) was loaded through registers every iteration, at a
    fraction of the tensor cores' speed."""
    from helpers import compiled_for_sm90
    monkeypatch.setenv("SM90_LOOP_LOADS", "1")
    # per forward: zeroing, v's keys-minor copy, the kernel; per backward: zeroing, q's, dO's and
    # k's copies, delta = rowsum(o dO), dK/dV, dQ
    output = compiled_for_sm90("test_sdpa_fp8:sm90_graphs", timeout=900)
    assert "compiled 58 kernels for sm_90" in output
    loop_loads = [line for line in output.splitlines() if line.startswith("loop_loads ")]
    assert len(loop_loads) == 58 and all(line.endswith(": 0") for line in loop_loads), loop_loads



def sm90_wide_head_graphs():
    """Forward and backward (hybrid, GQA, causal) at head dim 256, lowered with the GPU's tiles."""
    q = fp8_values((1, 4, 256, 256), E4M3, 0)
    k = fp8_values((1, 2, 256, 256), E4M3, 1)
    yield _gpu_lowered("forward d=256", forward_graph(q, k, k, True)[0])
    yield _gpu_lowered("backward d=256", backward_graph(backward_tensors(E4M3, E5M2, 1, 4, 2, 256, 256, 256, True),
                                                        True))


def test_wide_heads_compile_for_sm90_without_spills(monkeypatch):
    """At head dim 256 the GPU tiles keep the float32 accumulators ([BLOCK_M, D], or dK and dV's
    two [BLOCK_N, D]) in registers: ptxas reports no spill stores for any kernel (the 128-wide
    tiles of D <= 128 spilled 424 to 616 bytes here)."""
    from helpers import compiled_for_sm90
    monkeypatch.setenv("SM90_SPILLS", "1")
    output = compiled_for_sm90("test_sdpa_fp8:sm90_wide_head_graphs", timeout=600)
    spills = [line for line in output.splitlines() if line.startswith("spills ")]
    assert len(spills) == 10 and all(line.endswith(": 0") for line in spills), spills


def sm90_candidate_tiles():
    """Each kernel lowered at each of its CANDIDATE_TILES (D = 128, causal, the backward GQA and
    hybrid), only that kernel's launch, for tests/sm90_compile.py."""
    from dnngraph.backends.triton.lower import sdpa_fp8 as lowering
    from dnngraph.runtime import plan_cache
    q = fp8_values((1, 4, 256, 128), E4M3, 0)
    k = fp8_values((1, 2, 256, 128), E4M3, 1)
    tensors = backward_tensors(E4M3, E5M2, 1, 4, 2, 256, 256, 128, True)
    chosen = dict(lowering.GPU_TILES)
    for which, candidates in lowering.CANDIDATE_TILES.items():
        for tiles in candidates:
            lowering.GPU_TILES = {**chosen, which: tiles}
            plan_cache.clear()
            graph = forward_graph(q, k, k, True)[0] if which == "forward" else backward_graph(tensors, True)
            label, launches, dtypes = _gpu_lowered(f"{which} {tiles.text(())}", graph)
            for launch in launches:  # the buffers are declared by the first launch
                dtypes.update({buffer.uid: buffer.torch_dtype for buffer in launch.scratch})
            yield label, [launch for launch in launches if f"_{which}_" in launch.kernel.__name__], dtypes
    lowering.GPU_TILES = chosen


def test_candidate_tiles_compile_for_sm90_without_spills(monkeypatch):
    """Every tile candidate a GPU sweep times (CANDIDATE_TILES, plain data; the first of each
    kernel is its GPU_TILES choice) compiles for sm_90a at D = 128 with no spill stores and no
    unpipelined loop load: a sweep compares configs that are all sound."""
    from helpers import compiled_for_sm90
    from dnngraph.backends.triton.lower.sdpa_fp8 import CANDIDATE_TILES, GPU_TILES
    assert all(CANDIDATE_TILES[which][0] == tiles for which, tiles in GPU_TILES.items())
    monkeypatch.setenv("SM90_SPILLS", "1")
    monkeypatch.setenv("SM90_LOOP_LOADS", "1")
    output = compiled_for_sm90("test_sdpa_fp8:sm90_candidate_tiles", timeout=600)
    count = sum(len(candidates) for candidates in CANDIDATE_TILES.values())
    checked = [line for line in output.splitlines() if line.startswith(("spills ", "loop_loads "))]
    assert f"compiled {count} kernels" in output
    assert len(checked) == 2 * count and all(line.endswith(": 0") for line in checked), checked


def sm90_small_shape_graphs():
    """Forward (e4m3, e5m2) and the hybrid backward lowered with the GPU's tiles at SMALL_SHAPES."""
    for s_q, s_kv, dim in SMALL_SHAPES:
        for dtype, label in ((E4M3, "e4m3"), (E5M2, "e5m2")):
            q = fp8_values((1, 2, s_q, dim), dtype, 0)
            k = fp8_values((1, 1, s_kv, dim), dtype, 1)
            yield _gpu_lowered(f"forward {label} {s_q}x{s_kv}x{dim}", forward_graph(q, k, k, True)[0])
        tensors = backward_tensors(E4M3, E5M2, 1, 2, 1, s_q, s_kv, dim, True)
        yield _gpu_lowered(f"backward hybrid {s_q}x{s_kv}x{dim}", backward_graph(tensors, True, dg.float32))


def test_small_shapes_compile_without_replicated_mma(monkeypatch):
    """At short sequences no dot of the GPU kernels runs on mma.sync with its warps covering
    more rows than the tile (sm90_compile's replicated_mma_dots): the forward's 32-row query
    tile on 4 warps did, the H200 gave NaN rows and dropped keys there (2026-11-29), while the
    interpreter, which has no warps, matched the reference."""
    from helpers import compiled_for_sm90
    monkeypatch.setenv("SM90_MMA_ROWS", "1")
    output = compiled_for_sm90("test_sdpa_fp8:sm90_small_shape_graphs", timeout=600)
    replicated = [line for line in output.splitlines() if line.startswith("mma_replicated ")]
    # per shape: two forwards of three kernels, a backward of seven
    assert len(replicated) == 13 * len(SMALL_SHAPES), output[-2000:]
    assert not [line for line in replicated if not line.endswith(": 0")]


@pytest.mark.parametrize("dims", [(272, 64), (64, 320)], ids=["d_qk 272", "d_v 320"])
def test_heads_past_256_are_unsupported_on_the_gpu(dims):
    """The GPU kernels hold [tile, D] float32 accumulators in registers: past D = 256 (the
    frontend's limit, and the bf16 kernels') they would spill kilobytes, so the lowering for a
    GPU refuses them with an UnsupportedError (the interpreter runs any width)."""
    d_qk, d_v = dims
    q = fp8_values((1, 2, 40, d_qk), E4M3, 37)
    k = fp8_values((1, 1, 40, d_qk), E4M3, 38)
    v = fp8_values((1, 1, 40, d_v), E4M3, 39)
    with pytest.raises(dg.UnsupportedError, match="256"):
        _gpu_lowered("wide", forward_graph(q, k, v)[0])


# --- GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_forward_realistic(dtype, causal):
    forward_case(dtype, 2, 16, 16, 2048, 2048, 128, causal, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("do_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_gradient_scores_past_the_fp8_range(do_dtype):
    gradient_scores_case(do_dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, scale_s", P_SCALES, ids=P_SCALE_IDS)
def test_gpu_probabilities_near_and_past_the_fp8_range(dtype, scale_s):
    """quantize_probabilities' two paths on the GPU: the hardware conversion alone below the
    bound, torch's overflow encodings past it."""
    probabilities_case(dtype, scale_s, device="cuda")


# The H200 run of 2026-11-29 failed the case above at e4m3 460 and 470 and e5m2 57344 (o 55-58%
# off) and passed 4000 and 1e6. e5m2 1e6 gives only NaN and inf outputs, and so does e4m3 4000
# where torch converts e4m3fn overflow to NaN (as its older releases did; 448 in the torch of this
# checkout's CPU runs, where that case is not trivial). The interpreter with the
# GPU's satfinite conversion emulated (test_probabilities_under_the_gpus_conversion) passes all
# of them under both torch rules, so the conversion choice is not what differs. These cases tell
# the scale apart from the shape: the small shape (tiles 32x32, D = 16 padded to 32) at scales
# whose P * scale_s stays far from the range's end, and the near-range scales at a wider shape.
# At 32-row tiles the sm_90 compile ran every dot as mma.sync on fp16 (the fp8 operands widened
# by cvt.rn.f16x2.e4m3x2 / e5m2x2, no wgmma). The next H200 run (2026-11-29 ~01:55) failed all
# of these at the small shape alone, at every scale: o NaN on rows 8-15 of a 16-row mma tile,
# keys dropped from other rows. The chained dots (P feeding P v in registers) had the query
# tile's 32 rows on warpsPerCTA [4, 1], 64 rows of warps: the tile replicated across warps (the
# d256 dK/dV kernel, on mma.sync with its warps along N, passes). The GPU's query tiles now keep
# the table's 64 rows (tiles_for's DOT_ROWS_AXIS; wgmma, as at every passing shape), kept so by
# test_small_shapes_compile_without_replicated_mma.
P_SCALES_SMALL_SHAPE = [(E4M3, 256.0), (E4M3, 64.0), (E5M2, 32768.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, scale_s", P_SCALES_SMALL_SHAPE,
                         ids=[f"{d}-{s:g}".replace("torch.float8_", "") for d, s in P_SCALES_SMALL_SHAPE])
def test_gpu_small_shape_at_scales_inside_the_range(dtype, scale_s):
    probabilities_case(dtype, scale_s, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, scale_s", [(E4M3, 64.0), (E5M2, 32768.0)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("sizes", SMALL_SHAPES[1:], ids=[f"{q}x{kv}x{d}" for q, kv, d in SMALL_SHAPES[1:]])
def test_gpu_small_odd_shapes(dtype, scale_s, sizes):
    """More short odd sequences than the one that failed (fewer queries than keys and the reverse)."""
    probabilities_case(dtype, scale_s, device="cuda", sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, scale_s", P_SCALES[:2] + P_SCALES[3:4], ids=P_SCALE_IDS[:2] + P_SCALE_IDS[3:4])
def test_gpu_probabilities_near_the_fp8_range_at_wider_heads(dtype, scale_s):
    probabilities_case(dtype, scale_s, device="cuda", sizes=(200, 190, 64))


@pytest.mark.gpu
def test_gpu_forward_gqa_odd_float32_output():
    forward_case(E4M3, 2, 16, 4, 1999, 2077, 128, True, o_type=dg.float32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_backward_realistic(causal):
    backward_case(E4M3, E4M3, 2, 16, 16, 2048, 2048, 128, causal, device="cuda")


@pytest.mark.gpu
def test_gpu_backward_hybrid_gqa():
    backward_case(E4M3, E5M2, 2, 16, 4, 1024, 1536, 128, True, grad_type=dg.float32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 80, 256], ids=["d64", "d80", "d256"])
def test_gpu_head_dims(dim):
    """Head dims besides 128: 64, 80 (padded to a 128 tile, masked) and 256 (the wide tiles)."""
    forward_case(E4M3, 1, 8, 2, 777, 1029, dim, True, o_type=dg.float32, device="cuda")
    backward_case(E4M3, E5M2, 1, 8, 2, 777, 1029, dim, True, grad_type=dg.float32, device="cuda")


@pytest.mark.gpu
def test_gpu_backward_follows_the_frontends_graph():
    """amax_dP = max |dS| and dS in dO's type (e5m2) on the GPU's kernels and tiles."""
    tensors = backward_tensors(E4M3, E5M2, 1, 8, 2, 1000, 700, 128, True, device="cuda")
    g = backward_graph(tensors, True, grad_type=dg.float32)
    scales = scale_tensors(backward_scales(E4M3), "cuda")
    outputs = execute(g, {**tensors, **scales}, "cuda")
    expected = composed_backward({n: t.cpu() for n, t in tensors.items()}, {n: t.cpu() for n, t in scales.items()},
                                 True, 128 ** -0.5)
    assert math.isclose(outputs["sdpa_fp8_backward.amax_dP"].item(), expected["amax_dP"].item(), rel_tol=5e-3)
    for name in ("dq", "dk", "dv"):
        scale = backward_scales(E4M3)[f"scale_d{name[1].upper()}"]
        assert _relative_error(outputs[f"sdpa_fp8_backward.{name}"].cpu() / scale, expected[name]) < 2e-2, name
