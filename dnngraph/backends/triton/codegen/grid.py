"""Program ids of a grid folded into axis x: a kernel whose logical grid passes CUDA's limits on
axis y or z (target.py: Target.max_grid) is launched with every program on axis x and
decodes each logical axis' index from program_id(0), the first axis fastest. Kernels render it
only for such grids; ordinary ones keep tl.program_id(axis)."""
from __future__ import annotations

FOLDED_PID = "pid_flat"  # the identifier the decode writes (each kernel reserves it)


def folded_program_ids(names, counts, cast: str = "") -> list:
    """Lines binding names[i] to the program's index on logical axis i, whose program counts are
    the expressions `counts` (the last one's count is implied); `cast` converts program_id(0)
    (".to(tl.int64)" where indices may pass 2^31)."""
    lines = [f"{FOLDED_PID} = tl.program_id(0){cast}"]
    for name, count in zip(names[:-1], counts):
        lines += [f"{name} = {FOLDED_PID} % ({count})", f"{FOLDED_PID} = {FOLDED_PID} // ({count})"]
    return lines + [f"{names[-1]} = {FOLDED_PID}"]
