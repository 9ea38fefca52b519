"""Built plans that ship: `Graph.serialize()` writes a built plan as bytes, and
`Graph.deserialize(blob)` makes a built graph of them in another process without lowering or
compiling anything (the cuDNN frontend's `serialize` / `deserialize`).

A blob holds the graph (its JSON document), the build options, the target the launches were
planned for, the kernel groups (checked against the partition of the loaded graph: fusion is
replayed, never lowering), and per launch its generated source, config, grid, arguments,
scratch, workspace place and, for a GPU target, the compiled binary (runtime/kernel_binary.py).
A plan planned for a GPU model on a machine without it (BuildOptions(target=H100)) compiles its
binaries at serialize time for that model's architecture: ahead of time.

A blob is refused (SerializationError) when it was written by another dnngraph (its source
differs: `dnngraph_identity`) or another Triton, and when the machine that loads it plans for
another target than the blob's (another GPU model; a CPU machine plans for the interpreter
unless the blob names a target); `rebuild=True` builds afresh instead. Loading runs the
kernels the blob carries: load blobs you trust, as you would a pickle. Each kernel's text
must still hash to its name (kernels are named by content), which catches a damaged blob.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import zlib

import torch
import triton

from .backends import registry
from .backends.triton.codegen.pointwise import KernelArgument
from .backends.triton.heuristics.depthwise import DepthwiseConfig
from .backends.triton.heuristics.matmul import MatmulConfig
from .backends.triton.heuristics.moe import MoeConfig
from .backends.triton.heuristics.rows import RowConfig
from .backends.triton.heuristics.sdpa import AttentionConfig
from .backends.triton.lower import ctc as ctc_lowering
from .backends.triton.lower import moe as moe_lowering
from .build import _build_device, build_dynamic_plan, build_launches
from .errors import ExecutionError, GraphError, SerializationError, UnsupportedError
from .fusion import partition
from .options import BuildOptions
from .problems import problem_of
from .runtime.kernel_binary import KernelBinary, compile_for, compile_request, of_compiled, plain_of, plain_value
from .runtime.kernel_files import kernel_source, load_kernel, rendered_source, stem_of
from .runtime.launch import KernelLaunch, Scratch
from .runtime.plan import Plan, target_for
from .runtime.workspace import WorkspaceBudget
from .symbolic import symbols_of
from .target import ModelFacts, Target, target_of
from .versions import __version__

MAGIC = b"dnngraph-plan\n"
BLOB_VERSION = 1
# a blob of a graph with dynamic extents (serialize_dynamic): its graph and one plan per size it
# holds; a static graph's blob stays version 1, as before
DYNAMIC_BLOB_VERSION = 2
# The dataclasses an options record may hold, by name (nothing else is ever made from a blob).
OPTION_TYPES = {cls.__name__: cls for cls in (Target, ModelFacts, MatmulConfig, DepthwiseConfig, MoeConfig,
                                               RowConfig, AttentionConfig)}


@functools.lru_cache(maxsize=None)
def dnngraph_identity() -> str:
    """A digest of dnngraph's own source files: a blob is read only by the dnngraph that wrote
    it (generated kernels call its jitted device libraries, whose code the blob does not hold)."""
    package = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# --- options and targets ----------------------------------------------------------------------

def _encoded(value):
    """An option's value as JSON data: plain values, tuples, and the dataclasses of OPTION_TYPES."""
    if dataclasses.is_dataclass(value) and type(value).__name__ in OPTION_TYPES:
        return {"type": type(value).__name__,
                "fields": {f.name: _encoded(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return plain_value(value)


def _decoded(value):
    if isinstance(value, dict) and set(value) == {"type", "fields"}:
        kind = OPTION_TYPES.get(value["type"])
        if kind is None or not isinstance(value["fields"], dict):
            raise SerializationError(f"unknown option type {value['type']!r}")
        return kind(**{name: _decoded(v) for name, v in value["fields"].items()})
    return plain_of(value)


def options_record(options: BuildOptions) -> dict:
    return {f.name: _encoded(getattr(options, f.name)) for f in dataclasses.fields(options)}


def options_of(record: dict) -> BuildOptions:
    known = {f.name for f in dataclasses.fields(BuildOptions)}
    try:
        return BuildOptions(**{name: _decoded(value) for name, value in record.items() if name in known})
    except (TypeError, ValueError, GraphError) as error:
        raise SerializationError(f"unreadable build options: {error}") from None


# --- groups and launches ------------------------------------------------------------------------

def group_fingerprints(groups) -> list:
    """What identifies each kernel group: kind, ops, and the tensors it reads and writes."""
    return [[group.kind, [node.name for node in group.nodes], [t.uid for t in group.inputs],
             [t.uid for t in group.outputs]] for group in groups]


def _moe_checks(graph, group) -> tuple:
    return moe_lowering._offset_checks(group.anchor, problem_of(graph, group).geometry.rows)


def _ctc_checks(graph, group) -> tuple:
    return ctc_lowering._host_checks(group.anchor, problem_of(graph, group).geometry)


# Group kinds whose launches check bound input values on the host before any kernel runs: the
# maker of those checks from a loaded graph's group, the one the family's lowering calls (the
# checks are functions, so a blob records only which launches have them; loading poses the
# group's problem again, which reads the graph, and lowers nothing).
HOST_CHECKS = {"moe": _moe_checks, "ctc": _ctc_checks}


def _launch_record(launch, groups: dict, binary) -> dict:
    if launch.host_checks and launch.group.kind not in HOST_CHECKS:
        raise UnsupportedError(f"kernel {launch.source_path.stem}: its launch checks input values on the host, "
                               f"which a shipped plan of a {launch.group.kind} group cannot remake")
    for argument in launch.arguments:
        if not isinstance(argument, KernelArgument):
            raise UnsupportedError(f"kernel {launch.source_path.stem}: argument {argument!r} cannot be shipped")
    return {"group": groups[id(launch.group)], "name": launch.source_path.stem, "text": kernel_source(launch.kernel),
            "arguments": [[a.kind, a.name, plain_value(a.value)] for a in launch.arguments],
            "grid": list(launch.grid), "num_warps": launch.num_warps, "num_stages": launch.num_stages,
            "fp_fusion": launch.fp_fusion, "config_text": launch.config_text, "reason": launch.reason,
            "host_checks": bool(launch.host_checks),
            "backend": launch.backend, "backend_reason": launch.backend_reason,
            "backend_refusals": launch.backend_refusals,
            "scratch": [[s.uid, list(s.dim), str(s.torch_dtype).split(".")[-1]] for s in launch.scratch],
            "alternative": None if launch.alternative is None else _launch_record(launch.alternative, groups, None),
            "binary": None if binary is None else binary.to_record()}


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"unknown torch dtype {name!r}")
    return dtype


def _launch_of(record: dict, groups, graph) -> KernelLaunch:
    """The launch a record describes, its kernel loaded from the stored text (never lowered),
    its host checks (if any) remade for the loaded `graph`."""
    source = rendered_source(record["text"], record["name"])
    if source is None:
        raise SerializationError(f"kernel {record['name']!r}: its text does not hash to its name (a damaged blob)")
    kernel, path = load_kernel(source, stem_of(record["name"]))
    arguments = tuple(KernelArgument(kind, name, plain_of(value)) for kind, name, value in record["arguments"])
    alternative = None if record["alternative"] is None else _launch_of(record["alternative"], groups, graph)
    group = groups[record["group"]]
    checks = ()
    if record["host_checks"]:
        if group.kind not in HOST_CHECKS:
            raise SerializationError(f"kernel {record['name']!r}: host checks for a {group.kind} group are unknown here")
        checks = HOST_CHECKS[group.kind](graph, group)
    launch = KernelLaunch(group, kernel, path, arguments, tuple(record["grid"]), record["num_warps"],
                          record["config_text"], record["reason"],
                          scratch=[Scratch(uid, tuple(dim), _torch_dtype(dtype)) for uid, dim, dtype in record["scratch"]],
                          num_stages=record["num_stages"], alternative=alternative, fp_fusion=record["fp_fusion"],
                          host_checks=checks)
    launch.backend, launch.backend_reason = record["backend"], record["backend_reason"]
    launch.backend_refusals = record["backend_refusals"]
    if record["binary"] is not None:
        launch.binary = KernelBinary.from_record(record["binary"])
    return launch


def _binaries(plan) -> list:
    """The compiled binary of each launch for a GPU target (None each for the interpreter): the
    ones a loaded plan carries or binding on the GPU made, else compiled here for the target's
    architecture."""
    target = plan.target
    if target.capability is None:
        return [None] * len(plan.launches)
    arch = target.capability[0] * 10 + target.capability[1]
    kept = [launch.binary if launch.binary is not None else
            of_compiled(launch.compiled) if launch.compiled is not None else None for launch in plan.launches]
    if all(binary is not None and binary.arch == arch for binary in kept):
        return kept
    return compile_for([compile_request(launch, plan.dtypes) for launch in plan.launches], target.capability)


# --- the blob -----------------------------------------------------------------------------------

def _plan_record(plan) -> dict:
    """What a blob holds of one built plan besides its graph: options, target, kernel groups,
    launches and workspace layout."""
    groups = {id(group): index for index, group in enumerate(plan.groups)}
    binaries = _binaries(plan)
    return {
        "options": options_record(plan.options), "target": _encoded(plan.target),
        "groups": group_fingerprints(plan.groups),
        "launches": [_launch_record(launch, groups, binary) for launch, binary in zip(plan.launches, binaries)],
        "workspace": {"bytes": plan.workspace_bytes,
                      "tensors": [[uid, list(dim), None if stride is None else list(stride), str(dtype), nbytes, offset]
                                  for uid, dim, stride, dtype, nbytes, offset in plan.workspace_tensors]},
    }


def _header(version: int) -> dict:
    return {"version": version, "dnngraph": dnngraph_identity(), "triton": triton.__version__}


def _packed(document: dict) -> bytes:
    payload = json.dumps(document, sort_keys=True).encode()
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + zlib.compress(payload)


def serialize_plan(plan) -> bytes:
    """The blob of a built plan (see the module's docstring)."""
    return _packed({**_header(BLOB_VERSION), "graph": plan._graph.to_json(), **_plan_record(plan)})


def serialize_dynamic(graph, plan) -> bytes:
    """The blob of a built graph with dynamic extents (`plan`: its DynamicPlan): the graph with its
    symbols, the options it was built with, and each plan it holds, by its sizes. The plans at
    every symbol's min and max are always in it (made again here if dropped since): they bound
    the workspace of every size, so a loaded blob never builds to size its workspace."""
    names = [symbol.name for symbol in plan.extents.symbols]
    for end in ("min", "max"):
        plan.plan_for(tuple(getattr(s, end) for s in plan.extents.symbols), executing=False)
    sized = [{"sizes": dict(zip(names, key)), **_plan_record(held)} for key, held in sorted(plan.held())]
    return _packed({**_header(DYNAMIC_BLOB_VERSION), "graph": graph.to_json(),
                    "options": options_record(plan.options), "plans": sized})


def _document(blob) -> dict:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise SerializationError(f"a plan blob is bytes (Graph.serialize() gives them), got {type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise SerializationError("not a dnngraph plan blob")
    digest, _, packed = blob[len(MAGIC):].partition(b"\n")
    try:
        payload = zlib.decompress(packed)
    except zlib.error as error:
        raise SerializationError(f"damaged plan blob: {error}") from None
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise SerializationError("damaged plan blob: its digest does not match")
    try:
        document = json.loads(payload)
    except ValueError as error:
        raise SerializationError(f"damaged plan blob: {error}") from None
    if not isinstance(document, dict) or not {"version", "triton", "dnngraph"} <= set(document):
        raise SerializationError("not a dnngraph plan blob (its header is missing)")
    if document.get("version") not in (BLOB_VERSION, DYNAMIC_BLOB_VERSION):
        raise SerializationError(f"plan blob version {document.get('version')!r}; this dnngraph reads "
                                 f"{BLOB_VERSION} and {DYNAMIC_BLOB_VERSION}")
    if document["triton"] != triton.__version__:
        raise SerializationError(f"plan blob written with triton {document['triton']}; triton {triton.__version__} "
                                 f"is installed (deserialize(..., rebuild=True) builds afresh)")
    if document["dnngraph"] != dnngraph_identity():
        raise SerializationError("plan blob written by another dnngraph (its sources differ from this one's); "
                                 "deserialize(..., rebuild=True) builds afresh")
    return document


def _refused_target(stored: Target, device) -> str:
    """Why this machine cannot run a blob planned for `stored` ("" when it can)."""
    if device.type == "cuda":
        here = target_of(device)
        if stored.interpreted or here != stored:
            return f"the blob's plan is for {stored.name}; {device} is a {here.name}"
    return ""


def _refuse_rebuild(graph, groups, device, options, budget):
    raise ExecutionError(f"graph {graph.name!r} runs a plan loaded from a blob for one target; {device} is another "
                         f"({target_for(device, options).name}): deserialize(..., rebuild=True) or build for it")


def deserialize_plan(blob, graph_type, rebuild: bool = False):
    """A built graph of `graph_type` from a blob of serialize_plan: its plan loaded, nothing
    lowered or compiled. With `rebuild`, a blob this machine cannot run (another dnngraph,
    Triton or target) gives a graph built afresh from the blob's graph and options instead.
    Every defect of a blob is a SerializationError."""
    try:
        document = _document(blob)
    except SerializationError:
        if not rebuild:
            raise
        return _rebuilt(blob, graph_type)
    try:
        return _loaded(document, graph_type, rebuild)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise SerializationError(f"malformed plan blob: {type(error).__name__}: {error}") from None


def _loaded(document: dict, graph_type, rebuild: bool):
    """deserialize_plan of a blob whose header was checked."""
    if document["version"] == DYNAMIC_BLOB_VERSION:
        return _loaded_dynamic(document, graph_type, rebuild)
    graph = graph_type.from_json(document["graph"])
    device = _build_device()
    why = _target_refusal(document, device)
    if why:
        if rebuild:
            return graph.build(options=options_of(document["options"]))
        raise SerializationError(f"{why} (deserialize(..., rebuild=True) builds afresh)")
    graph._plan = _plan_of(document, graph, device, rebuild)
    # as build() finds them: execute stages these inputs' host values (pass-by-value alpha, say)
    graph._pass_by_value = tuple(t for t in graph.inputs() if t.is_pass_by_value)
    return graph


def _refused_interpreter(record: dict, device) -> str:
    """Why `device`'s kernels (CPU tensors: Triton's interpreter) cannot run the launches of the
    plan `record` holds ("" when they can): a plan built on a GPU for a named target may hold
    kernels of a backend the interpreter cannot run (gluon), however equal the targets."""
    if device.type == "cuda":
        return ""
    backends = {launch["backend"] for launch in record["launches"]}
    compiled_only = sorted(name for name in backends if not getattr(registry.BACKENDS.get(name), "interpretable", True))
    if not compiled_only:
        return ""
    return (f"the blob's plan runs {', '.join(compiled_only)} kernels, which cannot run in Triton's interpreter "
            f"(CPU tensors)")


def _target_refusal(record: dict, device) -> str:
    """Why this machine cannot run the plan `record` holds ("" when it can)."""
    options, stored = options_of(record["options"]), _decoded(record["target"])
    return _refused_target(stored, device) or _refused_interpreter(record, device) or (
        "" if target_for(device, options) == stored else
        f"the blob's plan is for {stored.name}; this machine plans for {target_for(device, options).name}")


def _plan_of(record: dict, graph, device, rebuild: bool):
    """The plan `record` holds (see _plan_record) for `graph`, whose partition must give the
    record's groups: its kernels loaded from their text, nothing lowered or compiled."""
    options = options_of(record["options"])
    snapshot = graph._snapshot()
    groups = partition(snapshot, registry.families(options.backends))
    if group_fingerprints(groups) != record["groups"]:
        raise SerializationError("the blob's kernel groups differ from this dnngraph's partition of its graph")
    launches = [_launch_of(launch, groups, snapshot) for launch in record["launches"]]
    plan = Plan(snapshot, groups, launches, device, options, build_launches if rebuild else _refuse_rebuild,
                WorkspaceBudget(options.workspace_limit))
    _check_workspace(plan, record["workspace"], device)
    plan.origin = "loaded from a serialized plan: nothing lowered or compiled" + (
        "; binaries as shipped" if any(launch.binary is not None for launch in launches) else "")
    shared = plan.for_graph(graph)
    shared.views.lend_strides(graph)
    return shared


def _loaded_dynamic(document: dict, graph_type, rebuild: bool):
    """deserialize_plan of a blob of serialize_dynamic: the graph with dynamic extents, its plan
    holding the blob's plan per size (loaded, nothing lowered or compiled); a size the blob does
    not hold is built on first use, as in any dynamic graph."""
    graph = graph_type.from_json(document["graph"])
    if not graph.is_dynamic:
        raise SerializationError("a blob of dynamic plans whose graph has no dynamic extents")
    options = options_of(document["options"])
    records = document["plans"]
    if not isinstance(records, list) or not records:
        raise SerializationError("a blob of dynamic plans holds a list of plans, one per size")
    device = _build_device()
    why = next((reason for reason in (_target_refusal(record, device) for record in records) if reason), "")
    if why:
        if rebuild:
            return graph.build(options=options)
        raise SerializationError(f"{why} (deserialize(..., rebuild=True) builds afresh)")
    try:
        graph.validate()
    except GraphError as error:
        raise SerializationError(f"a blob of dynamic plans of a graph that does not build: {error}") from None
    snapshot = graph._snapshot()
    held = {}
    for record in records:
        sized = _sized_graph(snapshot, record["sizes"])
        key = tuple(record["sizes"][name] for name in sorted(record["sizes"]))
        if key in held:
            raise SerializationError(f"a blob of dynamic plans holds two plans at sizes {record['sizes']}")
        held[key] = _plan_of(record, sized, device, rebuild)
    _check_ends_held(graph, held)
    graph._plan = build_dynamic_plan(graph, options, held=held)
    graph._pass_by_value = tuple(t for t in graph.inputs() if t.is_pass_by_value)
    return graph


def _check_ends_held(graph, held: dict) -> None:
    """A blob holds the plans at every symbol's min and max (serialize_dynamic writes them): a
    dynamic plan builds those at once, so a blob without them would build while loading."""
    symbols = [symbol for _, symbol in sorted(symbols_of(graph.inputs()).items())]
    for end in ("min", "max"):
        key = tuple(getattr(symbol, end) for symbol in symbols)
        if key not in held:
            raise SerializationError(f"a blob of dynamic plans without the plan at the range's {end} "
                                     f"({dict(zip((s.name for s in symbols), key))})")


def _sized_graph(snapshot, sizes):
    """`snapshot` (a dynamic graph) at the sizes a blob's plan was built at, as the build made it."""
    if not isinstance(sizes, dict):
        raise SerializationError(f"a plan's sizes are an object of symbol name -> size, got {sizes!r}")
    try:
        sized = snapshot.specialised(sizes)
        sized.validate()
    except GraphError as error:
        raise SerializationError(f"a plan at sizes {sizes} the graph does not run: {error}") from None
    return sized


def _check_workspace(plan, stored: dict, device) -> None:
    """The loaded plan lays its workspace out as the blob says (on the interpreter, where no
    compiled kernel adds global scratch)."""
    if device.type == "cuda":
        return
    if plan.workspace_bytes != stored["bytes"]:
        raise SerializationError(f"the loaded plan needs {plan.workspace_bytes} bytes of workspace; the blob's "
                                 f"{stored['bytes']}")


def _rebuilt(blob, graph_type):
    """A graph built afresh from a blob's graph and options (any dnngraph or Triton wrote it)."""
    blob = bytes(blob)
    _, _, packed = blob[len(MAGIC):].partition(b"\n")
    try:
        document = json.loads(zlib.decompress(packed))
        graph, options = graph_type.from_json(document["graph"]), options_of(document["options"])
    except (zlib.error, ValueError, KeyError, TypeError, GraphError) as error:
        raise SerializationError(f"unreadable plan blob: {error}") from None
    return graph.build(options=options)
