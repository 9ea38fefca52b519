"""The block-scaled operand loader of the matmul (MXFP8, MXFP4, NVFP4 operands).

A matmul side produced by block_scale_dequantize (blocks along K) loads its quantized elements
and their scales and multiplies them in the loader: no native block-scaled MMA is assumed. The
tile feeds tl.dot as bfloat16, which holds every such product exactly (an fp8 or fp4 value
times a power of two or an e4m3 scale has at most 5 significant bits; bfloat16 has float32's
exponent range, subnormals aside), and the dot accumulates in float32.

Packed fp4 is read a byte per element (each byte twice, from cache): element offset e lies in
byte e // 2, low nibble where e is even, so any layout whose packed axis is the stride-1 one
works. The element and scale loads use the side's own strides (batch, rows, columns; the
scale's column is the K block).
"""
from __future__ import annotations

from dataclasses import dataclass

from .... import dtypes
from .gemm import Loader, offset_2d


@dataclass(frozen=True)
class BlockScaledLoader(Loader):
    """tile_<side> = elements * scales of one side ("a": [BLOCK_M, BLOCK_K], "b": [BLOCK_K,
    BLOCK_N]); `block` elements of K share a scale."""

    side: str
    block: int
    element_type: object  # the quantized elements' DataType
    scale_type: object
    dot_type: str = "tl.bfloat16"
    libraries = ("bsq",)

    @property
    def names(self) -> tuple:
        s = self.side
        return (f"kblock_{s}", f"codes_{s}", f"elements_{s}", f"scales_{s}", f"raw_{s}", f"ptrs_{s}",
                f"scale_raw_{s}")

    def tile_setup(self, spec, w):
        if self.side == "a":
            w("rows_a = offs_m % M")
        else:
            w("cols_b = offs_n % N")

    def _where(self, spec) -> tuple:
        """(rows, cols, K block index on the scale's axis, mask or "") of the side's tile."""
        s = self.side
        ragged = spec.k_walk.ragged
        if s == "a":
            return "rows_a", "ks", ("rows_a", f"kblock_{s}"), "mask_k[None, :]" if ragged else ""
        return "ks", "cols_b", (f"kblock_{s}", "cols_b"), "mask_k[:, None]" if ragged else ""

    def step(self, spec, w):
        s = self.side
        (elements,) = spec.side(s)
        (scales,) = spec.side(f"{s}_scale")
        rows, cols, scale_at, mask = self._where(spec)
        masked = f", mask={mask}" if mask else ""
        w(f"kblock_{s} = ks // {self.block}")
        offset = offset_2d(elements, rows, cols, full=True)
        if self.element_type is dtypes.float4_e2m1:
            w(f"ptrs_{s} = {offset}",
              f"raw_{s} = tl.load({elements.ident}_ptr + ptrs_{s} // 2{masked})",
              f"codes_{s} = (raw_{s} >> ((ptrs_{s} % 2) * 4).to(tl.uint8)) & 0xF",
              f"elements_{s} = bsq.fp4_values(codes_{s})")
        else:
            w(f"elements_{s} = tl.load({elements.ident}_ptr + {offset}{masked}).to(tl.float32)")
        w(f"scale_raw_{s} = tl.load({scales.ident}_ptr + {offset_2d(scales, *scale_at, full=True)}{masked})")
        if self.scale_type is dtypes.float8_e8m0:
            w(f"scales_{s} = bsq.e8m0_values(scale_raw_{s})")
        else:
            w(f"scales_{s} = scale_raw_{s}.to(tl.float32)")
        product = f"elements_{s} * scales_{s}"
        if mask:  # past K: zeros, whatever the masked loads left there
            product = f"tl.where({mask}, {product}, 0.0)"
        w(f"tile_{s} = ({product}).to({self.dot_type})")
