"""bench_attention.py with the attention configs BuildOptions can force set from the environment,
to time a config or grid against the tables' choice in the same way (do_bench, L2 flushed):

    G=0 python benchmarks/attention_knobs.py --rows fwd,bwd --only causal       # the plain grid
    FWD=128,64,8,3 python benchmarks/attention_knobs.py --rows fwd               # forward tiles
    DKDV=64,128,8,3 DQ=64,64,4,2 python benchmarks/attention_knobs.py --rows bwd # backward tiles

G: heads interleaved by causal grids (BuildOptions.sdpa_head_group); FWD: the forward's
(BLOCK_M, BLOCK_N, warps, stages) (sdpa_config); DKDV / DQ: the backward's (sdpa_dkdv_config,
sdpa_dq_config). Every shape of the run gets the forced value.
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import dnngraph as dg  # noqa: E402  (first: selects the interpreter on a CPU-only machine)
from dnngraph.backends.triton.heuristics import sdpa as heuristics  # noqa: E402


def _config(text: str):
    return heuristics.AttentionConfig(*(int(part) for part in text.split(",")))


def options_from_environment() -> dg.BuildOptions:
    """The BuildOptions the environment names (FWD, G, DKDV, DQ)."""
    fields = {}
    if os.environ.get("FWD"):
        fields["sdpa_config"] = _config(os.environ["FWD"])
    if os.environ.get("G"):
        fields["sdpa_head_group"] = int(os.environ["G"])
    if os.environ.get("DKDV"):
        fields["sdpa_dkdv_config"] = _config(os.environ["DKDV"])
        fields["sdpa_dq_config"] = _config(os.environ.get("DQ", "64,64,4,2"))
    return dg.BuildOptions(**fields)


def main():
    """Run bench_attention.py with this command line, its graphs built with the options the
    environment names."""
    bench = runpy.run_path(os.path.join(HERE, "bench_attention.py"), run_name="bench_attention")
    bench["BUILD_OPTIONS"] = options_from_environment()
    bench["main"](sys.argv[1:])


if __name__ == "__main__":
    main()
