"""Command line: `python -m dnngraph explain|bench|dot graph.json`.

explain  builds the serialized graph and prints its plan (kernels, configs and why)
bench    also times each kernel on random inputs (never zeros) and prints a table
dot      prints Graphviz text of the graph with its kernels as clusters
"""
from __future__ import annotations

import argparse
import sys

import torch

from .graph import Graph
from .plan.launch import element_span


def _random_input(tensor, device) -> torch.Tensor:
    dtype = tensor.data_type.torch_dtype
    span = element_span(tensor)
    if tensor.data_type.is_floating:
        flat = torch.randn(span, device=device).to(dtype)
    elif dtype == torch.bool:
        flat = torch.rand(span, device=device) < 0.5
    else:
        flat = torch.randint(1, 7, (span,), device=device, dtype=dtype)
    return flat.as_strided(tensor.dim, tensor.stride)


def _moved_bytes(group) -> int:
    return sum(t.data_type.itemsize * max(1, _numel(t.dim)) for t in group.inputs + group.outputs)


def _numel(dim) -> int:
    count = 1
    for size in dim:
        count *= size
    return count


def bench(graph: Graph, device: str) -> str:
    """A table of each kernel's median time (and bytes it reads and writes over that time)."""
    bindings = {t: _random_input(t, device) for t in graph.inputs()}
    bindings.update({t: torch.empty_strided(t.dim, t.stride, dtype=t.data_type.torch_dtype, device=device)
                     for t in graph.outputs()})
    rows = ["| kernel | kind | ops | config | us | GB/s |", "|---|---|---|---|---|---|"]
    total = 0.0
    for index, (launch, ms) in enumerate(graph.plan.profile(bindings)):
        group = launch.group
        ops = ", ".join(n.op for n in group.nodes)
        rate = _moved_bytes(group) / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
        rows.append(f"| {index} | {group.kind} | {ops} | {launch.config_text} | {ms * 1e3:.1f} | {rate:.0f} |")
        total += ms
    rows.append(f"| all | | | | {total * 1e3:.1f} | |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dnngraph", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("explain", "bench", "dot"))
    parser.add_argument("graph", help="a graph serialized by Graph.to_json")
    parser.add_argument("--autotune", action="store_true", help="build with autotuning")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    with open(args.graph, encoding="utf-8") as handle:
        graph = Graph.from_json(handle.read())
    if args.command == "dot":
        print(graph.to_dot(), end="")
        return 0
    graph.build(autotune=args.autotune)
    print(graph.explain())
    if args.command == "bench":
        print()
        print(bench(graph, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
