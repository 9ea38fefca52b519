"""Render matmul kernels: the matmul family's k walk and operand loaders for the shared GEMM
mainloop (codegen/gemm.py), which renders the kernels themselves.

  LinearK           (codegen/gemm.py) k steps of BLOCK_K along one K axis
  StridedLoader     pointer loads over batch/row/column strides (any layout, any alignment),
                    with the pointwise prologue applied at load where the group has one
  DescriptorLoader  TMA tensor descriptors (Hopper; unit stride on one matrix axis, 16-byte
                    pitches), one per program or per tile when the batch entry moves
"""
from __future__ import annotations

from dataclasses import dataclass

from .gemm import (GemmKernelSpec, GemmOperand, LinearK, Loader, batch_offset, converted, load, offset_2d,
                   prologue_tile, render)

__all__ = ["GemmKernelSpec", "GemmOperand", "LinearK", "StridedLoader", "DescriptorLoader", "render"]


VECTOR_BYTES = 16  # the widest vector load the hints let the compiler form


def _wrapped_index(offsets: str, size: str, block: str, hinted: bool) -> str:
    """Tile indices wrapped into [0, size); with `hinted`, the contiguity hints of a full block."""
    wrapped = f"{offsets} % {size}"
    return f"tl.max_contiguous(tl.multiple_of({wrapped}, {block}), {block})" if hinted else wrapped


@dataclass(frozen=True)
class StridedLoader(Loader):
    """Pointer loads of one side's tile ([BLOCK_M, BLOCK_K] for A, [BLOCK_K, BLOCK_N] for B)
    converted to `dot_type`; with a prologue, every leaf operand of the side is loaded (broadcast
    axes once) and the chain runs in the compute type, zero past K whatever it maps zero to."""

    side: str  # "a" | "b"
    target_uid: int  # the tensor the matmul reads on this side (the prologue's result)
    dot_type: str
    prologue: tuple = ()  # pointwise nodes applied at load

    def tile_setup(self, spec, w):
        # wrapped indices: loads need no M/N masks (stores mask the tail); the hints keep 16-byte
        # vector loads along a contiguous M or N axis: without them 3000x5000x1000 ran 9x slower.
        # The hints hold only where the wrap never splits a vector: an axis shorter than its block
        # wraps inside the first tile (on the H100 an N=13 operand faulted with a misaligned
        # address), and a size that is no multiple of a 16-byte vector wraps mid-vector in the
        # last tile (an M-contiguous A of 37 rows faulted on the H200).
        # An axis whose size varies in the bucket (a dynamic extent) takes no hints: they are
        # baked into a source every size of the bucket shares, and no range of sizes is all
        # multiples of a vector.
        if self.side == "a":
            w(f"rows_a = {_wrapped_index('offs_m', 'M', 'BLOCK_M', self._hints_hold(spec, 'm', spec.config.block_m))}")
        else:
            w(f"cols_b = {_wrapped_index('offs_n', 'N', 'BLOCK_N', self._hints_hold(spec, 'n', spec.config.block_n))}")

    def _hints_hold(self, spec, axis: str, block: int) -> bool:
        """Are the contiguity hints true of every tile of `axis` ("m" or "n") in blocks of
        `block`, at every size the kernel runs?"""
        size = getattr(spec.problem, axis)
        vector = VECTOR_BYTES // min(op.data_type.itemsize for op in spec.side(self.side))
        return axis not in spec.varying and size >= block and size % vector == 0

    def step(self, spec, w):
        side = self.side
        rows, cols = ("rows_a", "ks") if side == "a" else ("ks", "cols_b")
        k_mask = "" if not spec.k_walk.ragged else ("mask_k[None, :]" if side == "a" else "mask_k[:, None]")
        operands = spec.side(side)
        if not self.prologue:
            (op,) = operands
            pointer = f"{op.ident}_ptr + {offset_2d(op, rows, cols, full=True)}"
            loaded = f"tl.load({pointer}, mask={k_mask}, other=0.0)" if k_mask else f"tl.load({pointer})"
            w(f"tile_{side} = {loaded}{converted(op, self.dot_type)}")
            return
        loads = [(op, load(op, rows, cols, k_mask if (op.col_stride if side == "a" else op.row_stride) else "",
                           spec.compute)) for op in operands]
        # padding past K must stay zero whatever the prologue maps zero to
        prologue_tile(spec, w, side, loads, self.prologue, self.target_uid, k_mask, self.dot_type)


_DESCRIPTORS = {
    # side, layout -> (shape, pitch axis, block, load coordinates, transpose after load)
    ("a", "row"): ("[M, K]", "r", "[BLOCK_M, BLOCK_K]", "[pid_m * BLOCK_M, kt * BLOCK_K]", False),
    ("a", "col"): ("[K, M]", "c", "[BLOCK_K, BLOCK_M]", "[kt * BLOCK_K, pid_m * BLOCK_M]", True),
    ("b", "row"): ("[K, N]", "r", "[BLOCK_K, BLOCK_N]", "[kt * BLOCK_K, pid_n * BLOCK_N]", False),
    ("b", "col"): ("[N, K]", "c", "[BLOCK_N, BLOCK_K]", "[pid_n * BLOCK_N, kt * BLOCK_K]", True),
}


@dataclass(frozen=True)
class DescriptorLoader(Loader):
    """A side's tiles through a TMA tensor descriptor over the unit-stride layout `layout`
    ("row": the side's columns contiguous, "col": its rows). One descriptor per program, or one
    per tile when the batch entry moves its base (128 B each, in scratch)."""

    side: str
    layout: str  # "row" | "col"
    uses_k_offsets = False

    def _make(self, spec, w):
        shape, pitch_axis, block, _, _ = _DESCRIPTORS[(self.side, self.layout)]
        (op,) = spec.side(self.side)
        base = batch_offset(op)
        pointer = f"{op.ident}_ptr" + (f" + {base}" if base else "")
        w(f"desc_{self.side} = tl.make_tensor_descriptor({pointer}, shape={shape}, "
          f"strides=[{op.ident}_stride_{pitch_axis}, 1], block_shape={block})")

    def program_setup(self, spec, w):
        if not spec.batch_sizes:
            self._make(spec, w)

    def tile_setup(self, spec, w):
        if spec.batch_sizes:
            self._make(spec, w)

    def step(self, spec, w):
        _, _, _, coords, transpose = _DESCRIPTORS[(self.side, self.layout)]
        w(f"tile_{self.side} = desc_{self.side}.load({coords})" + (".T" if transpose else ""))

    def strides_used(self, spec, body, op: GemmOperand) -> list:
        pitch_axis = _DESCRIPTORS[(self.side, self.layout)][1]
        stride = op.row_stride if pitch_axis == "r" else op.col_stride
        return [(f"{op.ident}_stride_{pitch_axis}", stride)]
