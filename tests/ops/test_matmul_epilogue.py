"""The persistent GEMM's epilogue knobs on CPU (interpreter): column subtiles (the accumulator cut
into 2 or 4 column blocks, each running the one fused epilogue) and TMA stores (device-side
descriptors for outputs that qualify; pointer stores for the others), against the float64
reference with poisoned outputs; the knobs as config fields, candidates and cache records; the
kernels compiled for sm_90."""

from dataclasses import replace

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import check, compiled_for_sm90

SUBTILED = {parts: mm.MatmulConfig("persistent", 32, 64, 16, 4, 2, epilogue_subtile=parts, tma_store=True)
            for parts in (1, 2, 4)}
TORCH_OF = {dg.float32: torch.float32, dg.float16: torch.float16, dg.bfloat16: torch.bfloat16}


H100 = dg.target.H100


def _graph(dtype=dg.float32):
    return dg.Graph(name="mm", io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _source(g) -> str:
    return g.plan.launches[0].source_path.read_text()


def _tma_stores(g) -> int:
    return _source(g).count(".store([pid_m * BLOCK_M, start_n]")


def _bias_gelu_residual(dtype, batch, m, n, k):
    """y = gelu(a @ b + bias) + residual, the pre-activation value stored too (in fp32)."""
    g = _graph(dtype)
    a, b = g.tensor(name="a", dim=batch + [m, k]), g.tensor(name="b", dim=[k, n])
    bias, residual = g.tensor(name="bias", dim=[1, n]), g.tensor(name="residual", dim=batch + [m, n])
    pre = g.add(g.matmul(a, b), bias).set_output(True).set_name("pre").set_data_type(dg.float32)
    g.add(g.gelu(pre), residual).set_output(True).set_name("y")
    t = TORCH_OF[dtype]
    inputs = {"a": torch.randn(batch + [m, k]).to(t), "b": (torch.randn(k, n) / k ** 0.5).to(t),
              "bias": torch.randn(1, n).to(t), "residual": torch.randn(batch + [m, n]).to(t)}
    return g, inputs


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("dtype", [dg.float32, dg.float16, dg.bfloat16])
@pytest.mark.parametrize("batch", [[], [3]])
def test_subtiled_tma_store_renders_and_runs(parts, dtype, batch):
    """Odd M, N ragged against BLOCK_N (80 = 64 + 16: the last tile's second half lies past N),
    pitches of 16 bytes' multiples: both outputs go through descriptors, which clip at M and N."""
    options = dg.BuildOptions(matmul_config=SUBTILED[parts])
    g, inputs = _bias_gelu_residual(dtype, batch, 37, 80, 40)
    g.build(options=options)
    text = g.plan.launches[0].config_text
    assert text.startswith("persistent") and "tma-store" in text
    source = _source(g)
    assert source.count("tl.split(") == parts - 1 and source.count("acc = sub_") == (parts if parts > 1 else 0)
    assert "tl.make_tensor_descriptor" in source and _tma_stores(g) == 2 * parts
    assert "tl.store(c" not in source  # no pointer store left for the outputs
    check(g, inputs, TORCH_OF[dtype], tolerance=2e-5 if dtype is dg.float32 else 1e-2)


@pytest.mark.parametrize("parts", [2, 4])
def test_subtiles_with_pointer_stores(parts):
    """Subtiling alone: every store a masked pointer store over the subtile's columns."""
    options = dg.BuildOptions(matmul_config=mm.MatmulConfig("persistent", 32, 64, 16, 4, 2, epilogue_subtile=parts))
    g, inputs = _bias_gelu_residual(dg.float16, [2], 45, 72, 24)
    g.build(options=options)
    assert _tma_stores(g) == 0 and "tl.make_tensor_descriptor(c" not in _source(g)
    assert _source(g).count("acc = sub_") == parts
    check(g, inputs, torch.float16, tolerance=1e-2)


def test_outputs_that_do_not_qualify_keep_pointer_stores():
    """fp32 output with N = 45 (180-byte rows), a column-major output, an int32 output: pointer
    stores under the same subtiles; a 16-byte-pitch output in the same kernel still takes TMA."""
    options = dg.BuildOptions(matmul_config=SUBTILED[2])
    g = _graph()
    b_t = torch.randn(45, 32).t()  # K contiguous: a descriptor reads it whatever N is
    a, b = g.tensor(name="a", dim=[29, 32]), g.tensor_like(b_t, name="b")
    product = g.matmul(a, b)
    g.relu(product).set_output(True).set_name("rows_odd")
    g.sigmoid(product).set_output(True).set_name("transposed").set_stride([1, 29])
    g.cast(g.mul(product, product), data_type=dg.int32).set_output(True).set_name("whole")
    g.build(options=options)
    assert g.plan.launches[0].config_text.startswith("persistent")
    assert _tma_stores(g) == 0 and _source(g).count("tl.store(") == 3 * 2
    check(g, {"a": torch.randn(29, 32), "b": b_t})

    g = _graph()
    a, b = g.tensor(name="a", dim=[29, 32]), g.tensor(name="b", dim=[32, 48])
    product = g.matmul(a, b)
    g.relu(product).set_output(True).set_name("rows")
    g.tanh(product).set_output(True).set_name("transposed").set_stride([1, 29])
    g.build(options=options)
    assert _tma_stores(g) == 2 and _source(g).count("tl.store(") == 2
    check(g, {"a": torch.randn(29, 32), "b": torch.randn(32, 48)})


def test_unaligned_output_base_runs_the_pointer_kernel():
    """An output 4 bytes past 16-byte alignment cannot feed a descriptor: the tiled alternative
    runs (as for unaligned operands) and writes exactly the view."""
    options = dg.BuildOptions(matmul_config=SUBTILED[2])
    g = _graph()
    a, b = g.tensor(name="a", dim=[21, 32]), g.tensor(name="b", dim=[32, 40])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    g.build(options=options)
    assert _tma_stores(g) == 2
    buffer = torch.full((21 * 40 + 2,), float("nan"))
    y = buffer[1:-1].view(21, 40)
    at, bt = torch.randn(21, 32), torch.randn(32, 40)
    g.execute({"a": at, "b": bt, "y": y})
    torch.testing.assert_close(y.double(), torch.relu(at.double() @ bt.double()), rtol=1e-5, atol=1e-5)
    assert torch.isnan(buffer[0]) and torch.isnan(buffer[-1])


@pytest.mark.parametrize("mode", ["sum", "max", "norm2"])
@pytest.mark.parametrize("parts", [2, 4])
def test_row_exits_fold_over_subtiles(mode, parts):
    """A row reduction of an epilogue value: each subtile's part folds into the tile's partial."""
    options = dg.BuildOptions(matmul_config=SUBTILED[parts])
    g = _graph()
    a, b = g.tensor(name="a", dim=[2, 37, 24]), g.tensor(name="b", dim=[24, 100])
    y = g.silu(g.matmul(a, b)).set_output(True).set_name("y")
    g.reduction(y, mode, [2]).set_output(True).set_name("row")
    g.build(options=options)
    assert g.plan.groups[0].exits and _source(g).count("exit_0 = ") == parts
    check(g, {"a": torch.randn(2, 37, 24), "b": torch.randn(24, 100)})


def test_broadcast_scale_and_nan_inputs_through_subtiles():
    """A broadcast scalar operand applies to each subtile; NaN and inf in the inputs land where the
    reference has them (fp16 output, fp32 scale)."""
    options = dg.BuildOptions(matmul_config=SUBTILED[2])
    g = _graph(dg.float16)
    a, b = g.tensor(name="a", dim=[19, 16]), g.tensor(name="b", dim=[16, 64])
    alpha = g.tensor(name="alpha", dim=[1, 1], data_type=dg.float32)
    g.mul(g.matmul(a, b), alpha).set_output(True).set_name("y")
    g.build(options=options)
    assert g.plan.launches[0].config_text.startswith("persistent") and _tma_stores(g) == 2
    a_t = torch.randn(19, 16).half()
    a_t[3, 5], a_t[7, 0] = float("nan"), float("inf")
    check(g, {"a": a_t, "b": torch.randn(16, 64).half(), "alpha": torch.tensor([[0.5]])}, torch.float16)


def test_config_record_round_trip_and_limits():
    config = mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, epilogue_subtile=2, tma_store=True)
    record = config.to_record()
    assert mm.MatmulConfig.from_record(record) == config and "subtile2 tma-store" in config.text
    plain = mm.MatmulConfig("persistent", 128, 256, 64, 8, 3)
    assert "epilogue_subtile" not in plain.to_record() and "tma_store" not in plain.to_record()
    assert mm.MatmulConfig.from_record(plain.to_record()) == plain  # records written before the knobs
    for bad in ({"epilogue_subtile": 3}, {"epilogue_subtile": 8}, {"epilogue_subtile": 0},
                {"tma_store": 1}, {"epilogue_subtile": True}):
        with pytest.raises(ValueError):
            mm.MatmulConfig.from_record({**record, **bad})


def test_candidates_keep_the_model_choice_and_offer_the_knobs():
    """The subtiled TMA-store twin of the 128x256 persistent tile is a candidate ranked right
    after its plain tile (same estimate), so autotuning times it and the model's first choice
    stays."""
    device = H100
    problem = mm.MatmulProblem(1, 4096, 4096, 4096, "bf16", 2, 2, 2, True, "row", "row", "add,gelu")
    ranked = mm.schedule(problem, device).ranked
    first = ranked[0]
    assert (first.variant, first.block_m, first.block_n, first.epilogue_subtile, first.tma_store) == \
        ("persistent", 128, 256, 1, False)
    twin = ranked[1]
    assert (twin.block_m, twin.block_n, twin.epilogue_subtile, twin.tma_store) == (128, 256, 2, True)
    assert twin.estimate_us == first.estimate_us
    subtiled = [c for c in ranked if c.epilogue_subtile > 1]
    assert {(c.block_m, c.block_n) for c in subtiled} == {(128, 256)}
    assert all(c.variant == "persistent" and c.tma_store for c in subtiled)
    no_tma = mm.MatmulProblem(1, 4096, 4096, 4096, "bf16", 2, 2, 2, False, "row", "row")
    assert all(c.epilogue_subtile == 1 for c in mm.candidates(no_tma, device))


def test_a_wide_epilogue_takes_the_subtiled_tile():
    """An epilogue reading two [M, N] operands and storing two outputs (8 bytes per element: a
    Llama MLP's backward through its down projection) spills on the plain 128x256 tile, so the
    model's first choice is its subtiled TMA-store twin; its staging counts the stored bytes
    only (two bf16 outputs fit beside three operand stages, four tiles would not)."""
    device = H100
    wide = mm.MatmulProblem(1, 4096, 14336, 4096, "bf16", 2, 2, 8, True, "row", "row", "mul,silu_backward", 4)
    first = mm.schedule(wide, device).ranked[0]
    assert (first.variant, first.block_m, first.block_n, first.epilogue_subtile, first.tma_store) == \
        ("persistent", 128, 256, 2, True)
    assert mm.shared_bytes(first, wide) == 3 * (128 * 64 + 64 * 256) * 2 + 128 * 128 * 4
    unknown_stores = replace(wide, store_bytes=None)  # all 8 bytes staged: 4 subtiles fit, not 2
    assert {c.epilogue_subtile for c in mm.candidates(unknown_stores, device)} == {1, 4}
    assert mm.schedule(unknown_stores, device).ranked[0].epilogue_subtile == 4
    staged_too_much = replace(wide, out_bytes=24, store_bytes=24)  # 4 subtiles would not fit either
    assert all(c.epilogue_subtile == 1 for c in mm.candidates(staged_too_much, device))
    assert wide.signature() != unknown_stores.signature()
    # a problem storing all it touches keeps the signature (and the tuning records) it had
    assert replace(wide, store_bytes=8).signature() == unknown_stores.signature()
    memory_bound = replace(wide, n=4096, k=1024, out_bytes=15)  # at the HBM floor the spill still costs
    first = mm.schedule(memory_bound, device).ranked[0]
    assert first.block_m * first.block_n // (first.num_warps * 32 * first.epilogue_subtile) <= 64
    narrow = replace(wide, out_bytes=4, store_bytes=2, epilogue="mul")  # silu(gate) * up: no spill
    assert mm.schedule(narrow, device).ranked[0].epilogue_subtile == 1
    spilled = mm.MatmulConfig("persistent", 128, 128, 64, 4, 4)  # 128 accumulators per thread
    kept = mm.MatmulConfig("persistent", 128, 128, 64, 8, 4)
    assert mm.estimate(spilled, wide, device) > mm.estimate(spilled, narrow, device)
    just_narrow = replace(wide, out_bytes=5)  # same tiles and traffic model, under the threshold
    assert mm.estimate(kept, wide, device) < mm.estimate(kept, just_narrow, device) * 1.1  # no spill penalty
    assert mm.estimate(spilled, wide, device) > mm.estimate(spilled, just_narrow, device) * 1.5


def test_the_llama_mlp_backward_epilogue_is_planned_subtiled():
    """Through the plan: d_up = dh * silu(gate), d_gate = silu_backward(dh * up, gate) with
    dh = dy @ w.T, for an H100, stages both outputs through descriptors on the subtiled tile."""
    g = _graph(dg.bfloat16)
    dy, w = g.tensor(name="dy", dim=[4096, 4096]), g.tensor(name="w", dim=[14336, 4096])
    gate, up = g.tensor(name="gate", dim=[4096, 14336]), g.tensor(name="up", dim=[4096, 14336])
    dh = g.matmul(dy, g.transpose(w, [1, 0]))
    g.mul(dh, g.silu(gate)).set_output(True).set_name("d_up")
    g.silu_backward(g.mul(dh, up), gate).set_output(True).set_name("d_gate")
    g.build(options=dg.BuildOptions(target=H100))
    (launch,) = g.plan.launches
    assert "128x256x64" in launch.config_text and "subtile2 tma-store tma-stores=2" in launch.config_text


def test_forced_knobs_without_descriptors_run_tiled():
    """Operands no descriptor can read (odd pitches): the forced persistent config becomes the
    tiled kernel, without the persistent-only knobs."""
    options = dg.BuildOptions(matmul_config=SUBTILED[2])
    g = _graph()
    a, b = g.tensor(name="a", dim=[21, 33]), g.tensor(name="b", dim=[33, 45])
    g.relu(g.matmul(a, b)).set_output(True).set_name("y")
    g.build(options=options)
    assert g.plan.launches[0].config_text.startswith("tiled") and "subtile" not in g.plan.launches[0].config_text
    check(g, {"a": torch.randn(21, 33), "b": torch.randn(33, 45)})


# --- the GPU compiler (no GPU needed) -------------------------------------------------------------
SM90_CONFIGS = [mm.MatmulConfig("persistent", 128, 256, 64, 8, 3, flatten=flatten, warp_specialize=specialize,
                                epilogue_subtile=parts, tma_store=tma)
                for parts, tma, flatten, specialize in [(2, False, False, False), (2, True, False, False),
                                                        (2, True, True, False), (4, True, False, False),
                                                        (1, True, False, False), (2, True, False, True)]]
SM90_CONFIGS.append(mm.MatmulConfig("persistent", 256, 128, 64, 8, 4, epilogue_subtile=2, tma_store=True))


def sm90_graphs():
    """bf16 bias + gelu (+ a batched residual with a row exit) under each subtile / TMA-store knob
    (for tests/sm90_compile.py)."""
    for config in SM90_CONFIGS:
        for batched in (False, True):
            g = _graph(dg.bfloat16)
            batch = [2] if batched else []
            a, b = g.tensor(name="a", dim=batch + [512, 256]), g.tensor(name="b", dim=[256, 512])
            bias = g.tensor(name="bias", dim=[1, 512])
            y = g.gelu(g.add(g.matmul(a, b), bias))
            if batched:
                y = g.add(y, g.tensor(name="residual", dim=batch + [512, 512]))
                g.reduction(y, "amax", [2]).set_output(True).set_name("row")
            y.set_output(True).set_name("y")
            g.build(options=dg.BuildOptions(matmul_config=config))
            assert g.plan.launches[0].config_text.startswith(config.text)
            yield f"{config.text} batched={batched}", g


def test_subtiled_tma_store_kernels_compile_for_sm90():
    """What only the GPU compiler rejects (a split of the accumulator layout, a descriptor store
    from the epilogue's layout, the warp-specialized loop) fails here."""
    assert f"compiled {len(SM90_CONFIGS) * 3} kernels for sm_90" in compiled_for_sm90("test_matmul_epilogue:sm90_graphs")


@pytest.mark.parametrize("record, why", [
    ({"variant": "tiled", "epilogue_subtile": 2}, "persistent-kernel knobs"),
    ({"variant": "split_k", "tma_store": True}, "persistent-kernel knobs"),
    ({"variant": "persistent", "block_n": 32, "epilogue_subtile": 4}, "narrower than 16"),
])
def test_records_with_knobs_a_kernel_ignores_or_cannot_render_are_refused(record, why):
    full = {"variant": "persistent", "block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8,
            "num_stages": 3, **record}
    with pytest.raises(ValueError, match=why):
        mm.MatmulConfig.from_record(full)


def test_launch_text_counts_the_outputs_stored_through_descriptors():
    """The config label says how many outputs the TMA-store knob reached: none under flatten, or
    for an output with several row axes."""
    for config, stored in ((mm.MatmulConfig("persistent", 32, 64, 16, 4, 2, epilogue_subtile=2, tma_store=True), 1),
                           (mm.MatmulConfig("persistent", 32, 64, 16, 4, 2, flatten=True, tma_store=True), 0)):
        g = dg.Graph(name="mm")
        a, b = g.tensor(name="a", dim=[40, 48]), g.tensor(name="b", dim=[48, 72])
        g.relu(g.matmul(a, b)).set_output(True).set_name("y")
        g.build(options=dg.BuildOptions(matmul_config=config))
        assert f"tma-stores={stored}" in g.plan.launches[0].config_text
