"""Attention (sdpa, sdpa_backward, decode), bf16 BHSD, against torch SDPA, the cuDNN frontend and flex.

One process, providers side by side per shape. Rows (one table each):

  fwd     inference forward o = softmax(q k^T * scale + mask) v (no stats): B4 H32 S4096 D128
          non-causal and causal, B8 H16 S2048 D64, B1 H16 S16384 causal, GQA H32/Hkv8 (B4 S4096
          D128 causal), a sliding window (left bound 1024, causal, B1 H32 S8192 D128), an
          op-level softcap graph (matmul -> scale -> tanh(s/c)*c -> causal mask through cmp/where
          -> softmax -> matmul, B4 H16 S2048 D128, c=50) and block-sparse masks (sdpa's
          block_mask: random 128 x 128 blocks open at 10% and 50%, the diagonal too, B2 H16
          S8192 D128) against flex attention with the same block mask and mem-efficient SDPA
          with the dense boolean mask
  bwd     dq, dk, dv of the same shapes, from the float32 reference's o and row log-sum-exp
  decode  Sq=1 against Skv=8192 (B64 H32/Hkv8 D128), contiguous K/V and paged (page 16, tables
          [B, 1, pages, 1] int32 of shuffled pages)
  fp8_fwd, fp8_bwd  sdpa_fp8 and sdpa_fp8_backward, e4m3 (B2 H16 S2048 D128 non-causal and causal,
          GQA H32/Hkv8 B4 S4096 causal) against dnngraph's bf16 kernel on the dequantized inputs and
          the cuDNN frontend's sdpa_fp8 / sdpa_fp8_backward (through --cudnn-fe-path as the bf16
          rows); outputs compared dequantized with the float attention of the dequantized inputs

Anchors: torch SDPA with one backend forced each (sdpa_kernel: CUDNN_ATTENTION, FLASH_ATTENTION,
EFFICIENT_ATTENTION; the window row passes them its dense boolean mask, and a backend that refuses a
shape prints why), the cuDNN frontend sdpa / sdpa_backward graphs (band masks through
diagonal_band_*; paged decode through paged_attention_*), flex attention under torch.compile with a
block mask (window and softcap rows), torch.compile of the eager softcap math, and for paged decode
"gather+SDPA" (torch gathers the pages into contiguous K/V, then SDPA; the gather is timed).
dnngraph: g.sdpa / g.sdpa_backward with the same mask arguments (the softcap row is built from
matmul, pointwise and softmax ops, its backward from their backward ops); a graph dnngraph cannot
build yet prints "not built" with the reason and the anchors still run.

Throughput: forward 4*B*H*D*(visible (query, key) pairs), counted exactly from the mask (causal
square: S(S+1)/2); backward 2.5x that (five matmuls); decode TB/s over the K and V bytes read.
Backward anchors time the backward alone: torch.autograd.grad of the output with a retained graph,
the cuDNN FE and dnngraph backward graphs. Ratios are anchor time / dnngraph time (> 1: dnngraph
faster). Every provider's output is compared with a float32 torch reference on the same inputs
(relative Frobenius norm error, the worst of dq/dk/dv for backward) before it is timed; outputs
are poisoned with NaN first; errors past TOLERANCE print "(!)". Times are do_bench medians.

    python benchmarks/bench_attention.py                          # GPU, every row; $OUT/attention.json
    python benchmarks/bench_attention.py --quick                  # a few shapes per row
    python benchmarks/bench_attention.py --rows fwd,decode --only causal
    python benchmarks/bench_attention.py --cudnn-fe-path /tmp/fe  # a pip --target folder holding `cudnn`
    python benchmarks/bench_attention.py --gluon --rows fwd      # dnngraph with the Gluon backend first
    python benchmarks/bench_attention.py --gluon --gluon-schedule pingpong --rows fwd  # one Gluon schedule
    python benchmarks/bench_attention.py --list-shapes            # shapes, visible fractions, GFLOP
    python benchmarks/bench_attention.py --check-cpu              # tiny fp32 shapes, no timing

--check-cpu runs tiny fp32 shapes on CPU against a float64 reference: the anchors that run on CPU
(SDPA's CPU flash kernel, flex attention and the softcap math uncompiled), dnngraph through Triton's
interpreter, and this file's references against g.reference(). It exits 0 when all pass, 2 when the
only failures are graphs dnngraph cannot build yet, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

if "--check-cpu" in sys.argv[1:]:  # CPU tensors run through Triton's interpreter, GPU or not
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

import dnngraph as dg  # first: on a CPU-only machine it selects Triton's interpreter before triton loads
import triton
from bench_matmul import _failed, _geomean, _host_us, _short, _sync, flush_us, frontend_from_args
from common import cpu_exit, family_parser, median_ms, print_table, rel_error, run_family, run_rows

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
TOLERANCE = 2e-2  # bf16 outputs against the float32 reference
CPU_TOLERANCE = 1e-4  # fp32 on CPU against float64
BACKWARD_FLOPS = 2.5  # five matmuls against the forward's two


# --- shapes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnShape:
    """q [B, H, Sq, D], k/v [B, Hkv, Skv, D]. Key j is visible to query i when j - i <= right_bound
    and i - j < left_bound (None: unbounded; top-left aligned): causal is right_bound 0."""

    label: str
    batch: int
    heads: int
    kv_heads: int
    s_q: int
    s_kv: int
    head_dim: int
    right_bound: Optional[int] = None
    left_bound: Optional[int] = None
    softcap: Optional[float] = None  # the op-level softcap graph (causal)
    page_size: Optional[int] = None  # paged K/V
    density: Optional[float] = None  # a block-sparse mask (block_mask): random blocks open at this rate
    mask_block: int = 128  # the block mask's blocks, mask_block x mask_block

    @property
    def mask_blocks(self) -> tuple:
        return -(-self.s_q // self.mask_block), -(-self.s_kv // self.mask_block)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def pages(self) -> int:
        return -(-self.s_kv // self.page_size)

    def visible_pairs(self) -> int:
        """(query, key) pairs the mask keeps, counted exactly row by row."""
        if self.density is not None:
            return int(visible_mask(self, "cpu").sum())
        rows = torch.arange(self.s_q, dtype=torch.int64)
        high = rows + self.right_bound if self.right_bound is not None else torch.full_like(rows, self.s_kv - 1)
        low = rows - self.left_bound + 1 if self.left_bound is not None else torch.zeros_like(rows)
        return int((high.clamp(max=self.s_kv - 1) - low.clamp(min=0) + 1).clamp(min=0).sum())

    def work(self, backward=False) -> float:
        """FLOPs of the two forward matmuls over the visible pairs (x2.5 for backward)."""
        flops = 4.0 * self.batch * self.heads * self.head_dim * self.visible_pairs()
        return flops * (BACKWARD_FLOPS if backward else 1.0)

    @property
    def kv_bytes(self) -> float:
        return 2.0 * self.batch * self.kv_heads * self.s_kv * self.head_dim * 2  # K and V, 2-byte elements

    def describe(self) -> str:
        heads = f"H{self.heads}" + (f"/Hkv{self.kv_heads}" if self.kv_heads != self.heads else "")
        seq = f"S{self.s_q}" if self.s_q == self.s_kv else f"Sq{self.s_q} Skv{self.s_kv}"
        mask = {None: "", 0: " causal"}.get(self.right_bound, f" right {self.right_bound}")
        mask += f" left {self.left_bound}" if self.left_bound is not None else ""
        extra = (f" softcap {self.softcap:g}" if self.softcap else "") + (
            f" paged {self.page_size}" if self.page_size else "") + (
            f" block-sparse {self.density:.0%} of {self.mask_block}x{self.mask_block}" if self.density else "")
        return f"B{self.batch} {heads} {seq} D{self.head_dim}{mask}{extra}"


def attn(label, b, h, s, d, hkv=None, causal=False, left=None, softcap=None, s_q=None, page=None, density=None,
         block=128):
    """An AttnShape; s is Skv (and Sq unless s_q is given)."""
    return AttnShape(label, b, h, hkv or h, s_q or s, s, d, 0 if causal else None, left, softcap, page, density,
                     block)


TRAINING = [
    attn("4k", 4, 32, 4096, 128), attn("4k causal", 4, 32, 4096, 128, causal=True),
    attn("2k d64", 8, 16, 2048, 64), attn("16k causal", 1, 16, 16384, 128, causal=True),
    attn("gqa 4k causal", 4, 32, 4096, 128, hkv=8, causal=True),
    attn("window 1k @8k", 1, 32, 8192, 128, causal=True, left=1024),
    attn("softcap 2k", 4, 16, 2048, 128, causal=True, softcap=50.0),
    attn("sparse 10% 8k", 2, 16, 8192, 128, density=0.1), attn("sparse 50% 8k", 2, 16, 8192, 128, density=0.5),
]
DECODE = [attn("decode 8k", 64, 32, 8192, 128, hkv=8, s_q=1),
          attn("decode 8k paged", 64, 32, 8192, 128, hkv=8, s_q=1, page=16)]
QUICK = ("4k causal", "gqa 4k causal", "window 1k @8k", "softcap 2k", "decode 8k", "decode 8k paged",
         "sparse 10% 8k")
CPU_TRAINING = [attn("cpu gqa causal", 2, 4, 37, 16, hkv=2, causal=True),
                attn("cpu window", 1, 2, 45, 16, causal=True, left=8),
                attn("cpu softcap", 1, 2, 33, 16, causal=True, softcap=1.5),
                attn("cpu sparse", 1, 2, 45, 16, density=0.4, block=16)]
CPU_DECODE = [attn("cpu decode", 3, 4, 40, 16, hkv=2, s_q=1),
              attn("cpu decode paged", 3, 4, 40, 16, hkv=2, s_q=1, page=16)]
FP8_SHAPES = [attn("fp8 2k", 2, 16, 2048, 128), attn("fp8 2k causal", 2, 16, 2048, 128, causal=True),
              attn("fp8 gqa 4k causal", 4, 32, 4096, 128, hkv=8, causal=True)]
CPU_FP8 = [attn("cpu fp8 gqa causal", 2, 4, 37, 16, hkv=2, causal=True), attn("cpu fp8", 1, 2, 45, 32)]
QUICK += ("fp8 2k causal",)


@dataclass(frozen=True)
class RowSpec:
    key: str
    title: str
    backward: bool
    decode: bool
    goal_geomean: float  # dnngraph over the fastest anchor of each shape, geometric mean
    goal_min: float
    fp8: bool = False  # e4m3 q, k, v (dO): sdpa_fp8 / sdpa_fp8_backward against their anchors


ROWS = {  # issue 12's goals: >= 1.0x cuDNN (floors 0.85x forward, 0.8x backward); decode >= 85% of
    # the copy ceiling, which cuDNN's decode reaches (3.0 TB/s), so 0.85x the fastest anchor there
    "fwd": RowSpec("fwd", "attention forward (inference, no stats)", False, False, 1.0, 0.85),
    "bwd": RowSpec("bwd", "attention backward (dq, dk, dv)", True, False, 1.0, 0.8),
    "decode": RowSpec("decode", "decode (Sq=1)", False, True, 0.85, 0.85),
}
# issue 31: fp8 forward and backward, e4m3, >= 1.0x the best anchor (the frontend's sdpa_fp8 where it runs)
ROWS["fp8_fwd"] = RowSpec("fp8_fwd", "fp8 attention forward (e4m3 q, k, v, o; inference)", False, False, 1.0, 0.85,
                          fp8=True)
ROWS["fp8_bwd"] = RowSpec("fp8_bwd", "fp8 attention backward (e4m3 dq, dk, dv and amaxes)", True, False, 1.0, 0.8,
                          fp8=True)
TITLES = {"sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash", "sdpa_efficient": "SDPA mem-eff",
          "cudnn_fe": "cuDNN FE", "flex": "flex", "compile": "compile", "gather_sdpa": "gather+SDPA",
          "dg_triton": "dnngraph Triton", "dg": "dnngraph"}
# the fp8 rows' anchors: dnngraph's bf16 kernel on the dequantized inputs, the frontend's sdpa_fp8
TITLES.update({"dg_bf16": "dnngraph bf16", "cudnn_fe_fp8": "cuDNN FE fp8"})
FP8_ANCHORS = ("dg_bf16", "cudnn_fe_fp8")
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION"}


def anchors_of(shape: AttnShape) -> tuple:
    """The anchor providers that can express `shape`, in table order."""
    if shape.softcap:
        return ("flex", "compile")
    if shape.page_size:
        return ("gather_sdpa", "cudnn_fe")
    if shape.density is not None:  # the dense boolean mask (mem-efficient SDPA) and flex's block mask
        return ("sdpa_efficient", "flex")
    dense = tuple(SDPA_BACKENDS) + ("cudnn_fe",)
    return dense + ("flex",) if shape.left_bound is not None else dense


def row_shapes(key, args, cpu=False) -> list:
    """The shapes of row `key` after --quick and --only."""
    shapes = (CPU_DECODE if cpu else DECODE) if ROWS[key].decode else (CPU_TRAINING if cpu else TRAINING)
    if ROWS[key].fp8:
        shapes = CPU_FP8 if cpu else FP8_SHAPES
    if args.quick and not cpu:
        shapes = [s for s in shapes if s.label in QUICK]
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    return [s for s in shapes if not words or any(w in s.label for w in words)]


# --- inputs and references -----------------------------------------------------------------------
def poisoned(dim, stride, dtype, device) -> torch.Tensor:
    """An uninitialized-looking output buffer: NaN everywhere, so an unwritten element shows."""
    return torch.empty_strided(tuple(dim), tuple(stride), dtype=dtype, device=device).fill_(float("nan"))


def page_pool(value: torch.Tensor, page_size: int, gen) -> tuple:
    """(pool [B*pages, Hkv, page, D], table [B, 1, pages, 1] int32): value's pages stored at shuffled
    pool slots; the tail of a last partial page holds random values the kernels must not read."""
    batch, kv_heads, s_kv, head_dim = value.shape
    pages = -(-s_kv // page_size)
    padded = torch.randn(batch, kv_heads, pages * page_size, head_dim, generator=gen, device=value.device)
    padded = padded.to(value.dtype)
    padded[:, :, :s_kv] = value
    slots = torch.randperm(batch * pages, generator=gen, device=value.device)
    pool = torch.empty(batch * pages, kv_heads, page_size, head_dim, dtype=value.dtype, device=value.device)
    pool[slots] = padded.view(batch, kv_heads, pages, page_size, head_dim).transpose(1, 2).reshape(
        batch * pages, kv_heads, page_size, head_dim)
    return pool, slots.view(batch, 1, pages, 1).to(torch.int32)


def make_inputs(shape: AttnShape, device, dtype, seed=0) -> dict:
    """q, k, v, d_o random normal; page pools and tables, lengths and mask index tensors as the
    shape needs them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*dim):
        return torch.randn(dim, generator=gen, device=device).to(dtype)

    b, h, hkv, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    inputs = {"q": normal(b, h, shape.s_q, d), "k": normal(b, hkv, shape.s_kv, d),
              "v": normal(b, hkv, shape.s_kv, d), "d_o": normal(b, h, shape.s_q, d)}
    if shape.page_size:
        inputs["k_pool"], inputs["k_table"] = page_pool(inputs["k"], shape.page_size, gen)
        inputs["v_pool"], inputs["v_table"] = page_pool(inputs["v"], shape.page_size, gen)
        inputs["seq_len_q"] = torch.full((b, 1, 1, 1), shape.s_q, dtype=torch.int32, device=device)
        inputs["seq_len_kv"] = torch.full((b, 1, 1, 1), shape.s_kv, dtype=torch.int32, device=device)
    if shape.density is not None:
        inputs["block_mask"] = shape_block_mask(shape, device)
    if shape.softcap:
        inputs["row"] = torch.arange(shape.s_q, dtype=torch.int32, device=device).view(1, 1, -1, 1)
        inputs["col"] = torch.arange(shape.s_kv, dtype=torch.int32, device=device).view(1, 1, 1, -1)
        inputs["k_t"], inputs["v_t"] = inputs["k"].transpose(-1, -2), inputs["v"].transpose(-1, -2)
    return inputs


def shape_block_mask(shape: AttnShape, device) -> torch.Tensor:
    """[1, 1, q blocks, k blocks] bool of the shape's block-sparse mask: random blocks open at its
    density (a fixed seed: every provider sees the same mask), the diagonal ones too so that no
    query row is left without keys."""
    q_blocks, k_blocks = shape.mask_blocks
    opened = torch.rand(q_blocks, k_blocks, generator=torch.Generator().manual_seed(1)) < shape.density
    diagonal = torch.arange(q_blocks).view(-1, 1) == torch.arange(k_blocks).view(1, -1)
    return (opened | diagonal).view(1, 1, q_blocks, k_blocks).to(device)


def visible_mask(shape: AttnShape, device) -> torch.Tensor:
    """[Sq, Skv] bool, True where the key is visible (torch SDPA's attn_mask convention)."""
    rows = torch.arange(shape.s_q, device=device).view(-1, 1)
    cols = torch.arange(shape.s_kv, device=device).view(1, -1)
    visible = torch.ones(shape.s_q, shape.s_kv, dtype=torch.bool, device=device)
    if shape.right_bound is not None:
        visible &= cols - rows <= shape.right_bound
    if shape.left_bound is not None:
        visible &= rows - cols < shape.left_bound
    if shape.density is not None:
        size = shape.mask_block
        blocks = shape_block_mask(shape, device)[0, 0]
        visible &= blocks.repeat_interleave(size, 0)[:shape.s_q].repeat_interleave(size, 1)[:, :shape.s_kv]
    return visible


def attend(q, k, v, visible, scale, softcap=None) -> tuple:
    """(o, row log-sum-exp) of one group of query heads against one K/V head."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.matmul((scores - lse).exp(), v), lse


def references(shape: AttnShape, inputs, dtype, backward: bool) -> dict:
    """o and lse (and grads with `backward`) in `dtype`, one (batch, KV head) group at a time so
    the [Sq, Skv] scores of long sequences fit."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    group, visible = shape.heads // shape.kv_heads, visible_mask(shape, q.device)
    o = torch.empty(q.shape, dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:3] + (1,), dtype=dtype, device=q.device)
    grads = [torch.empty(t.shape, dtype=dtype, device=q.device) for t in (q, k, v)]
    for b in range(shape.batch):
        for kv_head in range(shape.kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            leaves = [t.to(dtype).requires_grad_(backward) for t in (q[b, heads], k[b, kv_head], v[b, kv_head])]
            with torch.set_grad_enabled(backward):
                out, row_lse = attend(*leaves, visible, shape.scale, shape.softcap)
            o[b, heads], lse[b, heads] = out.detach(), row_lse.detach()
            if backward:
                dq, dk, dv = torch.autograd.grad(out, leaves, inputs["d_o"][b, heads].to(dtype))
                grads[0][b, heads], grads[1][b, kv_head], grads[2][b, kv_head] = dq, dk, dv
    return {"o": (o,), "lse": lse, "grads": tuple(grads) if backward else None}


# --- torch anchors -------------------------------------------------------------------------------
class Skipped(Exception):
    """A provider not run (not requested, budget spent, no CUDA): status "skipped", not "n/a"."""


class NotBuilt(Exception):
    """dnngraph cannot build the graph yet (UnsupportedError, or the API lacks an argument)."""


def forward_or_backward(forward: Callable, inputs, backward: bool) -> tuple:
    """(run, outputs, flavour, extra): the forward call, or autograd.grad of one retained forward."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if not backward:
        return (lambda: forward(q, k, v)), None, "o", {}
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, d_o = forward(*leaves), inputs["d_o"]
    return (lambda: torch.autograd.grad(out, leaves, d_o, retain_graph=True)), None, "grads", {}


def sdpa_provider(name: str, shape: AttnShape, inputs, backward: bool, ctx) -> Callable:
    """torch SDPA with one backend forced; the window row passes the dense boolean mask."""
    def factory():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if ctx.device == "cpu" and name != "sdpa_flash":
            raise Skipped("needs CUDA (torch's CPU SDPA kernel is its flash backend)")
        backend = getattr(SDPBackend, SDPA_BACKENDS[name])
        kwargs = {"scale": shape.scale, "enable_gqa": shape.heads != shape.kv_heads}
        if shape.left_bound is not None or shape.density is not None:
            kwargs["attn_mask"] = visible_mask(shape, inputs["q"].device)
        elif shape.right_bound == 0:
            kwargs["is_causal"] = True

        def forward(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return forward_or_backward(forward, inputs, backward)
    return factory


def gather_kv(pool, table, s_kv) -> torch.Tensor:
    """Contiguous [B, Hkv, Skv, D] from a page pool and its [B, 1, pages, 1] table."""
    pages = pool[table.flatten(1).long()]  # [B, pages, Hkv, page, D]
    batch, count, kv_heads, page, head_dim = pages.shape
    return pages.transpose(1, 2).reshape(batch, kv_heads, count * page, head_dim)[:, :, :s_kv]


def gather_sdpa_provider(shape: AttnShape, inputs) -> Callable:
    """Paged decode in torch: gather the pages into contiguous K/V, then SDPA (its own backend pick)."""
    def factory():
        q, kwargs = inputs["q"], {"scale": shape.scale, "enable_gqa": shape.heads != shape.kv_heads}

        def run():
            k = gather_kv(inputs["k_pool"], inputs["k_table"], shape.s_kv)
            v = gather_kv(inputs["v_pool"], inputs["v_table"], shape.s_kv)
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return run, None, "o", {}
    return factory


def compiled(ctx, fn) -> Callable:
    """torch.compile(fn) when timing (skipped past the budget), fn itself on CPU checks."""
    if not ctx.timed:
        return fn
    if ctx.args.no_compile:
        raise Skipped("--no-compile")
    if time.perf_counter() > ctx.compile_deadline:
        raise Skipped("torch.compile time budget spent (--compile-budget-s)")
    if fn not in ctx.compiled:
        ctx.compiled[fn] = torch.compile(fn, dynamic=False)
    return ctx.compiled[fn]


def band_mask_mod(left_bound, right_bound, blocks=None, block_size=0) -> Callable:
    """flex attention's mask_mod for the shape's bounds (and its block-sparse mask, `blocks`
    [q blocks, k blocks] of block_size)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= 0
        if right_bound is not None:
            keep = keep & (kv_idx - q_idx <= right_bound)
        if left_bound is not None:
            keep = keep & (q_idx - kv_idx < left_bound)
        if blocks is not None:
            keep = keep & blocks[q_idx // block_size, kv_idx // block_size]
        return keep
    return mask_mod


def flex_provider(shape: AttnShape, inputs, backward: bool, ctx) -> Callable:
    """flex_attention (compiled when timing) with a block mask, and the softcap as score_mod."""
    def factory():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if backward and ctx.device == "cpu":
            raise Skipped("flex attention has no CPU backward")
        flex = compiled(ctx, flex_attention)
        blocks = shape_block_mask(shape, inputs["q"].device)[0, 0] if shape.density is not None else None
        mask_mod = band_mask_mod(shape.left_bound, shape.right_bound, blocks, shape.mask_block)
        block_mask = create_block_mask(mask_mod, None, None, shape.s_q, shape.s_kv, device=inputs["q"].device)
        cap = shape.softcap
        score_mod = (lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap) * cap) if cap else None

        def forward(q, k, v):
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=shape.scale,
                        enable_gqa=shape.heads != shape.kv_heads)
        return forward_or_backward(forward, inputs, backward)
    return factory


def softcap_attention(q, k, v, scale: float, cap: float):
    """Causal softcapped attention as eager torch ops (float32 scores and softmax)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / cap) * cap
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def compile_provider(shape: AttnShape, inputs, backward: bool, ctx) -> Callable:
    """torch.compile of the eager softcap math (uncompiled on CPU checks)."""
    def factory():
        fn = compiled(ctx, softcap_attention)
        return forward_or_backward(lambda q, k, v: fn(q, k, v, shape.scale, shape.softcap), inputs, backward)
    return factory


# --- the cuDNN frontend --------------------------------------------------------------------------
class CudnnAttention:
    """cuDNN frontend (cudnn.pygraph) sdpa and sdpa_backward graphs, bf16 I/O, float32 inside.

    Calls, as in the frontend's test/python/test_mhas.py and the 1.32 pybind docstrings:
    pygraph(io_data_type, intermediate_data_type, compute_data_type, handle), tensor_like(torch
    tensor), sdpa(q, k, v, attn_scale, generate_stats, diagonal_alignment, diagonal_band_left_bound,
    diagonal_band_right_bound, use_padding_mask, seq_len_q, seq_len_kv, paged_attention_k_table,
    paged_attention_v_table, paged_attention_max_seq_len_kv) -> [o, stats], sdpa_backward(q, k, v,
    o, dO, stats, attn_scale, <the same mask arguments>) -> [dQ, dK, dV], set_output / set_dim /
    set_stride, build([heur_mode.A, heur_mode.FALLBACK]), get_workspace_size, execute(pack,
    workspace, handle=...). Causal is diagonal_band_right_bound=0 (the preferred masking arguments;
    use_causal_mask is deprecated there).
    """

    def __init__(self, module):
        self.fe = module
        self.handle = module.create_handle()
        module.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)

    def _graph(self):
        fe = self.fe
        return fe.pygraph(io_data_type=fe.data_type.BFLOAT16, intermediate_data_type=fe.data_type.FLOAT,
                          compute_data_type=fe.data_type.FLOAT, handle=self.handle)

    def _mask(self, shape: AttnShape) -> dict:
        return dict(diagonal_alignment=self.fe.diagonal_alignment.TOP_LEFT,
                    diagonal_band_left_bound=shape.left_bound, diagonal_band_right_bound=shape.right_bound)

    def _finish(self, g, pack: dict, outputs: dict) -> Callable:
        for tensor, buffer in outputs.items():
            tensor.set_output(True).set_dim(list(buffer.shape)).set_stride(list(buffer.stride()))
        g.build([self.fe.heur_mode.A, self.fe.heur_mode.FALLBACK])
        workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        pack, handle = {**pack, **outputs}, self.handle
        return lambda: g.execute(pack, workspace, handle=handle)

    def forward(self, shape: AttnShape, inputs) -> tuple:
        """(run, o): the inference forward, paged when the shape is."""
        g, paged = self._graph(), bool(shape.page_size)
        names = ("q", "k_pool", "v_pool", "k_table", "v_table", "seq_len_q", "seq_len_kv") if paged else ("q", "k", "v")
        t = {name: g.tensor_like(inputs[name]) for name in names}
        extra = dict(use_padding_mask=True, seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"],
                     paged_attention_k_table=t["k_table"], paged_attention_v_table=t["v_table"],
                     paged_attention_max_seq_len_kv=shape.s_kv) if paged else {}
        o, _ = g.sdpa(q=t["q"], k=t["k_pool" if paged else "k"], v=t["v_pool" if paged else "v"],
                      attn_scale=shape.scale, generate_stats=False, name="sdpa", **self._mask(shape), **extra)
        out = poisoned(inputs["q"].shape, inputs["q"].stride(), BF16, "cuda")
        return self._finish(g, {t[n]: inputs[n] for n in names}, {o: out}), out

    def backward(self, shape: AttnShape, inputs) -> tuple:
        """(run, (dq, dk, dv)) from the reference's o and stats."""
        g, names = self._graph(), ("q", "k", "v", "o", "d_o", "stats")
        t = {name: g.tensor_like(inputs[name]) for name in names}
        grads = g.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["d_o"], stats=t["stats"],
                                attn_scale=shape.scale, name="sdpa_backward", **self._mask(shape))
        buffers = tuple(poisoned(inputs[n].shape, inputs[n].stride(), BF16, "cuda") for n in ("q", "k", "v"))
        return self._finish(g, {t[n]: inputs[n] for n in names}, dict(zip(grads, buffers))), buffers


def cudnn_provider(shape: AttnShape, inputs, backward: bool, ctx) -> Callable:
    """The cuDNN frontend forward or backward graph of the shape."""
    def factory():
        if ctx.frontend is None:
            raise Skipped(f"cuDNN frontend {ctx.fe_note}")
        if backward:
            run, grads = ctx.frontend.backward(shape, inputs)
            return run, (lambda: grads), "grads", {}
        run, out = ctx.frontend.forward(shape, inputs)
        return run, (lambda: out), "o", {}
    return factory


# --- dnngraph ------------------------------------------------------------------------------------
def new_graph(io_type, name) -> dg.Graph:
    """A dnngraph graph with float32 intermediates and math."""
    return dg.Graph(name=name, io_data_type=io_type, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32)


def dg_mask(shape: AttnShape) -> dict:
    """sdpa's mask arguments: the band for windows, use_causal_mask for plain causal shapes."""
    if shape.left_bound is not None:
        return dict(diagonal_alignment="top_left", diagonal_band_left_bound=shape.left_bound,
                    diagonal_band_right_bound=shape.right_bound)
    return dict(use_causal_mask=True) if shape.right_bound == 0 else {}


def dg_sdpa_graph(shape: AttnShape, inputs, io_type, backward: bool) -> tuple:
    """(graph, bound inputs {Tensor: name}, outputs): g.sdpa (paged when the shape is) or g.sdpa_backward."""
    g = new_graph(io_type, "sdpa_backward" if backward else "sdpa")
    if backward:
        names = ("q", "k", "v", "o", "d_o", "stats")
    else:
        names = ("q", "k_pool", "v_pool", "k_table", "v_table", "seq_len_kv") if shape.page_size else ("q", "k", "v")
    names += ("block_mask",) if shape.density is not None else ()
    t = {name: g.tensor_like(inputs[name], name=name) for name in names}
    mask = dg_mask(shape)
    if shape.density is not None:
        mask.update(block_mask=t["block_mask"], block_mask_size=(shape.mask_block, shape.mask_block))
    if backward:
        outputs = g.sdpa_backward(t["q"], t["k"], t["v"], t["o"], t["d_o"], t["stats"],
                                  attn_scale=shape.scale, **mask)
    elif shape.page_size:
        paged = dict(seq_len_kv=t["seq_len_kv"], paged_attention_k_table=t["k_table"],
                     paged_attention_v_table=t["v_table"], paged_attention_max_seq_len_kv=shape.s_kv)
        outputs = g.sdpa(t["q"], t["k_pool"], t["v_pool"], attn_scale=shape.scale, is_inference=True,
                         **dg_mask(shape), **paged)[:1]
    else:
        outputs = g.sdpa(t["q"], t["k"], t["v"], attn_scale=shape.scale, is_inference=True, **mask)[:1]
    return g, {tensor: name for name, tensor in t.items()}, list(outputs)


def softcap_probs(g, t: dict, shape: AttnShape) -> tuple:
    """(probs, x = scaled scores / cap, visible) of the causal softcap graph, as ops."""
    scores = g.scale(g.matmul(t["q"], t["k_t"]), shape.scale)
    x = g.scale(scores, 1.0 / shape.softcap)
    visible = g.cmp_ge(t["row"], t["col"])  # causal: key j visible to query i when i >= j
    masked = g.where(visible, g.mul(g.tanh(x), shape.softcap), float("-inf"))
    return g.softmax(masked, axis=-1), x, visible


def dg_softcap_graph(shape: AttnShape, inputs, io_type, backward: bool) -> tuple:
    """The softcap row as dnngraph ops; backward recomputes the forward and chains the ops' backwards
    in the form the partitioner fuses into the flash backward (what Graph.as_function derives):
    dP = dO v^T, dS' = P (dP - rowsum(o dO)), the mask, tanh_backward, then dq = dS k,
    dk = dS^T q, dv = P^T dO."""
    g = new_graph(io_type, "softcap_backward" if backward else "softcap")
    names = ("q", "k_t", "v", "row", "col") + (("v_t", "d_o", "o") if backward else ())
    t = {name: g.tensor_like(inputs[name], name=name) for name in names}
    probs, x, visible = softcap_probs(g, t, shape)
    if not backward:
        return g, {tensor: name for name, tensor in t.items()}, [g.matmul(probs, t["v"])]
    delta = g.reduction(g.mul(t["o"], t["d_o"]), "sum", [3])
    d_masked = g.mul(probs, g.sub(g.matmul(t["d_o"], t["v_t"]), delta))
    d_capped = g.where(visible, d_masked, 0.0)
    d_scores = g.scale(g.tanh_backward(g.mul(d_capped, shape.softcap), x), shape.scale / shape.softcap)
    swap = [0, 1, 3, 2]
    outputs = [g.matmul(d_scores, g.transpose(t["k_t"], swap)), g.matmul(g.transpose(d_scores, swap), t["q"]),
               g.matmul(g.transpose(probs, swap), t["d_o"])]
    return g, {tensor: name for name, tensor in t.items()}, outputs


def dg_graph(shape: AttnShape, inputs, io_type, backward: bool) -> tuple:
    """(graph, bound inputs, outputs) with outputs marked and named; NotBuilt when the API lacks
    an argument the shape needs."""
    make = dg_softcap_graph if shape.softcap else dg_sdpa_graph
    try:
        g, bound, outputs = make(shape, inputs, io_type, backward)
    except TypeError as error:  # e.g. an sdpa keyword the graph API does not take yet
        if "argument" not in str(error):
            raise
        raise NotBuilt(_short(error, 300)) from None
    for tensor, name in zip(outputs, ("dq", "dk", "dv") if backward else ("o",)):
        tensor.set_output(True).set_name(name)
    return g, bound, outputs


# The BuildOptions dnngraph's graphs are built with (None: the defaults; attention_knobs.py sets
# forced tiles and grids here).
BUILD_OPTIONS = None


def dg_provider(shape: AttnShape, inputs, io_type, backward: bool, options=None) -> Callable:
    """dnngraph: g.build(options) (heuristics, no autotune; BUILD_OPTIONS unless given), then execute
    into poisoned outputs."""
    def factory():
        g, bound, outputs = dg_graph(shape, inputs, io_type, backward)
        start = time.perf_counter()
        try:
            g.build(options=options or BUILD_OPTIONS)
        except dg.UnsupportedError as error:
            raise NotBuilt(_short(error, 300)) from None
        device = inputs["q"].device
        buffers = tuple(poisoned(t.dim, t.stride, t.data_type.torch_dtype, device) for t in outputs)
        bindings = {tensor: inputs[name] for tensor, name in bound.items()}
        bindings.update(zip(outputs, buffers))
        launches = getattr(g.plan, "launches", None) or []
        extra = {"build_s": time.perf_counter() - start, "launches": len(launches),
                 "backends": sorted({launch.backend for launch in launches})}
        return (lambda: g.execute(bindings)), (lambda: buffers), "grads" if backward else "o", extra
    return factory


def reference_check(shape: AttnShape, inputs, refs, backward: bool) -> float:
    """The largest relative error between this file's reference and g.reference() (float64)."""
    g, bound, outputs = dg_graph(shape, inputs, dg.float32, backward)
    graph_refs = g.reference({tensor: inputs[name] for tensor, name in bound.items()})
    ours = refs["grads"] if backward else refs["o"]
    return max(rel_error(mine, graph_refs[t.name]) for mine, t in zip(ours, outputs))


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    device: str
    dtype: torch.dtype
    ref_dtype: torch.dtype
    tolerance: float
    timed: bool
    frontend: Optional[CudnnAttention] = None
    fe_note: str = "not loaded"
    compile_deadline: float = math.inf
    compiled: dict = None


def _refusal(error: Exception, caught) -> str:
    """The error, with the reasons torch warned while refusing (SDPA says why each backend is not used)."""
    reasons = []
    for warning in caught:
        text = re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(warning.message))
        reasons += [line.strip() for line in text.splitlines() if line.strip()
                    and not line.strip().endswith("not used because:") and "runtime disabled" not in line]
    reasons = list(dict.fromkeys(reasons))
    return _short(error, 200) + ("" if not reasons else " [" + "; ".join(r[:200] for r in reasons[:4]) + "]")


def measure(factory: Callable, refs: dict, work: float, ctx: Context) -> dict:
    """Build, check against the reference, then time one provider; failures become status cells."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            try:
                run, outputs, flavour, extra = factory()
                result = run()
                _sync(ctx.device)
            except (Skipped, NotBuilt):
                raise
            except Exception as error:  # noqa: BLE001 - reported with torch's reasons
                return _failed(_refusal(error, caught))
        first_call_s = time.perf_counter() - start
        produced = outputs() if outputs is not None else result
        produced = produced if isinstance(produced, tuple) else (produced,)
        error = max(rel_error(out, ref) for out, ref in zip(produced, refs[flavour]))
        row = {"status": "ok", "rel_error": error, "first_call_s": first_call_s,
               "checked": math.isfinite(error) and error <= ctx.tolerance, **extra}
        del produced, result
        if ctx.timed:
            ms = median_ms(run, warmup=25, rep=ctx.args.rep_ms)
            row.update(ms=ms, rate=work / ms / 1e9, host_us=_host_us(run, ctx.device))
        return row
    except Skipped as reason:
        return {"status": "skipped", "error": str(reason)}
    except NotBuilt as reason:
        return {"status": "not built", "error": str(reason)}
    except Exception as error:  # noqa: BLE001 - one provider failing leaves the others measured
        return _failed(error)


def run_case(row: RowSpec, shape: AttnShape, ctx: Context) -> dict:
    """Every provider of one shape: the reference, anchors, then dnngraph (a faulting kernel then
    leaves the anchors measured)."""
    if row.fp8:
        return run_fp8_case(row, shape, ctx)
    inputs = make_inputs(shape, ctx.device, ctx.dtype)
    refs = references(shape, inputs, ctx.ref_dtype, row.backward)
    if row.backward:  # the backward graphs start from the reference's o and stats
        inputs["o"], inputs["stats"] = refs["o"][0].to(ctx.dtype), refs["lse"].float()
    work = shape.kv_bytes if row.decode else shape.work(row.backward)
    makers = {"flex": flex_provider, "compile": compile_provider, "cudnn_fe": cudnn_provider}
    factories = {}
    for name in anchors_of(shape):
        if name in SDPA_BACKENDS:
            factories[name] = sdpa_provider(name, shape, inputs, row.backward, ctx)
        elif name == "gather_sdpa":
            factories[name] = gather_sdpa_provider(shape, inputs)
        else:
            factories[name] = makers[name](shape, inputs, row.backward, ctx)
    io_type = dg.bfloat16 if ctx.dtype == BF16 else dg.float32
    if ctx.args.gluon:  # a Triton-only build beside the Gluon-first one, as an anchor (the default
        # build takes gluon for the attention forwards its model ranks first)
        triton_only = dg.BuildOptions(backends=("triton",))
        factories["dg_triton"] = dg_provider(shape, inputs, io_type, row.backward, triton_only)
    factories["dg"] = dg_provider(shape, inputs, io_type, row.backward)
    case = {"label": shape.label, "shape": shape.describe(), "work": work,
            "visible": shape.visible_pairs() / (shape.s_q * shape.s_kv)}
    for name, factory in factories.items():
        case[name] = measure(factory, refs, work, ctx)
    if not ctx.timed:
        try:
            case["reference_check"] = reference_check(shape, inputs, refs, row.backward)
        except NotBuilt as reason:
            case["reference_check"], case["reference_check_error"] = None, f"not built: {reason}"
        except Exception as error:  # noqa: BLE001
            case["reference_check"], case["reference_check_error"] = float("nan"), _short(error, 200)
    return case


# --- reporting -----------------------------------------------------------------------------------
def _ok(result) -> bool:
    return bool(result) and result.get("status") == "ok" and "ms" in result


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def _cell(result) -> str:
    if not result:
        return "-"
    if result.get("status") != "ok":
        return result["status"]
    flag = "" if result["checked"] else " (!)"
    if "ms" not in result:
        return f"err {result['rel_error']:.0e}{flag}"
    return f"{result['ms'] * 1e3:.0f} us / {_rate(result['rate'])}{flag}"


def _ratio(anchor, ours) -> Optional[float]:
    return anchor["ms"] / ours["ms"] if _ok(anchor) and _ok(ours) else None


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def providers_of(cases: list) -> list:
    """Anchors in table order (those any case has), then dnngraph."""
    return [p for p in TITLES if p != "dg" and any(p in c for c in cases)] + ["dg"]


def best_anchor_ratio(case: dict) -> Optional[float]:
    """The fastest measured anchor's time / dnngraph's time."""
    times = [r["ms"] for name, r in case.items() if name in TITLES and name != "dg" and _ok(r)]
    return min(times) / case["dg"]["ms"] if times and _ok(case.get("dg")) else None


def report_row(row: RowSpec, cases: list) -> list:
    """Print the row's two tables; returns its goal lines."""
    providers = providers_of(cases)
    unit, amount = ("TB/s", "GB read") if row.decode else ("TFLOP/s", "GFLOP")
    print_table(f"{row.title}: time (us) / {unit}", ["shape", "dims", amount, "visible"]
                + [TITLES[p] for p in providers],
                [[c["label"], c["shape"], f"{c['work'] / 1e9:.3g}", f"{c['visible']:.3f}"]
                 + [_cell(c.get(p)) for p in providers] for c in cases])
    anchors = providers[:-1]
    print_table(f"{row.title}: anchor time / dnngraph time (> 1: dnngraph faster); relative errors",
                ["shape"] + [f"{TITLES[a]} / dg" for a in anchors] + ["best / dg"]
                + [f"err {TITLES[p]}" for p in providers],
                [[c["label"]] + [_fmt(_ratio(c.get(a), c.get("dg"))) for a in anchors]
                 + [_fmt(best_anchor_ratio(c))]
                 + [f"{c[p]['rel_error']:.0e}" if (c.get(p) or {}).get("status") == "ok" else "-" for p in providers]
                 for c in cases])
    return goal_lines(row, cases, anchors)


def goal_lines(row: RowSpec, cases: list, anchors: list) -> list:
    """Geomean and min of dnngraph's speed over each anchor, then the goal verdict."""
    lines = []
    for anchor in anchors:
        ratios = [(r, c["label"]) for c in cases if (r := _ratio(c.get(anchor), c.get("dg"))) is not None]
        if ratios:
            low = min(ratios)
            lines.append(f"- {row.key}: dnngraph vs {TITLES[anchor]}: geomean {_geomean([r for r, _ in ratios]):.3f}x, "
                         f"min {low[0]:.2f}x ({low[1]}) over {len(ratios)} of {len(cases)} shape(s)")
    goal = f">= {row.goal_geomean}x the fastest anchor per shape (geomean), no shape < {row.goal_min}x"
    ratios = [(r, c["label"]) for c in cases if (r := best_anchor_ratio(c)) is not None]
    if not ratios:
        built = sum(1 for c in cases if _ok(c.get("dg")))
        return lines + [f"- {row.key} GOAL {goal}: NOT JUDGED (dnngraph measured on {built} of {len(cases)} shapes)"]
    mean, low = _geomean([r for r, _ in ratios]), min(ratios)
    met = mean >= row.goal_geomean and low[0] >= row.goal_min
    partial = "" if len(ratios) == len(cases) else f", only {len(ratios)} of {len(cases)} shapes measured"
    return lines + [f"- {row.key} GOAL {goal}: {'met' if met else 'BELOW GOAL'} (geomean {mean:.3f}x, "
                    f"min {low[0]:.2f}x at {low[1]}{partial})"]


def failure_notes(key: str, cases: list, tolerance: float, head_start_us: float = 0.0) -> list:
    """Why cells are missing or doubtful, one line per (provider, reason)."""
    reasons = {}
    for case in cases:
        for name, result in case.items():
            if name not in TITLES or not isinstance(result, dict):
                continue
            if result.get("status") != "ok":
                reason = f"{result['status']}: {result.get('error', '')}"
            elif not result["checked"]:
                reason = f"rel error {result['rel_error']:.1e} past {tolerance:g}"
            elif _ok(result) and result.get("host_us", 0) > result["ms"] * 1e3 + head_start_us:
                reason = (f"host time per call exceeds device time + L2 flush ({head_start_us:.0f} us): "
                          "the timing may hold host time")
            else:
                continue
            reasons.setdefault((TITLES[name], reason), []).append(case["label"])
    return [f"- {key} {name}: {reason} [{'; '.join(labels)}]" for (name, reason), labels in reasons.items()]


def report(results: dict, header: dict):
    """Print every row's tables, the goals and the notes."""
    goals, notes = [], []
    for key, cases in results.items():
        if cases:
            goals += report_row(ROWS[key], cases)
            notes += failure_notes(key, cases, TOLERANCE, header.get("flush_us", 0.0))
    print("\n### Goals (dnngraph speed over each anchor, geometric mean over shapes)\n\n" + "\n".join(goals))
    if notes:
        print("\nNot measured, not built, past tolerance, or timings that may hold host time:\n" + "\n".join(notes))
    print(f"\ndevice: {header['device']}, torch {header['torch']}, triton {header['triton']}, "
          f"cuDNN (torch) {header['torch_cudnn']}; cuDNN frontend: {header['cudnn_frontend']}; "
          f"run took {header['seconds']:.0f} s")


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv):
    """The command line."""
    parser = family_parser(__doc__.splitlines()[0], ROWS, f"only the shapes {', '.join(QUICK)}", "shapes")
    parser.add_argument("--gluon", action="store_true",
                        help="build dnngraph with BuildOptions(backends=('gluon', 'triton')) (gluon wherever it "
                             "supports a group); a Triton-only build becomes the 'dnngraph Triton' anchor")
    parser.add_argument("--gluon-schedule", choices=("plain", "pingpong"), default=None,
                        help="with --gluon: offer only the Gluon attention configs of this schedule")
    return parser.parse_args(argv)


def main(argv=None):
    """Run the benchmark (or --list-shapes / --check-cpu) with command-line arguments `argv`."""
    global BUILD_OPTIONS
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.gluon:
        BUILD_OPTIONS = dg.BuildOptions(backends=("gluon", "triton"))
    if args.gluon_schedule:
        from dnngraph.backends.gluon import attention_backend
        attention_backend.CONFIGS = {d: tuple(c for c in configs if c.pingpong == (args.gluon_schedule == "pingpong"))
                                     for d, configs in attention_backend.CONFIGS.items()}
    return run_family(args, "dnngraph-bench-attention-", list_shapes, check_cpu, run_gpu)


def list_shapes(args):
    """Print each row's shapes (GPU and --check-cpu), visible fractions and work."""
    for key in args.rows:
        row = ROWS[key]
        for cpu in (False, True):
            shapes = row_shapes(key, args, cpu)
            print_table(f"{key}{' (--check-cpu)' if cpu else ''}: {row.title}",
                        ["shape", "dims", "visible", "GB read" if row.decode else "GFLOP", "anchors"],
                        [[s.label, s.describe(), f"{s.visible_pairs() / (s.s_q * s.s_kv):.4f}",
                          f"{(s.kv_bytes if row.decode else s.work(row.backward)) / 1e9:.4g}",
                          ", ".join(TITLES[a] for a in (FP8_ANCHORS if row.fp8 else anchors_of(s)))]
                         for s in shapes])


def run_gpu(args, cache_dir):
    """Measure every requested row on the GPU, print the report, write $OUT/attention.json."""
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: use --check-cpu for the CPU smoke test")
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references are full float32
    torch.backends.cudnn.allow_tf32 = False
    for knob in ("recompile_limit", "cache_size_limit"):  # flex recompiles per mask and shape
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    started = time.perf_counter()
    torch.empty(1, device="cuda")  # torch's CUDA context before cuDNN's
    frontend, fe_note = frontend_from_args(args, CudnnAttention)
    print(f"cuDNN frontend: {fe_note}", flush=True)
    ctx = Context(args, "cuda", BF16, F32, TOLERANCE, True, frontend, fe_note,
                  started + args.compile_budget_s, {})
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "torch_cudnn": torch.backends.cudnn.version(), "cudnn_frontend": fe_note, "tolerance": TOLERANCE,
              "dnngraph_cache_dir": cache_dir, "flush_us": flush_us(), "rows": args.rows,
              "work": "forward 4*B*H*D*visible pairs, backward x2.5; decode K+V bytes"}
    return run_rows({key: ROWS[key] for key in args.rows}, lambda key: row_shapes(key, args),
                    lambda row, shape: timed_case(row, shape, ctx, started), report, "attention.json", header, started)


def timed_case(row: RowSpec, shape: AttnShape, ctx: Context, started: float) -> dict:
    """run_case with a progress line; a failing reference marks every provider n/a."""
    start = time.perf_counter()
    try:
        case = run_case(row, shape, ctx)
    except Exception as error:  # noqa: BLE001 - the inputs or the reference of the shape failed
        case = {"label": shape.label, "shape": shape.describe(), "work": 0.0, "visible": 0.0,
                **{p: _failed(error) for p in (FP8_ANCHORS if row.fp8 else anchors_of(shape)) + ("dg",)}}
    case["seconds"] = time.perf_counter() - start
    cells = [f"{TITLES[p]} {_cell(case[p])}" for p in case if p in TITLES]
    backends = (case.get("dg") or {}).get("backends")
    print(f"[{time.perf_counter() - started:5.0f} s] {row.key} {shape.label} ({case['seconds']:.0f} s): "
          + ", ".join(cells) + (f" [dnngraph kernels: {', '.join(backends)}]" if backends else ""), flush=True)
    return case


def check_cpu(args):
    """Tiny fp32 shapes on CPU against float64: the CPU-capable anchors, dnngraph, g.reference()."""
    ctx = Context(args, "cpu", F32, F64, CPU_TOLERANCE, False, compiled={})
    cases, verdicts = [], []
    for key in args.rows:
        for shape in row_shapes(key, args, cpu=True):
            start = time.perf_counter()
            case = run_case(ROWS[key], shape, ctx)
            cases.append((key, case))
            verdicts += [cpu_verdict(name, case[name]) for name in case if name in TITLES]
            verdicts.append(reference_verdict(case))
            print(f"{key} {shape.label} ({time.perf_counter() - start:.1f} s): "
                  + " | ".join(f"{TITLES[n]} {cpu_cell(case[n])}" for n in case if n in TITLES)
                  + f" | torch ref vs g.reference {reference_cell(case)}", flush=True)
    providers = providers_of([c for _, c in cases])
    print_table(f"CPU check (fp32, dnngraph through Triton's interpreter): relative error vs float64 "
                f"(tolerance {CPU_TOLERANCE:g})", ["row", "shape", "dims"] + [TITLES[p] for p in providers]
                + ["torch ref vs g.reference"],
                [[key, c["label"], c["shape"]] + [cpu_cell(c.get(p)) for p in providers] + [reference_cell(c)]
                 for key, c in cases])
    notes = [line for key, c in cases for line in failure_notes(key, [c], CPU_TOLERANCE)]
    if notes:
        print("\n" + "\n".join(notes))
    return cpu_exit(verdicts, "dnngraph graph(s) or reference check(s) cannot be built yet")


def cpu_verdict(name: str, result) -> str:
    """ok, wrong or unsupported (dnngraph not built yet) for one provider's CPU result."""
    status = result.get("status")
    if status == "ok":
        return "ok" if result["checked"] else "wrong"
    if status == "skipped":
        return "ok"
    return "unsupported" if name == "dg" and status == "not built" else "wrong"


def reference_verdict(case) -> str:
    """ok when this file's reference matches g.reference() to 1e-6; unsupported when not declarable."""
    value = case.get("reference_check")
    if value is None:
        return "unsupported"
    return "ok" if value <= case.get("reference_tolerance", 1e-6) else "wrong"


def reference_cell(case) -> str:
    """The reference check as a table cell."""
    value = case.get("reference_check")
    text = "-" if value is None else f"{value:.0e}"
    return text + (f" ({case['reference_check_error']})" if "reference_check_error" in case else "")


def cpu_cell(result) -> str:
    """One provider's CPU result as a table cell."""
    if not result:
        return "-"
    if result.get("status") == "ok":
        return f"err {result['rel_error']:.1e}" + ("" if result["checked"] else " (!)")
    return result["status"]


# --- fp8 attention rows ----------------------------------------------------------------------------
# q, k, v and dO are e4m3 with per-tensor scales from their amax (the frontend's samples' recipe:
# scale = 448 / amax, descale its reciprocal); o, dq, dk, dv e4m3 at scales from the reference's
# amaxes; scale_s 448 (P <= 1). Every provider is compared, dequantized, with the float attention of
# the dequantized fp8 inputs (the bf16 anchor with its own inputs' rounding): the error is the fp8
# rounding of P, dS and the outputs.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_TOLERANCE = {False: 8e-2, True: 1.2e-1}  # forward, backward
GRADIENT_NAMES = ("dq", "dk", "dv")
FP8_FORWARD_INPUTS = ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
FP8_BACKWARD_INPUTS = ("q", "k", "v", "o", "d_o", "stats", "descale_q", "descale_k", "descale_v", "descale_o",
                       "descale_d_o", "descale_s", "descale_dp", "scale_s", "scale_dq", "scale_dk", "scale_dv", "scale_dp")


def _quantized(value: torch.Tensor) -> tuple:
    """(fp8 value, its scale, its descale [1, 1, 1, 1] float32) of `value` at scale 448 / amax."""
    scale = FP8_MAX / value.abs().max().float().clamp_min(1e-30)
    return (value.float() * scale).to(FP8), scale.view(1, 1, 1, 1), (1.0 / scale).view(1, 1, 1, 1)


def fp8_references(shape: AttnShape, dequantized: dict, dtype, backward: bool) -> dict:
    """o, lse, max |dS| and the gradients of the dequantized inputs in `dtype`, one (batch, K/V head)
    group at a time (dS = P (dP - delta) * scale, the value sdpa_fp8_backward rounds at scale_dP)."""
    q, k, v, d_o = (dequantized[n].to(dtype) for n in ("q", "k", "v", "d_o"))
    group, visible = shape.heads // shape.kv_heads, visible_mask(shape, q.device)
    o = torch.empty(q.shape, dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:3] + (1,), dtype=dtype, device=q.device)
    grads = [torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (q, k, v)]
    ds_amax = torch.zeros((), dtype=dtype, device=q.device)
    for b in range(shape.batch):
        for kv_head in range(shape.kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            out, row_lse = attend(q[b, heads], k[b, kv_head], v[b, kv_head], visible, shape.scale)
            o[b, heads], lse[b, heads] = out, row_lse
            if not backward:
                continue
            scores = (q[b, heads] @ k[b, kv_head].transpose(-1, -2) * shape.scale).masked_fill(~visible, -math.inf)
            probs = (scores - row_lse).exp()
            delta = (out * d_o[b, heads]).sum(-1, keepdim=True)
            d_scores = probs * (d_o[b, heads] @ v[b, kv_head].transpose(-1, -2) - delta) * shape.scale
            ds_amax = torch.maximum(ds_amax, d_scores.abs().max())
            grads[0][b, heads] = d_scores @ k[b, kv_head]
            grads[1][b, kv_head] = (d_scores.transpose(-1, -2) @ q[b, heads]).sum(0)
            grads[2][b, kv_head] = (probs.transpose(-1, -2) @ d_o[b, heads]).sum(0)
    return {"o": (o,), "lse": lse, "ds_amax": ds_amax, "grads": tuple(grads) if backward else None}


def fp8_inputs(shape: AttnShape, ctx: Context, backward: bool) -> tuple:
    """(fp8 inputs and scales by name, dequantized inputs, references)."""
    base = make_inputs(shape, ctx.device, F32)
    inputs, dequantized = {}, {}
    for name in ("q", "k", "v", "d_o"):
        inputs[name], _, inputs[f"descale_{name}"] = _quantized(base[name])
        dequantized[name] = inputs[name].float() * inputs[f"descale_{name}"]
    refs = fp8_references(shape, dequantized, ctx.ref_dtype, backward)
    one = torch.ones(1, 1, 1, 1, device=ctx.device)
    inputs.update(scale_s=one * FP8_MAX, descale_s=one / FP8_MAX)
    inputs["o"], inputs["scale_o"], inputs["descale_o"] = _quantized(refs["o"][0])
    inputs["stats"] = refs["lse"].float()
    if backward:
        inputs["scale_dp"] = one * FP8_MAX / float(refs["ds_amax"])
        inputs["descale_dp"] = 1.0 / inputs["scale_dp"]
        for name, grad in zip(GRADIENT_NAMES, refs["grads"]):
            _, inputs[f"scale_{name}"], inputs[f"descale_{name}"] = _quantized(grad)
    return inputs, dequantized, refs


def dg_fp8_graph(shape: AttnShape, inputs: dict, backward: bool) -> tuple:
    """(graph, bindings, outputs with their descales): g.sdpa_fp8 or g.sdpa_fp8_backward."""
    g = dg.Graph(name="sdpa_fp8_backward" if backward else "sdpa_fp8")
    names = FP8_BACKWARD_INPUTS if backward else FP8_FORWARD_INPUTS
    t = {name: g.tensor_like(inputs[name], name=name) for name in names}
    mask = dict(use_causal_mask=shape.right_bound == 0)
    if backward:
        outputs = g.sdpa_fp8_backward(t["q"], t["k"], t["v"], t["o"], t["d_o"], t["stats"], t["descale_q"],
                                      t["descale_k"], t["descale_v"], t["descale_o"], t["descale_d_o"],
                                      t["descale_s"], t["descale_dp"], t["scale_s"], t["scale_dq"], t["scale_dk"],
                                      t["scale_dv"], t["scale_dp"], attn_scale=shape.scale, **mask)
        descales = [inputs[f"descale_{name}"] for name in GRADIENT_NAMES]
    else:
        outputs = g.sdpa_fp8(t["q"], t["k"], t["v"], t["descale_q"], t["descale_k"], t["descale_v"],
                             t["descale_s"], t["scale_s"], t["scale_o"], is_inference=True, attn_scale=shape.scale,
                             **mask)
        descales = [inputs["descale_o"]]
    for tensor in outputs:
        if tensor is not None:
            tensor.set_output(True)
    bindings = {tensor: inputs[name] for name, tensor in t.items()}
    return g, bindings, [o for o in outputs if o is not None], descales


def dg_fp8_provider(shape: AttnShape, inputs: dict, backward: bool) -> Callable:
    """dnngraph's sdpa_fp8(_backward); outputs compared dequantized."""
    def factory():
        g, bindings, outputs, descales = dg_fp8_graph(shape, inputs, backward)
        start = time.perf_counter()
        try:
            g.build(options=BUILD_OPTIONS)
        except dg.UnsupportedError as error:
            raise NotBuilt(_short(error, 300)) from None
        buffers = tuple(poisoned(t.dim, t.stride, t.data_type.torch_dtype, inputs["q"].device) for t in outputs)
        bindings.update(zip(outputs, buffers))
        launches = getattr(g.plan, "launches", None) or []
        extra = {"build_s": time.perf_counter() - start, "launches": len(launches),
                 "backends": sorted({launch.backend for launch in launches})}

        def dequantized():
            return tuple(buffer.float() * descale for buffer, descale in zip(buffers, descales))
        return (lambda: g.execute(bindings)), dequantized, "grads" if backward else "o", extra
    return factory


class CudnnFp8Attention(CudnnAttention):
    """The frontend's sdpa_fp8 / sdpa_fp8_backward graphs (its test/python/sdpa/fp8.py): e4m3 I/O,
    float32 descales and scales, amax_o (and the backward's four amaxes) as outputs; amax_s is
    not asked for (the frontend's own samples leave it out: some of its engines decline it)."""

    def _graph(self):
        fe = self.fe
        return fe.pygraph(io_data_type=fe.data_type.FP8_E4M3, intermediate_data_type=fe.data_type.FLOAT,
                          compute_data_type=fe.data_type.FLOAT, handle=self.handle)

    def _tensors(self, g, inputs: dict, names) -> dict:
        """Graph tensors of the inputs; fp8 ones declared with dims, strides and FP8_E4M3 (older
        frontends' tensor_like does not map torch's fp8 dtypes)."""
        tensors = {}
        for name in names:
            value = inputs[name]
            if value.dtype == FP8:
                tensors[name] = g.tensor(name=name, dim=list(value.shape), stride=list(value.stride()),
                                         data_type=self.fe.data_type.FP8_E4M3)
            else:
                tensors[name] = g.tensor_like(value)
        return tensors

    @staticmethod
    def _fp8_mask(shape: AttnShape) -> dict:
        """The fp8 rows' shapes are causal or unmasked: use_causal_mask, which every frontend's
        sdpa_fp8 takes (the band arguments' names differ between releases)."""
        return dict(use_causal_mask=shape.right_bound == 0)

    def _typed(self, outputs: dict) -> dict:
        for tensor, buffer in outputs.items():
            tensor.set_data_type(self.fe.data_type.FP8_E4M3 if buffer.dtype == FP8 else self.fe.data_type.FLOAT)
        return outputs

    def fp8_forward(self, shape: AttnShape, inputs) -> tuple:
        names = FP8_FORWARD_INPUTS
        g = self._graph()
        t = self._tensors(g, inputs, names)
        o, _, _, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"],
                                     descale_k=t["descale_k"], descale_v=t["descale_v"], descale_s=t["descale_s"],
                                     scale_s=t["scale_s"], scale_o=t["scale_o"], generate_stats=False,
                                     attn_scale=shape.scale, name="sdpa_fp8", **self._fp8_mask(shape))
        out = torch.empty(inputs["q"].shape, dtype=FP8, device="cuda").fill_(float("nan"))
        amax = torch.full((1, 1, 1, 1), float("nan"), device="cuda")
        run = self._finish(g, {t[n]: inputs[n] for n in names}, self._typed({o: out, amax_o: amax}))
        return run, out

    def fp8_backward(self, shape: AttnShape, inputs) -> tuple:
        names = FP8_BACKWARD_INPUTS
        g = self._graph()
        t = self._tensors(g, inputs, names)
        grads = g.sdpa_fp8_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["d_o"], stats=t["stats"],
                                    descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
                                    descale_o=t["descale_o"], descale_dO=t["descale_d_o"], descale_s=t["descale_s"],
                                    descale_dP=t["descale_dp"], scale_s=t["scale_s"], scale_dQ=t["scale_dq"],
                                    scale_dK=t["scale_dk"], scale_dV=t["scale_dv"], scale_dP=t["scale_dp"],
                                    attn_scale=shape.scale, name="sdpa_fp8_backward", **self._fp8_mask(shape))
        buffers = tuple(torch.empty(inputs[n].shape, dtype=FP8, device="cuda").fill_(float("nan"))
                        for n in ("q", "k", "v"))
        amaxes = tuple(torch.full((1, 1, 1, 1), float("nan"), device="cuda") for _ in range(4))
        run = self._finish(g, {t[n]: inputs[n] for n in names}, self._typed(dict(zip(grads, buffers + amaxes))))
        return run, buffers


def cudnn_fp8_provider(shape: AttnShape, inputs: dict, backward: bool, ctx) -> Callable:
    """The frontend's sdpa_fp8(_backward) graph; outputs compared dequantized."""
    def factory():
        if ctx.frontend is None:
            raise Skipped(f"cuDNN frontend {ctx.fe_note}")
        if not hasattr(ctx.frontend, "fp8"):  # one handle for every fp8 graph
            ctx.frontend.fp8 = CudnnFp8Attention(ctx.frontend.fe)
        frontend = ctx.frontend.fp8
        if backward:
            run, buffers = frontend.fp8_backward(shape, inputs)
            descales = [inputs[f"descale_{name}"] for name in GRADIENT_NAMES]
        else:
            run, out = frontend.fp8_forward(shape, inputs)
            buffers, descales = (out,), [inputs["descale_o"]]

        def dequantized():
            return tuple(buffer.float() * descale for buffer, descale in zip(buffers, descales))
        return run, dequantized, "grads" if backward else "o", {}
    return factory


def run_fp8_case(row: RowSpec, shape: AttnShape, ctx: Context) -> dict:
    """An fp8 row's shape: dnngraph's fp8 kernels against its bf16 kernel on the dequantized inputs
    and the frontend's sdpa_fp8, each compared with the float attention of those inputs. On CPU
    checks, g.reference() of the fp8 graph against the same float attention too."""
    inputs, dequantized, refs = fp8_inputs(shape, ctx, row.backward)
    tolerance = FP8_TOLERANCE[row.backward]
    fp8_ctx = dataclasses.replace(ctx, tolerance=tolerance)
    wide = {name: value.to(ctx.dtype) for name, value in dequantized.items()}
    wide.update(o=refs["o"][0].to(ctx.dtype), stats=inputs["stats"])  # the bf16 kernel's own (unrounded) o
    io_type = dg.bfloat16 if ctx.dtype == BF16 else dg.float32
    factories = {"dg_bf16": dg_provider(shape, wide, io_type, row.backward),
                 "cudnn_fe_fp8": cudnn_fp8_provider(shape, inputs, row.backward, ctx),
                 "dg": dg_fp8_provider(shape, inputs, row.backward)}
    work = shape.work(row.backward)
    case = {"label": shape.label, "shape": shape.describe() + " e4m3", "work": work,
            "visible": shape.visible_pairs() / (shape.s_q * shape.s_kv)}
    for name, factory in factories.items():
        case[name] = measure(factory, refs, work, ctx if name == "dg_bf16" else fp8_ctx)
    if not ctx.timed:
        g, bindings, outputs, descales = dg_fp8_graph(shape, inputs, row.backward)
        graph_refs = g.reference(bindings)
        ours = refs["grads"] if row.backward else refs["o"]
        case["reference_check"] = max(rel_error(graph_refs[t.name] * descale.double(), mine)
                                      for t, descale, mine in zip(outputs, descales, ours))
        case["reference_tolerance"] = tolerance
    return case


if __name__ == "__main__":
    main()
