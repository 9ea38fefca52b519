"""Build the launches of an sdpa_fp8 or sdpa_fp8_backward group (ops/sdpa_fp8.py): a launch that
zeroes the amax outputs, then the forward kernel, or the dK/dV and dQ kernels
(codegen/sdpa_fp8_library.py). An output the graph neither marks nor reads (an amax nobody asked
for, say) is written to a workspace buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .... import dtypes
from ....errors import UnsupportedError
from ....ops.sdpa_fp8 import check_types
from ....runtime.launch import kernel_name, launch_of, scratch
from ....tensor import contiguous_strides
from ..heuristics.layout import INT32_LIMIT
from ..heuristics.sdpa import MAX_GPU_HEAD_DIM
from ..codegen.sdpa_fp8 import (KEYS_MINOR, Fp8AttentionSpec, render, render_keys_minor, render_row_deltas,
                                 render_zero)

# fp8 tl.dot needs a reduction of at least 32 on sm_90 (and 16 on every other axis): every tile
# axis is at least MIN_TILE but the dK/dV kernel's key tile, which no dot reduces over
MIN_TILE = 32
MIN_KEY_TILE_DKDV = 16
INTERPRETER_TILE = 64  # the interpreter runs a tile op at numpy speed: few, large tiles


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def text(self, programs: tuple) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} num_warps={self.num_warps} "
                f"num_stages={self.num_stages} grid={list(programs)}")


# per kernel on the GPU: (BLOCK_M, BLOCK_N, warps, stages), each the fastest of its CANDIDATE_TILES
# on an H200 at B2 H16 S2048 D128 (benchmarks/sweep_sdpa_fp8.py, 2026-11-29): forward 193 us
# (128x64 w8 s3 231; causal 152 vs 181), dK/dV 1079 us (s2 1194), dQ 1188 us (128x64 w8 s3 1199;
# causal 704, s3 702). The dK/dV kernel holds two [BLOCK_N, D] float32 accumulators, so its tiles
# are narrow: ptxas (sm_90a, D = 128) reported spill stores for dK/dV at (32, 128, 8 warps) 368
# bytes, (64, 64, 4) 748, (32, 64, 4) 408, and none at (32, 64, 8)
GPU_TILES = {"forward": Fp8Tiles(64, 128, 4, 3), "dkdv": Fp8Tiles(32, 64, 8, 3), "dq": Fp8Tiles(64, 64, 4, 4)}
# Candidates a GPU sweep times per kernel (benchmarks/sweep_sdpa_fp8.py: GPU_TILES set to each in
# turn), heads up to WIDE_HEAD wide; each compiles for sm_90a (D = 128) with no spill stores
# (ptxas; a test keeps it so) and the first is GPU_TILES' choice. Excluded for spilling (bytes,
# 2026-11-29): dK/dV (32, 128, 8) 224, (64, 128, 8) 312, (32, 64, 4) 260, (64, 64, 4, 3) 16,
# (64, 64, 8) 36 to 76 (the hybrid e4m3/e5m2 GQA form); dQ (128, 128, 8) 20, (64, 128, 8) 4 (with
# its masked and unmasked key loops).
CANDIDATE_TILES = {
    "forward": (Fp8Tiles(64, 128, 4, 3), Fp8Tiles(128, 64, 8, 3), Fp8Tiles(128, 128, 8, 2), Fp8Tiles(128, 128, 8, 3),
                Fp8Tiles(128, 64, 8, 2), Fp8Tiles(64, 64, 4, 3)),
    "dkdv": (Fp8Tiles(32, 64, 8, 3), Fp8Tiles(32, 64, 8, 2), Fp8Tiles(32, 64, 8, 4), Fp8Tiles(32, 32, 4, 2),
             Fp8Tiles(32, 32, 4, 3)),
    "dq": (Fp8Tiles(64, 64, 4, 4), Fp8Tiles(128, 64, 8, 3), Fp8Tiles(128, 32, 8, 3), Fp8Tiles(64, 64, 4, 3)),
}
# heads wider than 128 (to MAX_GPU_HEAD_DIM): the tiles above spilled at D = 256 (ptxas, sm_90a:
# forward 424 bytes, dK/dV 616, dQ 548); these spill none (test_sdpa_fp8's wide-head compile)
WIDE_HEAD = 128
WIDE_GPU_TILES = {"forward": Fp8Tiles(64, 64, 8, 3), "dkdv": Fp8Tiles(32, 16, 8, 2), "dq": Fp8Tiles(64, 64, 8, 3)}


@dataclass(frozen=True)
class _Stored:
    """Where a kernel writes an output: the graph tensor, or a workspace buffer of its dims."""

    uid: int
    dim: tuple
    stride: tuple
    data_type: object


def _tile(extent: int, cap: int, floor: int = MIN_TILE) -> int:
    return max(floor, min(cap, triton.next_power_of_2(max(1, extent))))


# the tile axis that is the rows (M) of each kernel's dots: query rows in the forward and dQ, keys
# in dK/dV. On the GPU it keeps the table's size whatever the sequence: a tile shrunk below the
# rows its warps cover (16 per warp on mma.sync, the chained dots placing every warp along M)
# ran the fp8 dots on mma.sync with warps replicated over the tile, which gave NaN and dropped
# keys at Sq 21, Skv 19 on the H200 (2026-11-29); at the table's size they run on wgmma as at
# every measured shape. The rows past the sequence are masked.
DOT_ROWS_AXIS = {"forward": "block_m", "dq": "block_m", "dkdv": "block_n"}


def tiles_for(which: str, s_q: int, s_kv: int, interpreted: bool, width: int = 0) -> Fp8Tiles:
    """The tiles of kernel `which` for heads `width` wide (max of D and Dv): the GPU's table
    (its other axis shrunk for short sequences, DOT_ROWS_AXIS never), or one interpreter tile size."""
    base = (WIDE_GPU_TILES if width > WIDE_HEAD else GPU_TILES)[which]
    key_floor = MIN_KEY_TILE_DKDV if which == "dkdv" else MIN_TILE
    if interpreted:
        return Fp8Tiles(_tile(s_q, INTERPRETER_TILE), _tile(s_kv, INTERPRETER_TILE, key_floor), base.num_warps,
                        base.num_stages)
    block_m, block_n = _tile(s_q, base.block_m), _tile(s_kv, base.block_n, key_floor)
    if DOT_ROWS_AXIS[which] == "block_m":
        block_m = base.block_m
    else:
        block_n = base.block_n
    return Fp8Tiles(block_m, block_n, base.num_warps, base.num_stages)


def _roles(node, group) -> tuple:
    """(role -> tensor, the workspace buffers made) for a node's inputs and outputs; roles are the
    op's names lower-cased (dO -> do, scale_dQ -> scale_dq). A buffer holds a value of the graph,
    not a config's optional scratch: the workspace limit does not cover it (workspace.py)."""
    names = node.opdef.input_names + node.opdef.output_names
    stored = {t.uid for t in group.outputs}
    roles, buffers = {}, []
    for name, tensor in zip(names, list(node.inputs) + list(node.outputs)):
        if tensor is None:
            continue
        if any(tensor is t for t in node.outputs) and tensor.uid not in stored:
            buffer = scratch(tensor.dim, tensor.data_type.torch_dtype)
            buffers.append(buffer)
            tensor = _Stored(buffer.uid, tuple(tensor.dim), contiguous_strides(tensor.dim), tensor.data_type)
        roles[name.lower()] = tensor
    return roles, tuple(buffers)


COPY_ROWS = 64  # rows a keys_minor_copy program transposes
COPY_ALIGN = 16  # bytes: each line of a keys-minor copy starts where cp.async can read it


def _keys_minor_copies(roles: dict, kernels: tuple) -> dict:
    """role -> the keys-minor buffer ([B, H, D, S rounded up to COPY_ALIGN], contiguous) of each
    operand the kernels read keys-minor (codegen KEYS_MINOR): v for the forward, q, dO and k for
    the backward."""
    copies = {}
    for which in kernels:
        for role in KEYS_MINOR[which]:
            batch, heads, rows, width = roles[role].dim
            padded = -(-rows // COPY_ALIGN) * COPY_ALIGN
            buffer = scratch((batch, heads, width, padded), roles[role].data_type.torch_dtype)
            copies[role] = (buffer, _Stored(buffer.uid, buffer.dim, contiguous_strides(buffer.dim),
                                            roles[role].data_type))
    return copies


def _copy_launch(group, name: str, role: str, source, copy) -> object:
    """The launch of keys_minor_copy from `source` to `copy` (one program per COPY_ROWS rows of
    each (batch, head))."""
    batch, heads, rows, width = source.dim
    block = (COPY_ROWS, max(16, triton.next_power_of_2(width)))
    programs = (-(-rows // COPY_ROWS), batch * heads)
    text = render_keys_minor(f"{name}_{role}_t", source, copy, block, f"{role} keys-minor for {group.summary()}")
    return launch_of(group, text, programs, 4, f"BLOCK_R={block[0]} grid={list(programs)}",
                     f"{role} copied keys-minor: the fp8 dots reducing over its rows read it K-major, pipelined")


def _delta_buffer(roles: dict) -> tuple:
    """(buffer, its _Stored) of a backward's delta = rowsum(o dO), float32 [B, H, Sq] contiguous."""
    batch, heads, s_q, _ = roles["q"].dim
    buffer = scratch((batch, heads, s_q), torch.float32)
    return buffer, _Stored(buffer.uid, buffer.dim, contiguous_strides(buffer.dim), dtypes.float32)


def _delta_launch(group, name: str, roles: dict, block_dv: int):
    """The launch of row_deltas (one program per COPY_ROWS query rows of each (batch, head))."""
    batch, heads, s_q = roles["delta"].dim
    programs = (-(-s_q // COPY_ROWS), batch * heads)
    text = render_row_deltas(f"{name}_delta", roles, roles["v"].dim[3], (COPY_ROWS, block_dv),
                             f"rowsum(o dO) of {group.summary()}")
    return launch_of(group, text, programs, 4, f"BLOCK_M={COPY_ROWS} grid={list(programs)}",
                     "delta = rowsum(o dO) taken once: the dK/dV program meets each query tile once per key block")


def _check(node, roles: dict):
    for role in ("q", "k", "v", "o", "do", "stats", "dq", "dk", "dv"):
        tensor = roles.get(role)
        if tensor is None:
            continue
        if role != "stats" and tensor.stride[-1] != 1 and tensor.dim[-1] > 1:
            # the fp8 tensor-core loads read rows of the head dim; a strided one would gather bytes
            raise UnsupportedError(f"node {node.name!r} ({node.op}): {role} must have stride 1 on its head dim, "
                                   f"got strides {list(tensor.stride)}")
        # the kernels offset the batch in int64 and (head, row, column) in int32
        if sum((size - 1) * abs(stride) for size, stride in zip(tensor.dim[1:], tensor.stride[1:])) > INT32_LIMIT:
            raise UnsupportedError(f"node {node.name!r} ({node.op}): one batch element of {role} spans more than "
                                   f"2^31 elements (dims {list(tensor.dim)}, strides {list(tensor.stride)})")


def _check_width(node, width: int, interpreted: bool):
    """The GPU kernels hold [tile, D] float32 accumulators in registers: past MAX_GPU_HEAD_DIM (the
    frontend's limit, and the bf16 kernels') they would spill kilobytes."""
    if not interpreted and width > MAX_GPU_HEAD_DIM:
        raise UnsupportedError(f"node {node.name!r} ({node.op}): head dims past {MAX_GPU_HEAD_DIM} (got "
                               f"{node.inputs[0].dim[3]} and {node.inputs[2].dim[3]}) have no GPU kernel")


def build_sdpa_fp8(graph, group, context) -> list:
    """The zeroing launch and the kernels of one sdpa_fp8(_backward) node."""
    node = group.anchor
    check_types(node)
    # the target's tiles (BuildOptions.target may plan a GPU's for CPU tensors, run interpreted)
    interpreted = context.target.interpreted
    width = max(node.inputs[0].dim[3], node.inputs[2].dim[3])
    _check_width(node, width, interpreted)
    roles, buffers = _roles(node, group)
    _check(node, roles)
    q, k, v = roles["q"], roles["k"], roles["v"]
    (_, heads, s_q, head_dim), (_, kv_heads, s_kv, _) = q.dim, k.dim
    name = kernel_name(group)
    amaxes = [role for role in roles if role.startswith("amax_")]
    kernels = ("forward",) if node.op == "sdpa_fp8" else ("dkdv", "dq")
    copies = _keys_minor_copies(roles, kernels)
    buffers += tuple(buffer for buffer, _ in copies.values())
    if node.op != "sdpa_fp8":
        delta, roles["delta"] = _delta_buffer(roles)
        buffers += (delta,)
    block_d = max(MIN_TILE, triton.next_power_of_2(head_dim))
    block_dv = max(MIN_TILE, triton.next_power_of_2(v.dim[3]))
    launches = [launch_of(group, render_zero(name + "_zero", [roles[r].uid for r in amaxes], "amax zeroing of "
                                             + group.summary()), 1, 1, "one program",
                          "the amax outputs are atomic maxima: zeroed first", scratch=buffers)]
    launches += [_copy_launch(group, name, role, roles[role], copy) for role, (_, copy) in copies.items()]
    roles.update({f"{role}_t": copy for role, (_, copy) in copies.items()})
    if "delta" in roles:
        launches.append(_delta_launch(group, name, roles, block_dv))
    for which in kernels:
        tiles = tiles_for(which, s_q, s_kv, interpreted, width)
        spec = Fp8AttentionSpec(roles, heads, heads // kv_heads, s_q, s_kv, head_dim, v.dim[3],
                                node.attrs.scale(head_dim), node.attrs.use_causal_mask,
                                (tiles.block_m, tiles.block_n, block_d, block_dv))
        rows, tile = (s_kv, tiles.block_n) if which == "dkdv" else (s_q, tiles.block_m)
        programs = (-(-rows // tile), q.dim[0] * (kv_heads if which == "dkdv" else heads))
        source = render(f"{name}_{which}", which, spec, f"{which} of {group.summary()}")
        reason = (f"fp8 attention {which}: fp8 operands on the tensor cores, float32 accumulation, P and dS "
                  f"rounded to {q.data_type.name} where the frontend rounds them"
                  + ("; two walks over the keys (the row log-sum-exp, then P exactly normalized)"
                     if which == "forward" else ""))
        launches.append(launch_of(group, source, programs, tiles.num_warps, tiles.text(programs), reason,
                                  num_stages=tiles.num_stages))
    return launches
