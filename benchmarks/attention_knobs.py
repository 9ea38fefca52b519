"""bench_attention.py with the attention heuristics' force knobs set from the environment, to time
a config or grid against the tables' choice in the same way (do_bench, L2 flushed):

    G=0 python benchmarks/attention_knobs.py --rows fwd,bwd --only causal       # the plain grid
    FWD=128,64,8,3 python benchmarks/attention_knobs.py --rows fwd               # forward tiles
    DKDV=64,128,8,3 DQ=64,64,4,2 python benchmarks/attention_knobs.py --rows bwd # backward tiles

G: heads interleaved by causal grids (heuristics.sdpa.FORCE_HEAD_GROUP); FWD: the forward's
(BLOCK_M, BLOCK_N, warps, stages) (FORCE_CONFIG); DKDV / DQ: the backward's (FORCE_BACKWARD).
Every shape of the run gets the forced value.
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import dnngraph  # noqa: E402,F401  (first: selects the interpreter on a CPU-only machine)
from dnngraph.heuristics import sdpa as heuristics  # noqa: E402


def _config(text: str):
    return heuristics.AttentionConfig(*(int(part) for part in text.split(",")))


def main():
    """Set the knobs the environment names, then run bench_attention.py with this command line."""
    if os.environ.get("FWD"):
        heuristics.FORCE_CONFIG = _config(os.environ["FWD"])
    if os.environ.get("G"):
        heuristics.FORCE_HEAD_GROUP = int(os.environ["G"])
    if os.environ.get("DKDV"):
        heuristics.FORCE_BACKWARD = {"dkdv": _config(os.environ["DKDV"]),
                                     "dq": _config(os.environ.get("DQ", "64,64,4,2"))}
    sys.argv = [os.path.join(HERE, "bench_attention.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
