"""A corpus of malformed and unusual JSON documents: each one either loads (and then builds and runs
correctly against the float64 reference) or raises SerializationError, nothing else, and no
payload in it ever runs."""
import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dnngraph as dg
from helpers import check


# --- base documents ------------------------------------------------------------------------------
def pointwise_graph():
    g = dg.Graph(name="pointwise")
    x = g.tensor(name="x", dim=[3, 5], stride=[1, 3])
    b = g.tensor(name="b", dim=[1, 5])
    g.add(g.mul(g.leaky_relu(x, negative_slope=0.2, name="act"), 2.0), b).set_output(True).set_name("y")
    return g


def rows_graph():
    g = dg.Graph(name="rows")
    x = g.tensor(name="x", dim=[4, 7])
    g.reduction(x, "max", [1]).set_output(True).set_name("r")
    g.softmax(x, axis=1).set_output(True).set_name("s")
    return g


def norm_graph():
    g = dg.Graph(name="norm")
    x = g.tensor(name="x", dim=[4, 7])
    scale, bias = g.tensor(name="scale", dim=[1, 7]), g.tensor(name="bias", dim=[1, 7])
    g.layernorm(x, scale, bias, epsilon=1e-3)[0].set_output(True).set_name("y")
    return g


def pooling_graph():
    g = dg.Graph(name="pooling")
    x = g.tensor(name="x", dim=[2, 3, 7, 7])
    g.pooling(x, "max", window=[2, 2], stride=[2, 2], padding=[1, 1]).set_output(True).set_name("y")
    return g


def dropout_graph():
    g = dg.Graph(name="dropout")
    x = g.tensor(name="x", dim=[3, 5])
    g.dropout(x, p=0.25, seed=7, offset=3).set_output(True).set_name("y")
    return g


def family_graph():
    """Ops without a CPU kernel on every path (conv, attention, layout): documents load only."""
    g = dg.Graph(name="families")
    image, w = g.tensor(name="image", dim=[2, 4, 6, 6]), g.tensor(name="w", dim=[4, 2, 3, 3])
    g.conv_fprop(image, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=2).set_output(True)
    q = g.tensor(name="q", dim=[1, 2, 4, 8])
    g.sdpa(q, q, q, attn_scale=0.5, dropout=(0.1, 5, 6))[0].set_output(True)
    g.slice(image, [slice(None), slice(0, 2), slice(None), slice(0, 6, 2)]).set_output(True)
    g.transpose(image, [0, 2, 3, 1]).set_output(True)
    g.concatenate([image, image], axis=1).set_output(True)
    g.cast(image, data_type=dg.float16).set_output(True)
    s = g.tensor(name="s", dim=[1, 4, 1, 1])
    g.groupnorm(image, s, s, groups=2)[0].set_output(True)
    g.batchnorm(image, s, s, s, s, momentum=0.2)[0].set_output(True)
    return g


BASES = {"pointwise": pointwise_graph, "rows": rows_graph, "norm": norm_graph, "pooling": pooling_graph,
         "dropout": dropout_graph, "families": family_graph}
RUNNABLE = {"pointwise", "rows", "norm", "pooling", "dropout"}


def node(doc, op):
    return next(n for n in doc["nodes"] if n["op"] == op)


def tensor(doc, name):
    return next(t for t in doc["tensors"] if t["name"] == name)


def payload(canary):
    """Python that would leave the canary file behind if anything ever evaluated it."""
    return f"__import__('os').system('touch {canary}')"


def statements(canary):
    return f"0.1\nopen({str(canary)!r}, 'w').write('ran')\n"


NESTED = "nested arrays"  # a marker document() replaces with the text of deeply nested arrays


def nested(depth):
    """Arrays `depth` deep, as text (json.dumps itself cannot write them)."""
    return f"{NESTED} {depth}"


def _expand_nesting(text: str) -> str:
    while f'"{NESTED} ' in text:
        start = text.index(f'"{NESTED} ')
        end = text.index('"', start + 1)
        depth = int(text[start + len(NESTED) + 2:end])
        text = text[:start] + "[" * depth + "]" * depth + text[end + 1:]
    return text


def reduce_first_axis(doc, canary):
    node(doc, "reduction")["attrs"]["axes"] = [0]
    tensor(doc, "r").update(dim=[1, 7], stride=[7, 1])


def maximum_with_minus_infinity(doc, canary):
    node(doc, "mul").update(op="maximum", attrs={**node(doc, "mul")["attrs"], "constants": [[1, float("-inf")]]})


# --- the corpus: (base, mutation(doc, canary), expectation) ---------------------------------------
def _set(path_fn, key, value):
    return lambda d, c: path_fn(d).__setitem__(key, value(c) if callable(value) else value)


REJECT, LOAD = "reject", "load"
CORPUS = {
    # the header
    "format is a number": ("pointwise", lambda d, c: d.__setitem__("format", 5), REJECT),
    "version is a string": ("pointwise", lambda d, c: d.__setitem__("version", "1"), REJECT),
    "version is a float": ("pointwise", lambda d, c: d.__setitem__("version", 1.0), REJECT),
    "version is true": ("pointwise", lambda d, c: d.__setitem__("version", True), REJECT),
    "version is huge": ("pointwise", lambda d, c: d.__setitem__("version", 2**80), REJECT),
    "graph is a list": ("pointwise", lambda d, c: d.__setitem__("graph", []), REJECT),
    "graph name is a number": ("pointwise", _set(lambda d: d["graph"], "name", 5), REJECT),
    "graph name is empty": ("pointwise", _set(lambda d: d["graph"], "name", ""), REJECT),
    "io type is a number": ("pointwise", _set(lambda d: d["graph"], "io_data_type", 5), REJECT),
    "io type is unknown": ("pointwise", _set(lambda d: d["graph"], "io_data_type", "float128"), REJECT),
    "io type is a payload": ("pointwise", _set(lambda d: d["graph"], "io_data_type", payload), REJECT),
    "compute type float16": ("pointwise", _set(lambda d: d["graph"], "compute_data_type", "float16"), REJECT),
    "intermediate type int32": ("pointwise", _set(lambda d: d["graph"], "intermediate_data_type", "int32"),
                                REJECT),
    "allow_tf32 is a string": ("pointwise", _set(lambda d: d["graph"], "allow_tf32", "no"), REJECT),
    "graph name is a payload": ("pointwise", _set(lambda d: d["graph"], "name", statements), LOAD),
    # tensors
    "tensors is an object": ("pointwise", lambda d, c: d.__setitem__("tensors", {}), REJECT),
    "tensor is a string": ("pointwise", lambda d, c: d["tensors"].__setitem__(0, "x"), REJECT),
    "uid is a string": ("pointwise", _set(lambda d: d["tensors"][0], "uid", "1"), REJECT),
    "uid is a float": ("pointwise", _set(lambda d: d["tensors"][0], "uid", 1.0), REJECT),
    "uid is true": ("pointwise", _set(lambda d: d["tensors"][0], "uid", True), REJECT),
    "duplicate uid": ("pointwise", lambda d, c: d["tensors"][1].__setitem__("uid", d["tensors"][0]["uid"]),
                      REJECT),
    "name is a number": ("pointwise", _set(lambda d: tensor(d, "x"), "name", 5), REJECT),
    "name is empty": ("pointwise", _set(lambda d: tensor(d, "x"), "name", ""), REJECT),
    "duplicate names": ("pointwise", _set(lambda d: tensor(d, "b"), "name", "x"), REJECT),
    "dims are a string": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", "35"), REJECT),
    "dim is a string": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [3, "5"]), REJECT),
    "dim is 2.5": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [3, 2.5]), REJECT),
    "dim is 5.0": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [3, 5.0]), REJECT),
    "dim is true": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [True, 5]), REJECT),
    "dim is 2**62": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [2**62, 5]), REJECT),
    "dims overflow int64 together": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [2**32, 2**32]), REJECT),
    "dim is huge": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [10**30, 5]), REJECT),
    "dim is negative": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [-3, 5]), REJECT),
    "dims are empty": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", []), REJECT),
    "dims nest": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", [[3], 5]), REJECT),
    "dims nest 10000 deep": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", nested(10_000)), REJECT),
    "dims nest 500 deep": ("pointwise", _set(lambda d: tensor(d, "x"), "dim", nested(500)), REJECT),
    "stride is a string": ("pointwise", _set(lambda d: tensor(d, "x"), "stride", ["1", 3]), REJECT),
    "stride is 1.5": ("pointwise", _set(lambda d: tensor(d, "x"), "stride", [1.5, 3]), REJECT),
    "stride is NaN": ("pointwise", _set(lambda d: tensor(d, "x"), "stride", [float("nan"), 3]), REJECT),
    "stride is huge": ("pointwise", _set(lambda d: tensor(d, "x"), "stride", [2**62, 3]), REJECT),
    "stride rank differs": ("pointwise", _set(lambda d: tensor(d, "x"), "stride", [1]), REJECT),
    "output strides overlap": ("pointwise", _set(lambda d: tensor(d, "y"), "stride", [1, 1]), REJECT),
    "output dims differ": ("pointwise", _set(lambda d: tensor(d, "y"), "dim", [5, 3]), REJECT),
    "output dims are floats": ("pointwise", _set(lambda d: tensor(d, "y"), "dim", [3.0, 5.0]), REJECT),
    "data type is a number": ("pointwise", _set(lambda d: tensor(d, "x"), "data_type", 5), REJECT),
    "data type is a payload": ("pointwise", _set(lambda d: tensor(d, "x"), "data_type", payload), REJECT),
    "output data type is a list": ("pointwise", _set(lambda d: tensor(d, "y"), "data_type", ["float32"]),
                                   REJECT),
    "is_output is a string": ("pointwise", _set(lambda d: tensor(d, "y"), "is_output", "no"), REJECT),
    "is_output is 1": ("pointwise", _set(lambda d: tensor(d, "y"), "is_output", 1), REJECT),
    "an input is an output": ("pointwise", _set(lambda d: tensor(d, "x"), "is_output", True), REJECT),
    "output stride transposed": ("pointwise", _set(lambda d: tensor(d, "y"), "stride", [1, 3]), LOAD),
    # nodes
    "nodes is a string": ("pointwise", lambda d, c: d.__setitem__("nodes", "[]"), REJECT),
    "node is a list": ("pointwise", lambda d, c: d["nodes"].__setitem__(0, []), REJECT),
    "op is a number": ("pointwise", _set(lambda d: d["nodes"][0], "op", 5), REJECT),
    "op is unknown": ("pointwise", _set(lambda d: d["nodes"][0], "op", "conv9d"), REJECT),
    "op is a payload": ("pointwise", _set(lambda d: d["nodes"][0], "op", payload), REJECT),
    "node name is a number": ("pointwise", _set(lambda d: d["nodes"][0], "name", 5), REJECT),
    "node name is empty": ("pointwise", _set(lambda d: d["nodes"][0], "name", ""), REJECT),
    "inputs is a string": ("pointwise", _set(lambda d: d["nodes"][0], "inputs", "1"), REJECT),
    "input is a list": ("pointwise", lambda d, c: d["nodes"][0].__setitem__("inputs", [[d["nodes"][0]["inputs"][0]]]),
                        REJECT),
    "input is true": ("pointwise", _set(lambda d: d["nodes"][0], "inputs", [True]), REJECT),
    "input is a float": ("pointwise", lambda d, c: d["nodes"][0].__setitem__("inputs", [float(d["nodes"][0]["inputs"][0])]),
                         REJECT),
    "extra input": ("pointwise", lambda d, c: d["nodes"][0]["inputs"].append(d["nodes"][0]["inputs"][0]), REJECT),
    "missing input": ("pointwise", lambda d, c: node(d, "add")["inputs"].pop(), REJECT),
    "extra output": ("pointwise", lambda d, c: d["nodes"][0]["outputs"].append(None), REJECT),
    "attrs is a list": ("pointwise", _set(lambda d: d["nodes"][0], "attrs", []), REJECT),
    "unknown attribute": ("pointwise", lambda d, c: d["nodes"][0]["attrs"].__setitem__("bogus", 1), REJECT),
    # pointwise attributes
    "slope is a payload": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope", payload),
                           REJECT),
    "slope carries statements": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope",
                                                   statements), REJECT),
    "slope is a numeric string": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope",
                                                    "0.2"), REJECT),
    "slope is NaN": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope", float("nan")),
                     REJECT),
    "slope is Infinity": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope",
                                            float("inf")), REJECT),
    "slope overflows to Infinity": ("pointwise", lambda d, c: json.dumps(d).replace('"negative_slope": 0.2',
                                                                                    '"negative_slope": 1e999'),
                                    REJECT),
    "slope is true": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope", True), REJECT),
    "slope is a list": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope", [0.2]),
                        REJECT),
    "slope is an int": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "negative_slope", 1), LOAD),
    "beta is zero": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "beta", 0.0), REJECT),
    "cast type is a payload": ("pointwise", _set(lambda d: node(d, "leaky_relu")["attrs"], "data_type", payload),
                               REJECT),
    "constant position out of range": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants",
                                                         [[5, 2.0]]), REJECT),
    "constant where a tensor is": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants",
                                                     [[0, 2.0]]), REJECT),
    "constant is a string": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", [[1, "2.0"]]),
                             REJECT),
    "constant is a payload": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants",
                                                lambda c: [[1, payload(c)]]), REJECT),
    "constant is true": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", [[1, True]]), REJECT),
    "constant is huge": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", [[1, 10**30]]),
                         REJECT),
    "constant lacks a value": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", [[1]]), REJECT),
    "constant position is a float": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants",
                                                       [[1.0, 2.0]]), REJECT),
    "constant given twice": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants",
                                               [[1, 2.0], [1, 3.0]]), REJECT),
    "constant missing": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", []), REJECT),
    "constants is a string": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", "2.0"), REJECT),
    "constant is an int": ("pointwise", _set(lambda d: node(d, "mul")["attrs"], "constants", [[1, 3]]), LOAD),
    "constant is -Infinity": ("pointwise", maximum_with_minus_infinity, LOAD),
    # reduction and softmax
    "axes [-1]": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", [-1]), REJECT),
    "axes [1, 1]": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", [1, 1]), REJECT),
    "axes descending": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", [1, 0]), REJECT),
    "axes empty": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", []), REJECT),
    "axes out of range": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", [2]), REJECT),
    "axes are strings": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", ["1"]), REJECT),
    "axes is an int": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "axes", 1), REJECT),
    "axes [0]": ("rows", reduce_first_axis, LOAD),
    "mode is unknown": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "mode", "median"), REJECT),
    "mode is a payload": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "mode", payload), REJECT),
    "mode is a list": ("rows", _set(lambda d: node(d, "reduction")["attrs"], "mode", ["max"]), REJECT),
    "softmax axis -1": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "axis", -1), REJECT),
    "softmax axis is a string": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "axis", "1"), REJECT),
    "softmax axis is 1.0": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "axis", 1.0), REJECT),
    "softmax log is a string": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "log", "no"), REJECT),
    "softmax log is 0": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "log", 0), REJECT),
    "softmax log is true": ("rows", _set(lambda d: node(d, "softmax")["attrs"], "log", True), LOAD),
    # norms
    "epsilon is zero": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "epsilon", 0.0), REJECT),
    "epsilon is a string": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "epsilon", "1e-5"), REJECT),
    "epsilon is NaN": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "epsilon", float("nan")), REJECT),
    "epsilon is a payload": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "epsilon", statements), REJECT),
    "momentum is 2": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "momentum", 2), REJECT),
    "groups is 2.5": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "groups", 2.5), REJECT),
    "groups is zero": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "groups", 0), REJECT),
    "phase is unknown": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "norm_forward_phase", "eval"),
                         REJECT),
    "has_dbias is a string": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "has_dbias", "yes"), REJECT),
    "epsilon is an int": ("norm", _set(lambda d: node(d, "layernorm")["attrs"], "epsilon", 1), LOAD),
    # pooling and dropout
    "window is 2.5": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "window", [2.5, 2]), REJECT),
    "window is a string": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "window", "22"), REJECT),
    "window is zero": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "window", [0, 2]), REJECT),
    "window is huge": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "window", [2**62, 2]), REJECT),
    "pool stride is negative": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "stride", [-1, 2]), REJECT),
    "pool padding is short": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "padding", [1]), REJECT),
    "pool mode is unknown": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "mode", "maxx"), REJECT),
    "pool window 3": ("pooling", _set(lambda d: node(d, "pooling")["attrs"], "window", [3, 3]), LOAD),
    "p is 1": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "p", 1.0), REJECT),
    "p is a string": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "p", "0.25"), REJECT),
    "p is NaN": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "p", float("nan")), REJECT),
    "seed is negative": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "seed", -1), REJECT),
    "seed is 2**64": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "seed", 2**64), REJECT),
    "seed is 1.5": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "seed", 1.5), REJECT),
    "offset is a string": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "offset", "3"), REJECT),
    "return_mask is 1": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "return_mask", 1), REJECT),
    "seed is 2**64 - 1": ("dropout", _set(lambda d: node(d, "dropout")["attrs"], "seed", 2**64 - 1), LOAD),
    # the other families
    "conv padding is a string": ("families", _set(lambda d: node(d, "conv_fprop")["attrs"], "padding", ["1", 1]),
                                 REJECT),
    "conv padding is an int": ("families", _set(lambda d: node(d, "conv_fprop")["attrs"], "padding", 1), REJECT),
    "conv groups is zero": ("families", _set(lambda d: node(d, "conv_fprop")["attrs"], "groups", 0), REJECT),
    "conv mode is a number": ("families", _set(lambda d: node(d, "conv_fprop")["attrs"], "mode", 5), REJECT),
    "conv shape is a string": ("families", _set(lambda d: node(d, "conv_fprop")["attrs"], "shape", "x"), REJECT),
    "sdpa dropout is 5": ("families", _set(lambda d: node(d, "sdpa")["attrs"], "dropout", 5), REJECT),
    "sdpa dropout is short": ("families", _set(lambda d: node(d, "sdpa")["attrs"], "dropout", [0.1, 5]), REJECT),
    "sdpa scale is a string": ("families", _set(lambda d: node(d, "sdpa")["attrs"], "attn_scale", "0.5"), REJECT),
    "sdpa causal is a string": ("families", _set(lambda d: node(d, "sdpa")["attrs"], "use_causal_mask", "no"),
                                REJECT),
    "slice step is zero": ("families", lambda d, c: node(d, "slice")["attrs"]["slices"][3].__setitem__(2, 0), REJECT),
    "slice is a string": ("families", _set(lambda d: node(d, "slice")["attrs"], "slices", "::"), REJECT),
    "slice bound is a float": ("families", lambda d, c: node(d, "slice")["attrs"]["slices"][1].__setitem__(1, 2.0),
                               REJECT),
    "slice is negative": ("families", lambda d, c: node(d, "slice")["attrs"]["slices"][1].__setitem__(0, -1),
                          REJECT),
    "permutation repeats": ("families", _set(lambda d: node(d, "transpose")["attrs"], "permutation", [0, 1, 1, 2]),
                            REJECT),
    "permutation is strings": ("families", _set(lambda d: node(d, "transpose")["attrs"], "permutation",
                                                ["0", "2", "3", "1"]), REJECT),
    "concatenate axis -1": ("families", _set(lambda d: node(d, "concatenate")["attrs"], "axis", -1), REJECT),
    "cast to a payload": ("families", _set(lambda d: node(d, "cast")["attrs"], "data_type", payload), REJECT),
    "cast to a number": ("families", _set(lambda d: node(d, "cast")["attrs"], "data_type", 16), REJECT),
    "groupnorm groups 3": ("families", _set(lambda d: node(d, "groupnorm")["attrs"], "groups", 3), REJECT),
    "the families load": ("families", lambda d, c: None, LOAD),
    # names are data: quotes, newlines, non-ASCII and kernel-variable look-alikes load and run
    "input named with quotes": ("pointwise", _set(lambda d: tensor(d, "x"), "name", 'x"""\'\'\''), LOAD),
    "input named with a newline": ("pointwise", _set(lambda d: tensor(d, "x"), "name", "a\nb = 1\n"), LOAD),
    "input named non-ASCII": ("pointwise", _set(lambda d: tensor(d, "x"), "name", "x\u00e9\u4e2d\U0001f600"), LOAD),
    "input named like a payload": ("pointwise", _set(lambda d: tensor(d, "x"), "name", statements), LOAD),
    "output named with quotes": ("pointwise", _set(lambda d: tensor(d, "y"), "name", "y'\"#"), LOAD),
    "node named with a newline": ("pointwise", _set(lambda d: node(d, "leaky_relu"), "name", "act\n'''\nimport os"),
                                  LOAD),
    "softmax input named row_max": ("rows", _set(lambda d: tensor(d, "x"), "name", "row_max"), LOAD),
    "norm input named like recipe values": ("norm", _set(lambda d: tensor(d, "x"), "name", "mean"), LOAD),
}


def document(base: str, mutate, canary) -> str:
    doc = json.loads(BASES[base]().to_json())
    result = mutate(doc, canary)
    return _expand_nesting(result if isinstance(result, str) else json.dumps(doc))


def random_inputs(graph) -> dict:
    """Fresh random values for every input, in its declared layout and type."""
    values = {}
    for t in graph.inputs():
        value = torch.empty_strided(t.dim, t.stride, dtype=t.data_type.torch_dtype)
        value.copy_(torch.randn(t.dim) * 2)
        values[t.name] = value
    return values


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corpus_document_loads_and_runs_or_is_rejected(case, tmp_path):
    base, mutate, expectation = CORPUS[case]
    canary = tmp_path / "canary"
    text = document(base, mutate, canary)
    if expectation == REJECT:
        with pytest.raises(dg.SerializationError):
            dg.Graph.from_json(text)
        assert not canary.exists()
        return
    graph = dg.Graph.from_json(text)
    again = dg.Graph.from_json(graph.to_json())
    assert again.to_json() == graph.to_json()  # names and numbers survive the round trip
    if base in RUNNABLE:
        torch.manual_seed(0)
        check(graph, random_inputs(graph))
    assert not canary.exists()


def test_corpus_covers_every_base():
    assert {base for base, _, _ in CORPUS.values()} == set(BASES)


@pytest.mark.parametrize("text", ["", "null", "[]", "{}", "1", '"dnngraph"', "[" * 100_000, "{" * 10_000,
                                  '{"format": "dnngraph", "version": 1e400}', "NaN", b"\xff\xfe", 42, None])
def test_whole_documents_that_are_not_graphs(text):
    with pytest.raises(dg.SerializationError):
        dg.Graph.from_json(text)


def test_deep_nesting_anywhere_is_rejected():
    doc = json.loads(pointwise_graph().to_json())
    node(doc, "leaky_relu")["attrs"]["negative_slope"] = nested(10_000)
    with pytest.raises(dg.SerializationError):
        dg.Graph.from_json(_expand_nesting(json.dumps(doc)))


# --- random damage to a valid document ----------------------------------------------------------
def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.integers(-2**70, 2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 1, 2, 3, 2**62])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=5)
BASE_DOCS = {name: json.loads(make().to_json()) for name, make in BASES.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(BASE_DOCS)), st.data())
def test_randomly_damaged_documents_load_or_raise_serialization_error(base, data):
    doc = copy.deepcopy(BASE_DOCS[base])
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = data.draw(JUNK)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier replacement removed this path
    try:
        dg.Graph.from_json(json.dumps(doc))
    except dg.SerializationError:
        pass
