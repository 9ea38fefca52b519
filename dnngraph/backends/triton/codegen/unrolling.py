"""How much of a loop nest over user-sized extents generated code may unroll.

Triton's `tl.static_range` copies its body once per iteration before the compiler sees it, so
a nest of static loops over user-sized extents (pooling windows, the windows covering an
element, filter taps) grows the kernel with the product of the extents, and the GPU compile
time with it (a 3x3x3 max-pool backward recomputing each covering window's argmax unrolled
12 x 27 window loads: minutes of ptxas). Loops past a budget of unrolled bodies become runtime
loops: the innermost loops stay unrolled (their loads are independent and stay in flight
together, which is what keeps a windowed kernel memory-bound), the outer ones repeat that body.
"""
from __future__ import annotations

# Copies of a nest's innermost body that unrolling may make. 64 keeps every common window whole
# (3x3, 5x5, 7x7, 3x3x3: 9 to 49 loads in flight a tile, as many as registers allow anyway) and
# bounds the kernel to about twice the 3x3x3 forward's length, which compiles in seconds.
UNROLLED_BODIES_MAX = 64


def unrolled_loops(extents, budget: int = UNROLLED_BODIES_MAX) -> list[bool]:
    """Per loop of a nest (extents outermost first), whether to unroll it: a loop is unrolled
    when it and every loop inside it together make at most `budget` copies of the innermost
    body, so the unrolled loops are always the innermost ones."""
    flags, copies = [], 1
    for extent in reversed(list(extents)):
        copies *= max(int(extent), 1)
        flags.append(copies <= budget)
    return flags[::-1]


def loop_header(variable: str, count: str, unrolled: bool) -> str:
    """The `for` line of one loop of `count` iterations (a constexpr name or a literal)."""
    loop = "tl.static_range" if unrolled else "tl.range"
    return f"for {variable} in {loop}({count}):"
