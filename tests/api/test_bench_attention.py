"""benchmarks/bench_attention.py keeps working: its shape list, its FLOP counts and its CPU check."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import bench_attention as bench  # noqa: E402


def test_list_shapes_prints_every_row(capsys):
    bench.main(["--list-shapes"])
    text = capsys.readouterr().out
    for shape in bench.TRAINING + bench.DECODE + bench.CPU_TRAINING + bench.CPU_DECODE:
        assert f"| {shape.label} | {shape.describe()} |" in text
    assert "| window 1k @8k | B1 H32 S8192 D128 causal left 1024 | 0.1172 | 128.9 |" in text


@pytest.mark.parametrize("shape", [s for s in bench.TRAINING + bench.CPU_TRAINING + bench.CPU_DECODE
                                   if s.s_q * s.s_kv <= 8192 * 8192], ids=lambda s: s.label)
def test_visible_pairs_count_the_mask(shape):
    assert shape.visible_pairs() == int(bench.visible_mask(shape, "cpu").sum())


def test_work_counts():
    causal = bench.attn("causal", 2, 3, 10, 16, causal=True)
    assert causal.visible_pairs() == 55  # 10 * 11 / 2
    assert causal.work() == 4 * 2 * 3 * 16 * 55
    assert causal.work(backward=True) == 2.5 * causal.work()
    decode = bench.DECODE[0]
    assert decode.kv_bytes == 2 * 64 * 8 * 8192 * 128 * 2


def test_paged_pool_gathers_back():
    import torch

    value = torch.randn(3, 2, 40, 16)
    pool, table = bench.page_pool(value, 16, torch.Generator().manual_seed(1))
    assert pool.shape == (9, 2, 16, 16) and table.shape == (3, 1, 3, 1) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == list(range(9))
    assert torch.equal(bench.gather_kv(pool, table, 40), value)


def test_check_cpu_passes_or_waits_for_kernels(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--check-cpu", "--reuse-cache"])
        raise SystemExit(0)
    text = capsys.readouterr().out
    assert done.value.code in (0, 2), text
    assert "FAILED" not in text
    assert "torch ref vs g.reference" in text


def test_block_sparse_shapes_open_their_density_and_the_diagonal():
    import torch

    for shape in (s for s in bench.TRAINING if s.density is not None):  # many blocks: near the rate
        blocks = bench.shape_block_mask(shape, "cpu")[0, 0]
        assert blocks.shape == shape.mask_blocks and blocks.diagonal().all()
        assert abs(blocks.float().mean().item() - shape.density) < 0.15, shape.label
    shape = next(s for s in bench.CPU_TRAINING if s.density is not None)
    visible = bench.visible_mask(shape, "cpu")
    blocks = bench.shape_block_mask(shape, "cpu")[0, 0]
    assert torch.equal(visible[::shape.mask_block, ::shape.mask_block], blocks)


def test_fp8_rows_list_their_anchors_and_check_on_cpu(capsys):
    """The fp8 rows: their shapes with dnngraph's bf16 kernel and the frontend's sdpa_fp8 as
    anchors, and the CPU check of dnngraph's fp8 kernels (and g.reference) against the float
    attention of the dequantized inputs."""
    bench.main(["--list-shapes", "--rows", "fp8_fwd,fp8_bwd"])
    text = capsys.readouterr().out
    for shape in bench.FP8_SHAPES + bench.CPU_FP8:
        assert f"| {shape.label} | {shape.describe()} |" in text
    assert "| dnngraph bf16, cuDNN FE fp8 |" in text
    assert bench.main(["--check-cpu", "--reuse-cache", "--rows", "fp8_fwd,fp8_bwd", "--only", "gqa"]) == 0
    text = capsys.readouterr().out
    assert "| fp8_bwd | cpu fp8 gqa causal |" in text and "FAILED" not in text
