"""benchmarks/bench_models.py --backends: the dnngraph variant is compiled with options (torch.compile
takes a mode or options, not both) that replay CUDA graphs as the mode would and build with the
named backends; the torch backend accepts exactly those options."""
import os
import sys

import pytest

import dnngraph
from dnngraph import torch_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_models  # noqa: E402


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_backends_become_build_options_and_keep_the_modes_replay(mode):
    assert bench_models.dnngraph_compile_kwargs(mode, None) == {"mode": mode}
    kwargs = bench_models.dnngraph_compile_kwargs(mode, ["gluon", "triton"])
    options = kwargs["options"]
    assert set(kwargs) == {"options"} and options["build_options"].backends == ("gluon", "triton")
    assert options["cudagraphs"] is (mode == "reduce-overhead")
    assert torch_backend._replays(None, options) is (mode == "reduce-overhead")
    assert isinstance(torch_backend._build_options(options), dnngraph.BuildOptions)
