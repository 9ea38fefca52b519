"""Matmul on the GPU: bf16 and fp8 (the interpreter's bf16 dot is wrong), every variant at real
tile sizes, TMA descriptors, unaligned bindings, row exits and autotune."""
import pytest
import torch

import dnngraph as dg
from dnngraph.heuristics import matmul as mm
from helpers import check, poisoned
from test_matmul import _storage

pytestmark = pytest.mark.gpu

GPU_VARIANTS = {
    "tiled": mm.MatmulConfig("tiled", 128, 128, 64, 8, 3),
    "small_m": mm.MatmulConfig("small_m", 16, 64, 128, 4, 4),
    "split_k": mm.MatmulConfig("split_k", 64, 64, 64, 4, 4, split_k=4),
    "persistent": mm.MatmulConfig("persistent", 128, 256, 64, 8, 3),
    "persistent_subtiled": mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2, tma_store=True),
}
EPILOGUE_KNOBS = [mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, flatten=True, epilogue_subtile=2, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=4, tma_store=True),
                  mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, tma_store=True),
                  mm.MatmulConfig("persistent", 256, 128, 64, 8, 4, epilogue_subtile=2, tma_store=True)]


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.fixture(params=sorted(GPU_VARIANTS))
def gpu_variant(request):
    """One kernel variant, forced (forced(gpu_variant)) whatever the model would pick."""
    return request.param


def forced(variant: str) -> dg.BuildOptions:
    """Options running kernel variant `variant` whatever the model would pick."""
    return dg.BuildOptions(matmul_config=GPU_VARIANTS[variant])


@pytest.mark.parametrize("layouts", [("row", "row"), ("padded_col", "padded_col"), ("row", "col"),
                                     ("sliced", "row")])
def test_bf16_bias_gelu_every_variant(gpu_variant, layouts):
    m, n, k = 1000, 777, 1003
    a_t = _storage([m, k], layouts[0], torch.bfloat16, "cuda")
    b_t = _storage([k, n], layouts[1], torch.bfloat16, "cuda")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    bias = g.tensor(name="bias", dim=[1, n])
    pre = g.add(g.matmul(a, b), bias).set_output(True).set_name("pre")
    g.gelu(pre).set_output(True).set_name("y")
    check(g, {"a": a_t, "b": b_t, "bias": torch.randn(1, n, device="cuda").bfloat16()}, torch.bfloat16, "cuda",
          options=forced(gpu_variant))


def test_model_choice_large_square_and_batched():
    for shape_a, shape_b in (([2048, 2048], [2048, 2048]), ([3, 1, 257, 512], [4, 512, 384])):
        g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
        a, b = g.tensor(name="a", dim=shape_a), g.tensor(name="b", dim=shape_b)
        g.silu(g.matmul(a, b)).set_output(True).set_name("y")
        inputs = {"a": torch.randn(shape_a).bfloat16(), "b": (torch.randn(shape_b) / 16).bfloat16()}
        check(g, _cuda(inputs), torch.bfloat16, "cuda")


def test_persistent_tma_is_chosen_and_unaligned_bindings_fall_back():
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[4096, 4096]), g.tensor(name="b", dim=[4096, 4096])
    c = g.matmul(a, b).set_output(True).set_name("c")
    g.build()
    assert g.plan.launches[0].config_text.startswith("persistent")
    at, bt = torch.randn(4096, 4096).bfloat16().cuda(), (torch.randn(4096, 4096) / 64).bfloat16().cuda()
    check(g, {"a": at, "b": bt}, torch.bfloat16, "cuda")
    # the same values one element past alignment: the tiled alternative runs
    storage = torch.empty(4096 * 4096 + 8, dtype=torch.bfloat16, device="cuda")
    shifted = storage[1:1 + 4096 * 4096].view(4096, 4096)
    shifted.copy_(at)
    out = poisoned(c, "cuda")
    g.execute({"a": shifted, "b": bt, "c": out})
    ref = (at.float() @ bt.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1.6e-2


@pytest.mark.parametrize("types", [(dg.float8_e4m3, dg.float8_e4m3), (dg.float8_e5m2, dg.float8_e5m2),
                                   (dg.float8_e4m3, dg.float8_e5m2)])
@pytest.mark.parametrize("m", [1, 300, 2048])
def test_fp8_with_per_tensor_scales(types, m):
    n, k = 1024, 2048
    a_t = (torch.randn(m, k, device="cuda") * 4).to(types[0].torch_dtype)
    b_t = (torch.randn(n, k, device="cuda") * 4).to(types[1].torch_dtype).t()  # K-major B, as fp8 GEMMs store it
    g = dg.Graph(name="fp8", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    sa = g.tensor(name="sa", dim=[1, 1], data_type=dg.float32)
    sb = g.tensor(name="sb", dim=[1, 1], data_type=dg.float32)
    y = g.matmul(a, b, scale_a=sa, scale_b=sb).set_output(True).set_name("y")
    g.reduction(y, "amax", [1]).set_output(True).set_name("amax")
    inputs = {"a": a_t, "b": b_t, "sa": torch.tensor([[0.05]], device="cuda"),
              "sb": torch.tensor([[0.02]], device="cuda")}
    check(g, inputs, torch.bfloat16, "cuda")


def test_fp16_and_tf32():
    for dtype, tf32 in ((dg.float16, False), (dg.float32, True), (dg.float32, False)):
        g = dg.Graph(name="mm", io_data_type=dtype, allow_tf32=tf32)
        a, b = g.tensor(name="a", dim=[513, 1000]), g.tensor(name="b", dim=[1000, 257])
        g.relu(g.matmul(a, b)).set_output(True).set_name("y")
        inputs = {"a": torch.randn(513, 1000).to(dtype.torch_dtype), "b": torch.randn(1000, 257).to(dtype.torch_dtype)}
        check(g, _cuda(inputs), dtype.torch_dtype if not tf32 else torch.float16, "cuda",
              tolerance=2e-3 if tf32 else None)


def test_row_exits_and_prologue_bf16(gpu_variant):
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[600, 1024], data_type=dg.float32)
    w = g.tensor(name="w", dim=[1024, 900])
    a = g.cast(g.mul(x, 0.5), data_type=dg.bfloat16)
    y = g.gelu_tanh(g.matmul(a, w)).set_output(True).set_name("y")
    g.reduction(y, "amax", [1]).set_output(True).set_name("amax")
    g.reduction(y, "sum", [1]).set_output(True).set_name("sum")
    inputs = {"x": torch.randn(600, 1024), "w": (torch.randn(1024, 900) / 32).bfloat16()}
    check(g, _cuda(inputs), torch.bfloat16, "cuda", options=forced(gpu_variant))


@pytest.mark.parametrize("config", EPILOGUE_KNOBS, ids=lambda c: c.text.replace(" ", "_"))
def test_subtiled_tma_store_epilogue(config):
    """Batched bias + gelu + residual, the pre-activation stored in fp32 too, N ragged against the
    tile (1000 = 3 x 256 + 232): every output through descriptors, clipped at M and N; an output
    whose base is 4 bytes past alignment runs the tiled alternative."""
    options = dg.BuildOptions(matmul_config=config)
    m, n, k = 1000, 1000, 1024
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[2, m, k]), g.tensor(name="b", dim=[k, n])
    bias, residual = g.tensor(name="bias", dim=[1, n]), g.tensor(name="residual", dim=[2, m, n])
    pre = g.add(g.matmul(a, b), bias).set_output(True).set_name("pre").set_data_type(dg.float32)
    g.add(g.gelu(pre), residual).set_output(True).set_name("y")
    g.build(options=options)
    assert g.plan.launches[0].config_text.startswith(config.text)
    stores = g.plan.launches[0].source_path.read_text().count(".store([pid_m * BLOCK_M, start_n]")
    # the fp32 side output's staging buffer does not fit beside every tile's operand stages: it
    # keeps a pointer store there
    # (none under flatten, whose cross-tile pipeline needs shared memory of its own)
    stored = config.tma_store and not config.flatten
    assert stores % config.epilogue_subtile == 0 and (0 < stores <= 2 * config.epilogue_subtile) == stored
    inputs = {"a": torch.randn(2, m, k), "b": torch.randn(k, n) / 32, "bias": torch.randn(1, n),
              "residual": torch.randn(2, m, n)}
    inputs = {name: t.bfloat16().cuda() for name, t in inputs.items()}
    check(g, inputs, torch.bfloat16, "cuda")
    buffer = torch.full((2 * m * n + 2,), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = buffer[1:-1].view(2, m, n)
    pre_t = poisoned(next(t for t in g.outputs() if t.name == "pre"), "cuda")
    g.execute({**inputs, "y": y, "pre": pre_t})
    reference = g.reference({name: t.cpu() for name, t in inputs.items()})["y"]
    assert (y.double().cpu() - reference).norm() / reference.norm() < 1.6e-2
    assert torch.isnan(buffer[0]) and torch.isnan(buffer[-1])


def test_autotune_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "3")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[1024, 1024]), g.tensor(name="b", dim=[1024, 2048])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    g.build(autotune=True)
    record = g.plan.launches[0].tuning
    assert record.source == "tuned" and len(record.timings) == 3
    assert all(ms > 0 for _, _, ms in record.timings)
    inputs = {"a": torch.randn(1024, 1024).bfloat16(), "b": (torch.randn(1024, 2048) / 32).bfloat16()}
    check(g, _cuda(inputs), torch.bfloat16, "cuda")
    g.build(autotune=True)
    assert g.plan.launches[0].tuning.source == "cache"


@pytest.mark.parametrize("m, n, k", [(1, 13, 1), (4, 5, 1), (13, 1, 16), (16, 13, 16), (3, 20, 7), (37, 3, 5)])
@pytest.mark.parametrize("layouts", [("row", "row"), ("col", "padded_col"), ("sliced", "row")])
def test_axes_shorter_than_their_tile(m, n, k, layouts):
    """M or N below the block: wrapped tile indices carry no contiguity hints (they faulted)."""
    torch.manual_seed(m * 100 + n)
    a_t = _storage([3, m, k], layouts[0], torch.bfloat16, "cuda")
    b_t = _storage([k, n], layouts[1], torch.bfloat16, "cuda")
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
    c = g.tensor(name="c", dim=[1, 1, n])
    y = g.sigmoid(g.add(g.matmul(a, b), c)).set_output(True)
    g.reduction(y, "norm1", [2]).set_output(True)
    check(g, {"a": a_t, "b": b_t, "c": torch.randn(1, 1, n, device="cuda").bfloat16()}, torch.bfloat16,
          device="cuda")


@pytest.mark.parametrize("variant", ["tiled", "small_m", "split_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n, k", [(37, 3, 1), (301, 203, 1), (301, 203, 37), (1001, 777, 64)])
def test_contiguous_m_and_n_axes_whose_size_splits_a_vector(variant, dtype, m, n, k):
    """An M-contiguous A (or N-contiguous B) whose size is no multiple of a 16-byte vector: the
    last tile's wrap falls mid-vector, so the contiguity hints must go (37 rows faulted)."""
    torch.manual_seed(m + n + k)
    io = dg.float32 if dtype == torch.float32 else dg.bfloat16
    for a_layout in ("col", "row"):
        a_t = _storage([m, k], a_layout, dtype, "cuda")
        b_t = _storage([k, n], "row", dtype, "cuda")
        g = dg.Graph(name="mm", io_data_type=io)
        a, b = g.tensor_like(a_t, name="a"), g.tensor_like(b_t, name="b")
        g.matmul(a, b).set_output(True).set_data_type(dg.float16)
        check(g, {"a": a_t, "b": b_t}, torch.float16, "cuda", options=forced(variant))
