"""The build: partition the graph into groups, describe each as a backend-neutral problem
(problems/), rank the (backend, candidate) pairs of the backends that support it
(backends/registry.py: by the model's estimates, else the options' preference order), let the
first ranked backend lower the group to launches (autotuning: the fastest of the top ranked
backends, timed together on the device), and the plan (runtime/plan.py) runs them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from .backends import registry
from .bitpack import refuse_elsewhere as refuse_bit_packed_elsewhere
from .backends.contract import BuildContext
from .errors import UnsupportedError, ValidationError
from .fusion import partition
from .fusion.views import LAYOUT_OPS
from .log import logger
from .ops.block_scale import refuse_elsewhere as refuse_block_scale_types
from .options import BuildOptions
from .problems import problem_of
from .runtime.autotune import Tuner
from .runtime.dynamic_plan import PLANS_KEPT, DynamicPlan
from .runtime.interpreter import interpreting
from .runtime.launch import check_grid, sample_tensors, time_candidate
from .runtime.plan import Plan, target_for
from .runtime.plan_cache import PLANS, plan_key
from .runtime.workspace import WorkspaceBudget
from .symbolic import bucket_of, check_dense, check_sizes, symbols_of
from .tensor import Tensor, blend_factor_problem
from .target import target_of

def _check_outputs_dense(graph):
    for tensor in graph.outputs():
        for size, stride in zip(tensor.dim, tensor.stride):
            if size > 1 and stride == 0:
                raise ValidationError(f"output {tensor.name!r} has stride 0 on an axis of size {size}: "
                                      f"its elements would overlap")


def _check_blends(graph):
    """A blended tensor (Tensor.set_blend) is a graph output of a floating type that no node
    reads: a consumer would see either the result or the blended value, and the store writes the
    latter."""
    for tensor in graph.tensors:
        if tensor.blend is None:
            continue
        what = f"tensor {tensor.name!r} is blended (set_blend)"
        for role, factor in zip(("alpha", "beta"), tensor.blend):
            problem = blend_factor_problem(factor) if isinstance(factor, Tensor) else None
            if problem is not None:
                raise ValidationError(f"{what} with {role} {factor.name!r}: {problem}")
        if not tensor.is_output:
            raise ValidationError(f"{what} but is no graph output: only outputs are stored blended")
        if not tensor.data_type.is_floating:
            raise ValidationError(f"{what}: blending needs a floating type, not {tensor.data_type.name}")
        if tensor.producer.op in LAYOUT_OPS:  # a view or a copy of other memory, whose kernels do not blend
            raise UnsupportedError(f"{what}, and made by {tensor.producer.op} node {tensor.producer.name!r}: "
                                   f"a layout op's output is not stored blended; blend the op before it")
        readers = graph.consumers(tensor)
        if readers:
            raise ValidationError(f"{what} and read by node {readers[0].name!r} ({readers[0].op}): a blended "
                                  f"output may not feed other ops")


def build_plan(graph, options: Optional[BuildOptions] = None) -> "Plan":
    """The plan of a validated graph under `options` (None: the defaults): the cached one when
    an identical graph was built before with equal options for the same target (see runtime/plan_cache.py),
    else partition, schedule (or autotune) and generate every kernel. The graph's virtual
    tensors take the view strides the plan gives them."""
    options = BuildOptions() if options is None else options
    _check_outputs_dense(graph)
    _check_blends(graph)
    start = time.perf_counter()
    device = _build_device()
    key = plan_key(graph, options, device, target_for(device, options),
                   registry.signature(options.backends))
    shared = PLANS.get(key)
    if shared is None:
        shared = _build_new(graph._snapshot(), device, options)
        PLANS.put(key, shared)
    else:
        logger.info("built graph %r from the plan cache in %.2f ms", graph.name, 1e3 * (time.perf_counter() - start))
    plan = shared.for_graph(graph)
    plan.views.lend_strides(graph)
    return plan


def build_dynamic_plan(graph, options: Optional[BuildOptions] = None, held: Optional[dict] = None,
                       sizes: Sequence = ()) -> DynamicPlan:
    """The plan of a validated graph with dynamic extents: a DynamicPlan that builds the graph at
    each set of sizes it meets (Graph.specialised, then build_plan: the plan cache and Triton's
    cache share what sizes have in common). The plans at every symbol's min and at every
    symbol's max are built here, so that a shape rule or a kernel that fails at the ends of the
    range fails the build, not an execute; so is the plan at each of `sizes` (dicts of symbol
    name -> size: ahead of time, for a blob to ship them). The workspace the largest sizes need
    bounds every size's (see _within_largest), so one workspace of workspace_size() serves the
    whole range. `held`: plans made already (loaded from a blob), by their sizes (a tuple in
    symbol name order), taken as they are: none of them is built again."""
    options = BuildOptions() if options is None else options
    held = {} if held is None else held
    for tensor in graph.outputs():
        if tensor.dynamic_dim_symbols:
            check_dense(tensor.dim, tensor.own_stride, f"output {tensor.name!r}")

    snapshot = graph._snapshot()  # later changes to the graph never reach sizes built later

    def build_at(sizes: dict, sized_options: BuildOptions) -> "Plan":
        sized = snapshot.specialised(sizes)
        sized.validate()
        return build_plan(sized, sized_options)  # configs chosen at the top of the bucket (sized.bucket)

    symbols = symbols_of(graph.inputs())
    largest = {symbol.name: symbol.max for symbol in symbols.values()}
    largest_key = tuple(largest[name] for name in sorted(largest))
    at_largest = held[largest_key] if largest_key in held else build_at(largest, options)
    plan = DynamicPlan(graph, lambda sizes: at_largest if sizes == largest else
                       _within_largest(build_at, sizes, options, at_largest, symbols), options)
    for key, made in held.items():
        plan.adopt(key, made)
    wanted = [tuple(getattr(s, end) for s in plan.extents.symbols) for end in ("min", "max")]
    wanted += [_key_of(graph, chosen, plan.extents.symbols) for chosen in sizes]
    if len(set(wanted)) > PLANS_KEPT:
        raise ValidationError(f"graph {graph.name!r}: {len(set(wanted))} sizes to build ahead of time (with the "
                              f"min and max); a dynamic plan keeps {PLANS_KEPT}")
    for key in wanted:
        plan.plan_for(key, executing=False)
    return plan


def _key_of(graph, sizes, symbols) -> tuple:
    """`sizes` (symbol name -> size, checked against `graph`'s symbols) as a DynamicPlan key."""
    check_sizes(graph, sizes)
    return tuple(sizes[symbol.name] for symbol in symbols)


def _within_largest(build_at, sizes: dict, options: BuildOptions, at_largest, symbols: dict) -> "Plan":
    """The plan at `sizes`, its workspace no larger than the plan at the largest sizes needs.
    The values between kernels only grow with the sizes, but the optional scratch of a config
    choice does not (fewer rows can mean more split-K partials): where the plan at the top of
    the bucket of `sizes` (where its configs are chosen) is over the bound, the bucket's sizes are
    built with their scratch cut by the excess (the splits that fit are kept), and, where that
    still does not fit, with none: one limit per bucket, so its sizes keep choosing alike."""
    bound = at_largest.workspace_size()
    top = {name: bucket_of(size, symbols[name]) for name, size in sizes.items()}
    plan = build_at(sizes, _bucket_options(build_at, top, options, bound))
    if plan.workspace_size() > bound:  # never seen: a size needing more than its bucket's top
        plan = build_at(sizes, options.with_arguments(workspace_limit=0))
    return plan


def _bucket_options(build_at, top: dict, options: BuildOptions, bound: int) -> BuildOptions:
    """`options` with the workspace limit under which the plan at the bucket's top `top` needs
    no more than `bound` bytes (options as they are where it fits already)."""
    plan = build_at(top, options)
    excess = plan.workspace_size() - bound
    if excess <= 0:
        return options
    cut = options.with_arguments(workspace_limit=max(plan._budget.spent - excess, 0))
    if build_at(top, cut).workspace_size() <= bound:
        return cut
    return options.with_arguments(workspace_limit=0)


def _build_new(graph, device, options: BuildOptions) -> "Plan":
    """A new plan over `graph` (a snapshot the plan keeps)."""
    start = time.perf_counter()
    groups = partition(graph, registry.families(options.backends))
    refuse_bit_packed_elsewhere(graph, groups)  # bits only the pointwise kernels pack and unpack
    for group in groups:
        refuse_block_scale_types(group)  # fp4 / e8m0 bytes only the block-scale kernels read
        logger.debug("graph %r: group %s", graph.name, group.describe())
    budget = WorkspaceBudget(options.workspace_limit)
    launches = build_launches(graph, groups, device, options, budget)
    plan = Plan(graph, groups, launches, device, options, build_launches, budget)
    logger.info("built graph %r: %d ops in %d kernel(s) for %s in %.1f ms, workspace %d bytes", graph.name,
                len(graph.nodes), len(plan.launches), device, 1e3 * (time.perf_counter() - start),
                plan.workspace_bytes)
    for launch in plan.launches:
        logger.debug("graph %r: %s: %s (%s)", graph.name, launch.kernel.__name__ if hasattr(launch.kernel, "__name__")
                     else launch.source_path.name, launch.config_text, launch.reason)
    return plan


def _build_device() -> torch.device:
    """The device a plan is first built for: the current GPU, else the interpreter (CPU). Only a
    first guess: a plan executed on a device of another model builds launches for that one."""
    if torch.cuda.is_available() and not interpreting():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_launches(graph, groups, device: torch.device, options: BuildOptions, budget=None) -> list:
    """The launches of every group, scheduled for the target of `device` (autotuned on
    `device`) under `options`, drawing optional scratch from `budget` (a WorkspaceBudget) in
    graph order. Each group is lowered by the first backend registry.ranked() ranks for its
    problem; with options.autotune, several supporting backends and a device that times
    (times_on), by the fastest of the top ranked backends (choose_by_timing); with options.plan,
    by the candidate it names (lower_chosen)."""
    target = target_for(device, options)
    # timings are recorded under the device they are taken on, whatever target the model plans for
    tuner = Tuner(target_of(device), top=options.autotune_top) if options.autotune else None
    context = BuildContext(device, target, options, tuner, budget)
    launches = []
    interpreted = device.type == "cpu"
    check_plan_choice(options.plan, groups)
    for position, group in enumerate(groups):
        problem = problem_of(graph, group)
        if options.plan is not None:
            backend, built, why = lower_chosen(graph, group, problem, context, position, interpreted)
        else:
            backend, built, why = lower_ranked(graph, group, problem, context, interpreted)
        # the other backends' reasons, where the build names several (one: nothing to say)
        refused = registry.refusals(problem, target, options, interpreted) if len(options.backends) > 1 else ""
        for launch in built:
            for chosen in (launch, launch.alternative):
                if chosen is not None:
                    chosen.backend = backend.name
                    chosen.backend_reason = why
                    chosen.backend_refusals = refused
        launches.extend(built)
    for launch in launches:
        for chosen in (launch, launch.alternative):
            if chosen is not None:
                check_grid(chosen.grid, chosen.source_path, target)
    return launches


def lower_ranked(graph, group, problem, context: BuildContext, interpreted: bool) -> tuple:
    """(backend, launches, reason): `group` lowered by the backend the registry ranks first, or
    with autotuning on a device that times, by the fastest of the top ranked backends."""
    options, target = context.options, context.target
    backends = registry.supporting(problem, target, options, interpreted)
    if len(backends) == 1:  # the default: no ranking, no timing, exactly as one backend lowers
        return backends[0], backends[0].lower(graph, group, problem, context), ""
    pairs = registry.ranked(problem, target, options, interpreted, backends)
    why = registry.ranking_reason(pairs)
    order = list(dict.fromkeys(b for b, _ in pairs))
    top = order if options.autotune_top is None else order[:options.autotune_top]
    if options.autotune and len(top) > 1 and times_on(context.device):
        return choose_by_timing(graph, group, problem, context, top, why)
    return lower_first(graph, group, problem, context, order, why)


@dataclass(frozen=True)
class GroupPlans:
    """The plans a build may be told to take for one kernel group (Graph.plans()): its kind, its
    ops' names and its ranked candidates (backends/contract.py's Candidate: backend name,
    config, model seconds; config None is the backend's own choice), best first."""

    kind: str
    ops: tuple
    candidates: tuple


def plan_choices(graph, options: BuildOptions) -> list:
    """GroupPlans of each kernel group of `graph` (validated) for the target a build under
    `options` plans for, in plan order: candidate k of group i is what BuildOptions(plan=k)
    (or plan=(..., k, ...) at position i) builds."""
    device = _build_device()
    target = target_for(device, options)
    snapshot = graph._snapshot()
    groups = partition(snapshot, registry.families(options.backends))
    return [GroupPlans(group.kind, tuple(node.name for node in group.nodes),
                       tuple(candidate for _, candidate in registry.choices(problem_of(snapshot, group), target,
                                                                           options, device.type == "cpu")))
            for group in groups]


def check_plan_choice(choice, groups) -> None:
    """ValidationError for a per-group plan choice whose length is not the group count."""
    if isinstance(choice, tuple) and len(choice) != len(groups):
        raise ValidationError(f"BuildOptions.plan: {len(choice)} indices for {len(groups)} kernel groups "
                              f"(Graph.plans() lists them)")


def lower_chosen(graph, group, problem, context: BuildContext, position: int, interpreted: bool) -> tuple:
    """(backend, launches, reason): `group` (at `position` in plan order) lowered with the
    candidate BuildOptions.plan names, without autotuning: an int k takes the group's k-th
    choice (its first where it has fewer), a tuple its entry for this group (ValidationError
    when out of range)."""
    choice = context.options.plan
    found = registry.choices(problem, context.target, context.options, interpreted)
    index = choice[position] if isinstance(choice, tuple) else choice
    if index >= len(found):
        if isinstance(choice, tuple):
            raise ValidationError(f"BuildOptions.plan: group {position} ({group.kind}) has {len(found)} candidate(s), "
                                  f"index {index} asked")
        index = 0
    backend, candidate = found[index]
    built = backend.lower(graph, group, problem, replace(context, tuner=None),
                          candidate if candidate.config is not None else None)
    config = getattr(candidate.config, "text", None) or ("its own choice" if candidate.config is None
                                                         else repr(candidate.config))
    return backend, built, f"plan choice {index} of {len(found)}: {backend.name}, {config}"


def lower_first(graph, group, problem, context: BuildContext, order: list, ranking: str) -> tuple:
    """(backend, launches, reason): the group lowered by the first backend of `order` that
    lowers it. A backend may refuse at lowering what supports() let through (what only the
    group shows: no fallback for unaligned calls, a config that does not fit); the next ranked
    takes the group then, and the reason says so. The last refusal is raised when none lowers it."""
    budget = context.budget
    before = budget.spent if budget is not None else 0
    refused = []
    for backend in order:
        try:
            built = backend.lower(graph, group, problem, context)
        except UnsupportedError as error:
            if backend is order[-1]:
                raise
            if budget is not None:
                budget.spent = before
            refused.append(f"{backend.name} refused at lowering: {error}")
            continue
        return backend, built, "; ".join([ranking] + refused if ranking else refused)
    raise AssertionError("unreachable: the last backend raises")


def times_on(device: torch.device) -> bool:
    """Whether the build times backends against each other on `device`: a GPU only (the
    interpreter's wall clock says nothing of a GPU's, so CPU builds keep the first ranked)."""
    return device.type == "cuda"


def time_backends(trials: list, group, device: torch.device) -> list:
    """Milliseconds of each trial's launches (`trials`: (backend, launches) pairs) on one set of
    sample tensors of `group` on `device`, with the timing helpers the tuner's candidates use;
    None for a trial whose launches fail to compile or run."""
    tensors = sample_tensors(group, device)
    times = []
    for backend, launches in trials:
        try:
            times.append(time_candidate(launches, dict(tensors), device))
        except Exception as error:  # a backend whose kernels fail here loses, as a failed candidate
            logger.warning("timing backend %s on group %s failed: %s: %s", backend.name, group.describe(),
                           type(error).__name__, error)
            times.append(None)
    return times


def choose_by_timing(graph, group, problem, context: BuildContext, backends: list, ranking: str) -> tuple:
    """(backend, launches, reason): the group lowered by each of `backends` (ranked order),
    timed together (time_backends) and the fastest kept; each lowering draws from the workspace
    budget as it stood before, and the budget keeps the winner's spending. With no timing at all
    the first ranked is kept, `ranking` its reason."""
    budget = context.budget
    before = budget.spent if budget is not None else 0
    trials, spent, refusal = [], [], None
    for backend in backends:
        if budget is not None:
            budget.spent = before
        try:
            trials.append((backend, backend.lower(graph, group, problem, context)))
        except UnsupportedError as error:  # refused at lowering: not a trial
            logger.info("backend %s refused group %s at lowering: %s", backend.name, group.describe(), error)
            refusal = error
            continue
        spent.append(budget.spent if budget is not None else 0)
    if not trials:
        raise refusal
    times = time_backends(trials, group, context.device)
    timed = sorted((ms, index) for index, ms in enumerate(times) if ms is not None)
    if not timed:
        best, reason = 0, ranking + "; timing failed for every backend" if ranking else "timing failed"
    else:
        best = timed[0][1]
        against = ", ".join(f"{trials[i][0].name} {ms * 1e3:.1f} us" for ms, i in timed[1:])
        failed = [trials[i][0].name for i, ms in enumerate(times) if ms is None]
        reason = (f"backend {trials[best][0].name} chosen over "
                  f"{', '.join(b.name for i, (b, _) in enumerate(trials) if i != best)} by timing: "
                  f"{timed[0][0] * 1e3:.1f} us" + (f" vs {against}" if against else "")
                  + (f" ({', '.join(failed)} failed)" if failed else ""))
    if budget is not None:
        budget.spent = spent[best]
    return trials[best][0], trials[best][1], reason
