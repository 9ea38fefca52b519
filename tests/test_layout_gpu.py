"""Layout ops on the GPU: bf16 at realistic sizes, views that start off 16-byte boundaries
(the launches that do not assume aligned pointers), attention in BSHD through transposes."""
import pytest
import torch

import dnngraph as dg
from helpers import check

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _graph(inputs, io=dg.bfloat16):
    g = dg.Graph(io_data_type=io, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    return g, {n: g.tensor_like(v, n) for n, v in inputs.items()}


def test_transpose_copy_and_concat_bf16():
    gen = torch.Generator(device=CUDA).manual_seed(1)
    inputs = {"x": torch.randn(1031, 2049, generator=gen, device=CUDA).bfloat16()}
    g, t = _graph(inputs)
    g.transpose(t["x"], [1, 0]).set_output(True)
    g.concatenate([g.relu(t["x"]), t["x"]], axis=0).set_output(True)
    g.build()
    check(g, {t["x"]: inputs["x"]}, torch.bfloat16, device=CUDA)


def test_a_slice_one_element_in_reads_through_an_unaligned_view():
    """x[:, 1:] of fp16 starts 2 bytes into x: its reader runs without aligned-pointer hints."""
    gen = torch.Generator(device=CUDA).manual_seed(2)
    inputs = {"x": torch.randn(64, 257, generator=gen, device=CUDA).half()}
    g, t = _graph(inputs, io=dg.float16)
    y = g.exp(g.slice(g.mul(t["x"], 0.5), [slice(None), slice(1, 257)]))
    y.set_output(True)
    g.build()
    assert not g.plan.views_aligned
    check(g, {t["x"]: inputs["x"]}, torch.float16, device=CUDA)


def test_bshd_attention_through_transposes():
    gen = torch.Generator(device=CUDA).manual_seed(3)
    inputs = {n: torch.randn(2, 300, 8, 64, generator=gen, device=CUDA).bfloat16() for n in ("q", "k", "v")}
    g, t = _graph(inputs)
    q, k, v = (g.transpose(t[n], [0, 2, 1, 3]) for n in ("q", "k", "v"))
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    g.transpose(o, [0, 2, 1, 3]).set_output(True)
    g.build()
    assert len(g.plan.launches) == 2
    check(g, {t[n]: inputs[n] for n in inputs}, torch.bfloat16, device=CUDA, tolerance=2e-2)
