"""The convolutions' ranking rule (dnngraph/backends/triton/heuristics/conv_measured.py) against
measurements, per direction: per layer the faster backend measured, the one the registry ranks
first on an H200 target, and the cost of each mis-rank; and the MEASURED_LAYERS lines of a new
bench_conv.py run, to paste in when the rule is measured again. No device: the ranking is plain data.

    python benchmarks/conv_ranking.py                 # the measurements MEASURED_LAYERS holds
    python benchmarks/conv_ranking.py /tmp/out/conv.json   # bench_conv.py --rows fprop,dgrad,wgrad --gluon's results
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.backends.triton.heuristics.conv_measured import MEASURED_LAYERS, MeasuredLayer
from dnngraph.fusion import partition
from dnngraph.options import BuildOptions
from dnngraph.problems import problem_of
from dnngraph.target import H200

SHAPE = re.compile(r"N(\d+) C(\d+) K(\d+) (\d+)x(\d+) (\d+)x(\d+)/(\d+) p(\d+)")


def _nhwc(dims) -> list:
    n, c, h, w = dims
    return [h * w * c, 1, w * c, c]


def _problem(layer: MeasuredLayer):
    """The conv group of bench_conv.py's row of the layer's direction: bf16 NHWC x, dy and KRSC w;
    relu(conv + bias) for the forward, dx or dw alone for the gradients."""
    g = dg.Graph(name="conv_ranking", io_data_type=dg.bfloat16)
    p = layer.out_size
    x_dims, w_dims, y_dims = ([layer.n, layer.c, layer.size, layer.size], [layer.k, layer.c, layer.filter, layer.filter],
                              [layer.n, layer.k, p, p])
    geometry = dict(padding=[layer.padding] * 2, stride=[layer.stride] * 2, dilation=[1, 1])
    w = g.tensor(name="w", dim=w_dims, stride=_nhwc(w_dims))
    x = g.tensor(name="x", dim=x_dims, stride=_nhwc(x_dims))
    dy = g.tensor(name="dy", dim=y_dims, stride=_nhwc(y_dims))
    if layer.direction == "fprop":
        y = g.conv_fprop(x, w, **geometry)
        g.relu(g.add(y, g.tensor(name="bias", dim=[1, layer.k, 1, 1]))).set_output(True)
    elif layer.direction == "dgrad":
        g.conv_dgrad(dy, w, x_dim=x_dims, **geometry).set_output(True)
    else:
        g.conv_wgrad(dy, x, w_dim=w_dims, **geometry).set_output(True)
    (group,) = [found for found in partition(g, registry.families()) if found.kind == "conv"]
    return problem_of(g, group)


def _ran(provider: dict) -> list:
    return (provider.get("plan") or {}).get("backends", [])


def measured_layers(path: str) -> list:
    """The square-filter layers of a bench_conv.py JSON with both backends timed, where Gluon runs
    and its column ran Gluon's kernel (a plan that names its backends: "dg gluon" is a build
    preferring Gluon, which the rule may rank to Triton; such a row measures no Gluon time)."""
    found = []
    results = json.load(open(path))["results"]
    for direction, row in ((d, row) for d in MEASURED_LAYERS for row in results.get(d, [])):
        match, triton, gluon = SHAPE.fullmatch(row["shape"]), row.get("dg", {}), row.get("dg_gluon", {})
        if match is None or "ms" not in triton or "ms" not in gluon:
            continue
        if set(_ran(triton)) - {"triton"} or set(_ran(gluon)) - {"gluon"}:
            print(f"{row['label']}: left out, its columns ran {_ran(triton)} and {_ran(gluon)}, not Triton and "
                  f"Gluon alone (build its dg gluon with BuildOptions(backends=('gluon',)) to time Gluon)")
            continue
        n, c, k, h, w, r, s, stride, padding = (int(v) for v in match.groups())
        if h != w or r != s:
            continue
        layer = MeasuredLayer(row["label"], n, c, k, h, r, stride, padding,
                              {"triton": round(triton["ms"] * 1e3, 1), "gluon": round(gluon["ms"] * 1e3, 1)},
                              direction)
        if GLUON.supports(_problem(layer), H200) is True:
            found.append(layer)
    return found


def confusion(layers) -> list:
    """(label, faster measured, ranked first, cost in us: 0 where they agree) per layer."""
    rows = []
    for layer in layers:
        faster = min(layer.us, key=layer.us.get)
        ranked = registry.choose(_problem(layer), H200, BuildOptions(target=H200), interpreted=False).name
        cost = 0.0 if ranked == faster else abs(layer.us["triton"] - layer.us["gluon"])
        rows.append((layer.label, faster, ranked, cost))
    return rows


LINE_MAKERS = {"fprop": "_layer", "dgrad": "_dgrad", "wgrad": "_wgrad"}


def layer_line(layer: MeasuredLayer) -> str:
    """The MEASURED_LAYERS line of `layer` (conv_measured.py's format)."""
    return (f'    {LINE_MAKERS[layer.direction]}("{layer.label}", {layer.n}, {layer.c}, {layer.k}, {layer.size}, {layer.filter}, '
            f'{layer.stride}, {layer.padding}, {layer.us["triton"]}, {layer.us["gluon"]}),')


def print_confusion(layers) -> None:
    print("| layer | Triton us | Gluon us | faster | ranked | mis-rank cost us |")
    print("|---|---|---|---|---|---|")
    rows = confusion(layers)
    for layer, (label, faster, ranked, cost) in zip(layers, rows):
        print(f"| {label} | {layer.us['triton']} | {layer.us['gluon']} | {faster} | {ranked} | {cost:.1f} |")
    missed = [(label, cost) for label, _, _, cost in rows if cost]
    print(f"agree on {len(rows) - len(missed)} of {len(rows)}; mis-ranked: "
          f"{', '.join(f'{label} ({cost:.1f} us)' for label, cost in missed) or 'none'}; "
          f"{sum(cost for _, cost in missed):.1f} us in all")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", help="bench_conv.py's JSON (default: MEASURED_LAYERS' measurements)")
    args = parser.parse_args(argv)
    layers = measured_layers(args.results) if args.results else [l for ls in MEASURED_LAYERS.values() for l in ls]
    for direction in MEASURED_LAYERS:
        chosen = [layer for layer in layers if layer.direction == direction]
        if not chosen:
            continue
        print(f"\n{direction}:")
        if args.results:
            print("MEASURED_LAYERS lines of this run:")
            print("\n".join(layer_line(layer) for layer in chosen))
        print_confusion(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
