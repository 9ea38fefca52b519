"""Command line: inspect serialized graphs, and move the autotuning cache between machines.

`python -m dnngraph explain|bench|dot graph.json`, `python -m dnngraph tuning export|import FILE`:

explain  builds the serialized graph and prints its plan (kernels, configs and why)
bench    also times each kernel on random inputs (never zeros) and prints a table
dot      prints Graphviz text of the graph with its kernels as clusters
tuning export FILE [--device NAME]  writes the autotuning cache (one GPU model's records) to FILE
tuning import FILE [--overwrite]    merges FILE into the autotuning cache; a differing local
                                    record is kept unless --overwrite

Exit status: 0 done, 1 refused or failed (the reason on stderr, nothing changed), 2 bad usage.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .graph import Graph
from .runtime.launch import element_span


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


def _graph_command(args) -> int:
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


def _export_lines(report) -> list[str]:
    lines = [f"exported {report.exported} tuning records to {report.destination}"]
    if report.skipped:
        lines.append(f"skipped {len(report.skipped)} records of the cache that are not valid tuning records "
                     f"(first: {report.skipped[0]!r})")
    if report.exported == 0 and report.devices:
        lines.append(f"the cache holds records for: {', '.join(report.devices)}")
    return lines


def _import_lines(report, overwrite: bool) -> list[str]:
    merged = report.merged
    total = sum(len(keys) for keys in merged)
    lines = [f"imported {total} tuning records from {report.source} into {report.cache_path}: "
             f"{len(merged.added)} added, {len(merged.identical)} already present, "
             f"{len(merged.replaced)} replaced, {len(merged.kept)} kept"]
    if merged.kept:
        lines.append(f"{len(merged.kept)} keys differ and the local record was kept (--overwrite takes the "
                     f"file's): {', '.join(repr(key) for key in merged.kept[:5])}"
                     f"{', ...' if len(merged.kept) > 5 else ''}")
    if overwrite and merged.replaced:
        lines.append(f"replaced: {', '.join(repr(key) for key in merged.replaced[:5])}"
                     f"{', ...' if len(merged.replaced) > 5 else ''}")
    if report.other_versions:
        lines.append(f"{report.other_versions} records name another Triton or dnngraph version: kept, "
                     f"not used by this one")
    return lines


def _tuning_command(args) -> int:
    from .errors import GraphError
    from .backends.triton.heuristics.tuning_transfer import export_tuning, import_tuning

    try:
        if args.action == "export":
            lines = _export_lines(export_tuning(args.file, device=args.device))
        else:
            lines = _import_lines(import_tuning(args.file, overwrite=args.overwrite), args.overwrite)
    except (GraphError, OSError) as error:
        print(f"python -m dnngraph tuning {args.action}: error: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dnngraph", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("explain", "bench", "dot"):
        command = commands.add_parser(name, help=f"{name} a graph serialized by Graph.to_json")
        command.add_argument("graph", help="a graph serialized by Graph.to_json")
        command.add_argument("--autotune", action="store_true", help="build with autotuning")
        command.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tuning = commands.add_parser("tuning", help="export or import the autotuning cache as one JSON file")
    actions = tuning.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write the cache's records to FILE")
    export.add_argument("file", help="the JSON file to write (replaced atomically)")
    export.add_argument("--device", metavar="NAME", default=None,
                        help="only records of this GPU model (its name, as torch.cuda.get_device_name gives it)")
    load = actions.add_parser("import", help="merge FILE's records into the cache")
    load.add_argument("file", help="a JSON file written by `tuning export`")
    load.add_argument("--overwrite", action="store_true",
                      help="on a key present with a different record, take the file's (default: keep the local one)")
    return parser


def main(argv=None) -> int:
    """Run one command line (`argv` without the program name; default sys.argv[1:]); returns
    the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "tuning":
        return _tuning_command(args)
    return _graph_command(args)


if __name__ == "__main__":
    sys.exit(main())
