"""Matmul precision at kernel boundaries: which tensor cores a dot of two types runs on (as data),
the candidate tiles of fp32, tf32 and mixed problems, and mixed fp32 x fp16 kernels on CPU
(the interpreter's bf16 dot is wrong: bf16 pairs run on the GPU, in the tests marked gpu, with tf32
in every layout and IEEE fp32 on FMA units, each against the float64 reference)."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check
from test_matmul import VARIANTS, _storage

DEVICE = dg.target.H100
TRITON = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
          "float8_e4m3": "tl.float8e4nv", "float8_e5m2": "tl.float8e5"}


def _dot(a, b, tf32=False):
    return mm.choose_dot(a, b, TRITON[a], TRITON[b], tf32)


@pytest.mark.parametrize("a,b,dot", [
    ("float32", "bfloat16", "bf16"), ("float32", "float16", "fp16"), ("float16", "bfloat16", "bf16"),
    ("float8_e4m3", "float16", "fp16"), ("float8_e5m2", "bfloat16", "bf16"), ("float8_e4m3", "float32", "bf16"),
    ("float8_e4m3", "float8_e5m2", "fp16"), ("bfloat16", "bfloat16", "bf16"), ("float16", "float16", "fp16")])
def test_mixed_pairs_take_the_narrower_tensor_cores(a, b, dot):
    for first, second in ((a, b), (b, a)):  # the rule is symmetric
        for tf32 in (False, True):  # tf32 only concerns fp32 x fp32
            choice = _dot(first, second, tf32)
            assert (choice.dot, choice.precision) == (dot, "")
            assert choice.a_type == choice.b_type == {"bf16": "tl.bfloat16", "fp16": "tl.float16"}[dot]


def test_fp8_keeps_its_own_type_and_fp32_pairs_follow_tf32():
    assert _dot("float8_e4m3", "float8_e4m3") == mm.DotChoice("tl.float8e4nv", "tl.float8e4nv", "fp8", "")
    assert _dot("float32", "float32") == mm.DotChoice("tl.float32", "tl.float32", "fp32", "ieee")
    assert _dot("float32", "float32", True) == mm.DotChoice("tl.float32", "tl.float32", "tf32", "tf32")


def _problem(dot, a_bytes, b_bytes, layouts=("row", "row"), tma=True, m=4096, n=4096, k=4096):
    return mm.MatmulProblem(1, m, n, k, dot, a_bytes, b_bytes, 2, tma, *layouts)


def test_ieee_fp32_candidates_are_fma_tiles_that_fit_registers():
    problem = _problem("fp32", 4, 4)
    tiles = {(c.block_m, c.block_n, c.block_k, c.num_warps) for c in mm.candidates(problem, DEVICE) if c.split_k == 1}
    assert tiles == {(128, 128, 32, 8), (128, 128, 16, 8), (128, 64, 32, 4), (64, 128, 32, 4), (64, 64, 32, 4)}
    best = mm.schedule(problem, DEVICE).config
    assert best.variant == "tiled" and (best.block_m, best.block_n, best.block_k, best.num_warps) in tiles
    # FMA rate: tens of TFLOP/s, not the tensor-core rate
    tflops = 2 * 4096 ** 3 / (best.estimate_us * 1e-6) / 1e12
    assert 25 < tflops < 60


def test_tf32_candidates_use_half_k_steps_and_wgmma_tiles():
    problem = _problem("tf32", 4, 4, ("row", "col"))
    ranked = mm.rank(problem, DEVICE)
    assert all(c.block_k == 32 for c in ranked if c.variant != "small_m")
    assert any(c.variant == "persistent" for c in ranked)
    assert all(mm.shared_bytes(c, problem) <= DEVICE.shared_memory for c in ranked)
    tflops = 2 * 4096 ** 3 / (ranked[0].estimate_us * 1e-6) / 1e12
    assert 250 < tflops < 400


def test_mixed_problem_ranks_wgmma_tiles_at_the_16_bit_rate():
    """fp32 A x bf16 B: 16-bit K steps, staging sized for the 4-byte A tile, near the bf16 rate."""
    mixed = _problem("bf16", 4, 2, tma=False)
    pure = _problem("bf16", 2, 2, tma=False)
    best_mixed, best_pure = mm.schedule(mixed, DEVICE).config, mm.schedule(pure, DEVICE).config
    assert best_mixed.block_k == 64 and best_mixed.block_m * best_mixed.block_n >= 128 * 128
    assert all(mm.shared_bytes(c, mixed) <= DEVICE.shared_memory for c in mm.candidates(mixed, DEVICE))
    assert best_mixed.estimate_us < 1.3 * best_pure.estimate_us
    # the converted side's tile is the short one: B converted gets wide-M tiles, A wide-N ones
    best_b = mm.schedule(_problem("bf16", 2, 4, tma=False), DEVICE).config
    assert best_mixed.block_n > best_mixed.block_m and best_b.block_m > best_b.block_n


def _mixed_graph(a_type, b_type, m, n, k, a_layout, b_layout):
    tensors = {"a": _storage([m, k], a_layout, a_type.torch_dtype), "b": _storage([k, n], b_layout, b_type.torch_dtype)}
    g = dg.Graph(name="mixed", io_data_type=dg.float16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    return g, tensors


@pytest.mark.parametrize("variant_name", ["tiled", "split_k", "persistent"])
@pytest.mark.parametrize("a_type,b_type", [(dg.float32, dg.float16), (dg.float16, dg.float32)])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "padded_col"), ("sliced", "row")])
def test_mixed_fp32_fp16_with_bias_residual_epilogue(variant_name, a_type, b_type, layouts):
    options = dg.BuildOptions(matmul_config=VARIANTS[variant_name])
    m, n, k = 37, 45, 53
    g, tensors = _mixed_graph(a_type, b_type, m, n, k, *layouts)
    a, b = g.tensor_like(tensors["a"], name="a"), g.tensor_like(tensors["b"], name="b")
    bias = g.tensor(name="bias", dim=[1, n], data_type=dg.float32)
    residual = g.tensor(name="residual", dim=[m, n])
    product = g.matmul(a, b)
    g.add(g.gelu(g.add(product, bias)), residual).set_output(True).set_name("y").set_data_type(dg.float32)
    g.build(options=options)
    source = g.plan.launches[0].source_path.read_text()
    assert "input_precision" not in source and ".to(tl.float16)" in source  # the fp32 side converts at load
    assert not g.plan.launches[0].config_text.startswith("persistent")  # no descriptor for a converted operand
    tensors.update(bias=torch.randn(1, n), residual=torch.randn(m, n).half())
    check(g, tensors, torch.float16)


def test_mixed_with_prologues_on_both_sides():
    """A: an fp32 virtual tensor (scaled activations) x B: relu of an fp16 weight, odd K."""
    options = dg.BuildOptions(matmul_config=VARIANTS["tiled"])
    g = dg.Graph(name="mixed", io_data_type=dg.float16, intermediate_data_type=dg.float32)
    x = g.tensor(name="x", dim=[2, 19, 45], data_type=dg.float32)
    scale = g.tensor(name="scale", dim=[1, 1, 45], data_type=dg.float32)
    w = g.tensor(name="w", dim=[45, 23])
    a = g.silu(g.mul(x, scale))
    assert a.data_type is dg.float32
    g.matmul(a, g.relu(w)).set_output(True).set_name("y")
    g.build(options=options)
    assert len(g.plan.launches) == 1 and g.plan.groups[0].prologue
    assert ".to(tl.float16)" in g.plan.launches[0].source_path.read_text()
    check(g, {"x": torch.randn(2, 19, 45), "scale": torch.rand(1, 1, 45), "w": torch.randn(45, 23).half()},
          torch.float16)


def test_mixed_keeps_fp16_accuracy_not_fp32():
    """The fp32 operand is rounded to fp16: the error is fp16's, and differs from an fp32 matmul."""
    torch.manual_seed(3)
    m, n, k = 33, 31, 257
    at, bt = torch.randn(m, k), torch.randn(k, n).half()
    g = dg.Graph(name="mixed", io_data_type=dg.float32)
    g.matmul(g.tensor_like(at, name="a"), g.tensor_like(bt, name="b")).set_output(True).set_name("c")
    out = check(g, {"a": at, "b": bt}, torch.float16)["c"]
    rounded = (at.half().double() @ bt.double()).float()
    assert torch.allclose(out, rounded, rtol=1e-4, atol=1e-3)  # what the rule computes


# --- on the GPU: bf16 tensor cores, tf32 in every layout, IEEE fp32 ------------------------------
TF32_TOLERANCE = 2e-3  # 10 mantissa bits: near 3e-4 on these sizes


IEEE_TOLERANCE = 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("a_type,b_type", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "padded_col"), ("sliced", "row")])
def test_mixed_fp32_bf16_rounds_to_bf16(a_type, b_type, layouts):
    m, n, k = 1000, 777, 1003
    a_t, b_t = _storage([m, k], layouts[0], a_type, "cuda"), _storage([k, n], layouts[1], b_type, "cuda")
    g = dg.Graph(name="mixed", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    bias = g.tensor(name="bias", dim=[1, n], data_type=dg.float32)
    g.silu(g.add(g.matmul(a, b), bias)).set_output(True).set_name("y")
    g.build()
    assert "tl.dot(" in g.plan.launches[0].source_path.read_text() and "input_precision" not in \
        g.plan.launches[0].source_path.read_text()
    check(g, {"a": a_t, "b": b_t, "bias": torch.randn(1, n, device="cuda")}, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_fp32_virtual_tensor_feeding_a_bf16_weight():
    """The Llama-MLP pattern: a norm's fp32 output (a virtual tensor) times a bf16 weight."""
    g = dg.Graph(name="mlp", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    x, scale = g.tensor(name="x", dim=[513, 384]), g.tensor(name="scale", dim=[1, 384])
    w = g.tensor(name="w", dim=[384, 1000])
    normed = g.rmsnorm(x, scale, epsilon=1e-5, norm_forward_phase="inference")[0]
    assert normed.data_type is dg.float32
    g.matmul(normed, w).set_output(True).set_name("y")
    inputs = {"x": torch.randn(513, 384).bfloat16(), "scale": torch.rand(1, 384).bfloat16(),
              "w": (torch.randn(384, 1000) / 20).bfloat16()}
    check(g, {k: v.cuda() for k, v in inputs.items()}, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layouts", [("row", "row"), ("row", "col"), ("col", "row"), ("padded_col", "sliced")])
def test_tf32_every_layout(layouts):
    m, n, k = 1031, 999, 1017
    a_t, b_t = _storage([m, k], layouts[0], torch.float32, "cuda"), _storage([k, n], layouts[1], torch.float32, "cuda")
    g = dg.Graph(name="tf32", io_data_type=dg.float32, allow_tf32=True)
    g.relu(g.matmul(g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b"))).set_output(True).set_name("y")
    check(g, {"a": a_t, "b": b_t}, tolerance=TF32_TOLERANCE, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1031, 999, 1017), (7, 4096, 2048), (2, 300, 301, 257)])
def test_ieee_fp32_is_fp32_accurate(shape):
    *batch, m, n, k = shape
    a_t = torch.randn(*batch, m, k, device="cuda")
    b_t = _storage([k, n], "col", torch.float32, "cuda")
    g = dg.Graph(name="ieee", io_data_type=dg.float32)
    g.matmul(g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")).set_output(True).set_name("c")
    check(g, {"a": a_t, "b": b_t}, tolerance=IEEE_TOLERANCE, device="cuda")
