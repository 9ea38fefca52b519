"""JSON round trip of graphs. Loading replays the op calls, so every shape rule and attribute
check runs again; nothing is evaluated or unpickled.

This module sits below Graph (tests/api/test_layers.py): it reads graphs and fills the empty graph
of the type Graph.from_json hands down, and never imports graph.py.
"""
from __future__ import annotations

import dataclasses
import functools
import json


from . import dtypes
from .dag import CycleError, Dag
from .errors import GraphError, SerializationError
from .ops import REGISTRY
from .symbolic import Dynamic, resized, symbols_of
from .tensor import dense_strides, stride_order

FORMAT = "dnngraph"
SCHEMA_VERSION = 2  # the newest version this reader reads
# a graph with dynamic extents is written as version 2 (a reader of version 1 would take it for the
# static graph at the symbols' max sizes); a static graph's document stays version 1, as before
DYNAMIC_SCHEMA_VERSION = 2


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _from_jsonable(value):
    if isinstance(value, list):
        return tuple(_from_jsonable(v) for v in value)
    return value


def _blend_factor_record(factor):
    """A blend factor as JSON: the number, or {"tensor": uid} of a one-element input."""
    return factor if isinstance(factor, (int, float)) else {"tensor": factor.uid}


def graph_document(graph) -> dict:
    """The graph as plain JSON-able data: tensors (with explicit settings) and nodes in creation
    order, under a versioned header."""
    tensors = []
    for tensor in graph.tensors:
        tensors.append({
            "uid": tensor.uid, "name": tensor.name, "dim": list(tensor.dim), "stride": list(tensor.own_stride),
            "data_type": tensor._data_type.name if tensor._data_type is not None else None,
            "is_output": tensor.is_output,
            **({"blend": [_blend_factor_record(f) for f in tensor.blend]} if tensor.blend is not None else {}),
            # written only where set: a document without the key reads as before
            **({"is_pass_by_value": True} if tensor.is_pass_by_value else {}),
            # an input's dynamic axes by symbol name (its outputs' are derived again on loading)
            **({"dynamic": [None if s is None else s.name for s in tensor.dynamic_dim_symbols]}
               if tensor.is_input and tensor.dynamic_dim_symbols else {}),
        })
    nodes = []
    for node in graph.nodes:
        attrs = {name: _jsonable(getattr(node.attrs, name)) for name in _written_fields(node.attrs)}
        nodes.append({"op": node.op, "name": node.name,
                      "inputs": [None if t is None else t.uid for t in _written_inputs(node)],
                      "outputs": [None if t is None else t.uid for t in node.outputs],
                      "attrs": attrs})
    return {
        "format": FORMAT, "version": DYNAMIC_SCHEMA_VERSION if symbols_of(graph.inputs()) else 1,
        "graph": {"name": graph.name, "io_data_type": graph.io_data_type.name,
                  "intermediate_data_type": graph.intermediate_data_type.name,
                  "compute_data_type": graph.compute_data_type.name, "allow_tf32": graph.allow_tf32},
        "tensors": tensors, "nodes": nodes,
        **_symbols_record(graph),
    }


def _symbols_record(graph) -> dict:
    """{"symbols": {name: [min, max]}} for a graph with dynamic extents, else nothing (a static
    graph's document reads as before)."""
    symbols = symbols_of(graph.inputs())
    return {"symbols": {name: [s.min, s.max] for name, s in sorted(symbols.items())}} if symbols else {}


# op -> how many inputs a record of it always holds: an absent optional input past that count
# (added later: the ragged offsets of sdpa and sdpa_backward) is left out, so a reader from
# before it loads the document. (sdpa's count is the one after the sink and tensor scale inputs
# were added; readers older than those cannot load an sdpa record written now, whose attributes
# and outputs they do not know.)
INPUTS_AT_SCHEMA = {"pooling_backward": 2, "sdpa": 12, "sdpa_backward": 15,
                    # the norms' epsilon (and batchnorm's momentum) tensors came later
                    "layernorm": 3, "rmsnorm": 3, "instancenorm": 3, "groupnorm": 3, "batchnorm": 5}


def _written_inputs(node) -> list:
    inputs = list(node.inputs)
    first_added = INPUTS_AT_SCHEMA.get(node.op, len(inputs))
    while len(inputs) > first_added and inputs[-1] is None:
        inputs.pop()
    return inputs


def _written_fields(attrs) -> tuple:
    """The attribute fields a document holds: every field, except one an attrs class lists in
    `written_when_set` while it has its default (an attribute added later: a document that does
    not use it reads in a dnngraph from before it)."""
    optional = getattr(type(attrs), "written_when_set", ())
    defaults = {f.name: f.default for f in dataclasses.fields(attrs)}
    return tuple(name for name in _field_names(type(attrs))
                 if name not in optional or getattr(attrs, name) != defaults[name])


@functools.lru_cache(maxsize=None)
def _field_names(attrs_type) -> tuple:
    return tuple(f.name for f in dataclasses.fields(attrs_type))


def graph_to_json(graph) -> str:
    """Serialize tensors (with explicit settings) and nodes in creation order."""
    return json.dumps(graph_document(graph), indent=1)


def _require(condition, message):
    if not condition:
        raise SerializationError(message)


def _field(record, key, kind, where):
    _require(isinstance(record, dict), f"{where} must be an object")
    _require(key in record, f"{where} lacks {key!r}")
    value = record[key]
    _require(isinstance(value, kind) and not (kind is int and isinstance(value, bool)),
             f"{where}.{key} has the wrong type ({type(value).__name__})")
    return value


def _check_header(document):
    _require(isinstance(document, dict), "the document must be a JSON object")
    _require(document.get("format") == FORMAT, "not a dnngraph document (format field)")
    version = document.get("version")
    _require(isinstance(version, int) and not isinstance(version, bool), "version must be an integer")
    _require(version <= SCHEMA_VERSION,
             f"document version {version} is newer than this dnngraph reads ({SCHEMA_VERSION})")
    _require(version >= 1, f"unknown document version {version}")


def _node_order(nodes, producer_of):
    """Node indices in dependency order; a cycle or dangling reference is an error."""
    dag = Dag(range(len(nodes)))
    for index, record in enumerate(nodes):
        for uid in record["inputs"]:
            if uid in producer_of:
                dag.add_edge(producer_of[uid], index)
    try:
        return dag.lexicographical_topological_sort()
    except CycleError:
        raise SerializationError("the nodes form a cycle") from None


def _attrs(record, opdef, where):
    raw = _field(record, "attrs", dict, where)
    known = {f.name for f in dataclasses.fields(opdef.attrs_type)}
    unknown = set(raw) - known
    _require(not unknown, f"{where}: unknown attribute(s) {sorted(unknown)} for op {opdef.name!r}")
    try:
        return opdef.attrs_type(**{k: _from_jsonable(v) for k, v in raw.items()})
    except (GraphError, TypeError, ValueError) as error:
        raise SerializationError(f"{where}: bad attributes for {opdef.name!r}: {error}") from None


def graph_from_json(text: str, graph_type):
    """Rebuild a graph of `graph_type` (Graph.from_json hands its class down: this module sits
    below the Graph it fills); every problem is a SerializationError naming what is wrong."""
    try:
        return _load(text, graph_type)
    except RecursionError:  # nesting deeper than the parser (or a tuple conversion) can follow
        raise SerializationError("the document nests too deeply") from None


def specialised(graph, sizes: dict, graph_type):
    """A static copy of dynamic `graph` with every symbol at `sizes[name]` (the same uids' order,
    names and settings; dynamic tensors densely packed in their own axis order), replayed through
    every shape rule. Errors of the rules at these sizes are raised as they are (GraphError)."""
    return _fill(graph_document(graph), graph_type, sizes)


def _load(text, graph_type):
    try:
        document = json.loads(text)
    except (TypeError, ValueError) as error:
        raise SerializationError(f"not valid JSON: {error}") from None
    try:
        return _fill(document, graph_type, None)
    except SerializationError:
        raise
    except GraphError as error:
        raise SerializationError(f"inconsistent document: {error}") from None


def _input_dims(record, where, symbols: dict, sizes, version: int):
    """(dims, strides) to declare input `record` with: a dynamic axis as its Dynamic, or with
    `sizes`, at its size (strides packed again in the record's axis order)."""
    dims = _field(record, "dim", list, where)
    strides = _field(record, "stride", list, where)
    marks = record.get("dynamic")
    if marks is None:
        return dims, strides
    _require(version >= DYNAMIC_SCHEMA_VERSION,
             f"{where}.dynamic: dynamic extents need document version {DYNAMIC_SCHEMA_VERSION}, got {version}")
    _require(isinstance(marks, list) and len(marks) == len(dims)
             and all(m is None or (isinstance(m, str) and m in symbols) for m in marks),
             f"{where}.dynamic must name a symbol of the document (or null) per axis, got {marks!r}")
    axes = tuple(None if m is None else symbols[m] for m in marks)
    for axis, (size, symbol) in enumerate(zip(dims, axes)):  # the writer records an axis at its max
        if symbol is not None:
            _require(size == symbol.max, f"{where}.dim[{axis}] is {size}, but {symbol!r} is recorded at its max")
    if sizes is not None:
        return list(resized(dims, strides, axes, sizes)[0]), list(resized(dims, strides, axes, sizes)[1])
    return [d if a is None else a for d, a in zip(dims, axes)], strides


def _symbols(document) -> dict:
    raw = document.get("symbols", {})
    _require(isinstance(raw, dict), "symbols must be an object of name -> [min, max]")
    _require(not raw or document["version"] >= DYNAMIC_SCHEMA_VERSION,
             f"symbols need document version {DYNAMIC_SCHEMA_VERSION}, got {document['version']}")
    symbols = {}
    for name, bounds in raw.items():
        _require(isinstance(bounds, list) and len(bounds) == 2 and all(type(b) is int for b in bounds),
                 f"symbols.{name} must be [min, max], got {bounds!r}")
        try:
            symbols[name] = Dynamic(name, *bounds)
        except GraphError as error:
            raise SerializationError(f"symbols.{name}: {error}") from None
    return symbols


def _fill(document, graph_type, sizes):
    """The graph `document` describes, in a new graph of `graph_type`; with `sizes` (symbol name
    -> size) the static graph at those sizes."""
    _check_header(document)
    graph = _graph_from_header(_field(document, "graph", dict, "document"), graph_type)
    symbols = _symbols(document)
    tensors = _field(document, "tensors", list, "document")
    nodes = _field(document, "nodes", list, "document")
    records = {}
    for i, record in enumerate(tensors):
        uid = _field(record, "uid", int, f"tensors[{i}]")
        _require(uid not in records, f"tensors[{i}]: duplicate uid {uid}")
        records[uid] = record
    producer_of = {}
    for index, record in enumerate(nodes):
        where = f"nodes[{index}]"
        for key in ("inputs", "outputs"):
            for uid in _field(record, key, list, where):
                _require(uid is None or (type(uid) is int and uid in records),
                         f"{where}.{key} refers to unknown tensor {uid!r}")
        for uid in record["outputs"]:
            if uid is not None:
                _require(uid not in producer_of, f"{where}: tensor {uid} has two producers")
                producer_of[uid] = index
    handles, blended = {}, []
    # inputs are declared in creation (uid) order among the nodes, so that every tensor gets its
    # uid again (a plan's groups are fingerprinted by uid: shipping.py); an input a node reads
    # comes before it whatever its uid (a hand-written document)
    pending = sorted(uid for uid in records if uid not in producer_of)
    for index in _node_order(nodes, producer_of):
        made = [uid for uid in nodes[index]["outputs"] if uid is not None]
        read = {uid for uid in nodes[index]["inputs"] if uid is not None}
        earlier = [uid for uid in pending if (made and uid < min(made)) or uid in read]
        _declare_inputs(graph, earlier, records, handles, symbols, sizes, document["version"])
        pending = [uid for uid in pending if uid not in earlier]
        _replay(graph, nodes[index], f"nodes[{index}]", handles, records, sizes is not None, blended)
    _declare_inputs(graph, pending, records, handles, symbols, sizes, document["version"])
    for tensor, saved, saved_where in blended:  # factors may be inputs declared after their output
        _set_blend(tensor, saved, saved_where, handles)
    return graph


def _declare_inputs(graph, uids, records, handles, symbols, sizes, version) -> None:
    for uid in uids:
        record, where = records[uid], f"tensor {uid}"
        _require(_is_output(record, where) is False, f"{where}: a graph input cannot be an output")
        dims, strides = _input_dims(record, where, symbols, sizes, version)
        handles[uid] = graph.tensor(name=_field(record, "name", str, where), dim=dims, stride=strides,
                                    data_type=_data_type(record, where))
        by_value = record.get("is_pass_by_value", False)
        _require(isinstance(by_value, bool), f"{where}.is_pass_by_value must be true or false")
        handles[uid].set_is_pass_by_value(by_value)


def _graph_from_header(header, graph_type):
    allow_tf32 = header.get("allow_tf32", False)
    _require(isinstance(allow_tf32, bool), f"graph.allow_tf32 must be true or false, got {allow_tf32!r}")
    try:
        return graph_type(name=_field(header, "name", str, "graph"),
                          io_data_type=dtypes.by_name(_field(header, "io_data_type", str, "graph")),
                          intermediate_data_type=dtypes.by_name(_field(header, "intermediate_data_type",
                                                                       str, "graph")),
                          compute_data_type=dtypes.by_name(_field(header, "compute_data_type", str, "graph")),
                          allow_tf32=allow_tf32)
    except GraphError as error:
        raise SerializationError(f"graph header: {error}") from None


def _is_output(record, where) -> bool:
    value = record.get("is_output", False)
    _require(isinstance(value, bool), f"{where}.is_output must be true or false, got {value!r}")
    return value


def _data_type(record, where):
    """The explicit data type name of a tensor record, or None."""
    value = record.get("data_type")
    _require(value is None or isinstance(value, str), f"{where}.data_type must be a type name or null, "
                                                      f"got {value!r}")
    return value


def _absent_optional_inputs(opdef, listed: int) -> list:
    """None for each trailing optional input a record leaves out: a document written before the
    op gained that input (pooling_backward's indices) still reads the same."""
    missing = opdef.input_names[listed:]
    if opdef.variadic or not missing or not all(name in opdef.optional for name in missing):
        return []
    return [None] * len(missing)


def _is_factor_tensor(factor, handles) -> bool:
    return (isinstance(factor, dict) and list(factor) == ["tensor"] and type(factor["tensor"]) is int
            and factor["tensor"] in handles)


def _set_blend(tensor, saved, saved_where, handles) -> None:
    blend = _field(saved, "blend", list, saved_where)
    _require(len(blend) == 2 and all(type(f) in (int, float) or _is_factor_tensor(f, handles) for f in blend),
             f"{saved_where}: blend must be [alpha, beta], each a number or {{\"tensor\": uid}} of an "
             f"input, got {blend!r}")
    tensor.set_blend(*(handles[f["tensor"]] if isinstance(f, dict) else f for f in blend))


def _replay(graph, record, where, handles, records, resizing: bool = False, blended=None):
    """Add node `record` to `graph`; its outputs' blends (whose factors may not exist yet) are
    appended to `blended` as (tensor, record, where) for the caller to set (_set_blend)."""
    opdef = REGISTRY.get(_field(record, "op", str, where))
    _require(opdef is not None, f"{where}: unknown op {record['op']!r}")
    attrs = _attrs(record, opdef, where)
    inputs = []
    for uid in record["inputs"]:
        _require(uid is None or uid in handles, f"{where}: input {uid} is not produced before use")
        inputs.append(None if uid is None else handles[uid])
    inputs += _absent_optional_inputs(opdef, len(inputs))
    outputs = graph._add_op(opdef.name, inputs, attrs, _field(record, "name", str, where))
    listed = list(record["outputs"])
    if len(listed) < len(outputs) and all(t is None for t in outputs[len(listed):]):
        # a document written before the op gained optional outputs (sdpa's score_max and
        # score_sum_exp, sdpa_backward's dsink) lists fewer: the absent ones read as absent
        listed += [None] * (len(outputs) - len(listed))
    _require(len(listed) == len(outputs), f"{where}: {len(record['outputs'])} outputs listed, "
                                          f"op {opdef.name!r} has {len(outputs)}")
    for uid, tensor in zip(listed, outputs):
        _require((uid is None) == (tensor is None), f"{where}: output presence does not match the op")
        if tensor is None:
            continue
        saved, saved_where = records[uid], f"tensor {uid}"
        tensor.set_name(_field(saved, "name", str, saved_where))
        dims = _field(saved, "dim", list, saved_where)
        _require(all(type(d) is int for d in dims) and (resizing or dims == list(tensor.dim)),
                 f"{saved_where}: dims {dims} disagree with the op's {list(tensor.dim)}")
        stride = _field(saved, "stride", list, saved_where)
        if resizing:  # the same axis order, packed at the new dims
            stride = dense_strides(tensor.dim, stride_order(dims, stride))
        tensor.set_stride(stride)
        if _data_type(saved, saved_where) is not None:
            tensor.set_data_type(saved["data_type"])
        if _is_output(saved, saved_where):
            tensor.set_output(True)
        if "blend" in saved:
            blended.append((tensor, saved, saved_where))
        handles[uid] = tensor
