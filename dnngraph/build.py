"""The build: partition the graph into groups, describe each as a backend-neutral problem
(problems/), choose the first backend of the options' preference order that supports it
(backends/registry.py), and let it lower the group to launches; the plan (runtime/plan.py) runs
them.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .backends import registry
from .backends.contract import BuildContext
from .errors import UnsupportedError, ValidationError
from .fusion import partition
from .log import logger
from .options import BuildOptions
from .problems import problem_of
from .runtime.autotune import Tuner
from .runtime.interpreter import interpreting
from .runtime.launch import check_grid
from .runtime.plan import Plan, target_for
from .runtime.plan_cache import PLANS, plan_key
from .runtime.workspace import WorkspaceBudget
from .target import target_of

def _check_outputs_dense(graph):
    for tensor in graph.outputs():
        for size, stride in zip(tensor.dim, tensor.stride):
            if size > 1 and stride == 0:
                raise ValidationError(f"output {tensor.name!r} has stride 0 on an axis of size {size}: "
                                      f"its elements would overlap")


def build_plan(graph, options: Optional[BuildOptions] = None) -> "Plan":
    """The plan of a validated graph under `options` (None: the defaults): the cached one when
    an identical graph was built before with equal options for the same target (see runtime/plan_cache.py),
    else partition, schedule (or autotune) and generate every kernel. The graph's virtual
    tensors take the view strides the plan gives them."""
    options = BuildOptions() if options is None else options
    _check_outputs_dense(graph)
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


def _build_new(graph, device, options: BuildOptions) -> "Plan":
    """A new plan over `graph` (a snapshot the plan keeps)."""
    start = time.perf_counter()
    groups = partition(graph, registry.families(options.backends))
    for group in groups:
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
    graph order."""
    target = target_for(device, options)
    # timings are recorded under the device they are taken on, whatever target the model plans for
    tuner = Tuner(target_of(device), top=options.autotune_top) if options.autotune else None
    context = BuildContext(device, target, options, tuner, budget)
    launches = []
    interpreted = device.type == "cpu"
    for group in groups:
        problem = problem_of(graph, group)
        backend = registry.choose(problem, target, options, interpreted)
        built = backend.lower(graph, group, problem, context)
        for launch in built:
            for chosen in (launch, launch.alternative):
                if chosen is not None:
                    chosen.backend = backend.name
        launches.extend(built)
    for launch in launches:
        for chosen in (launch, launch.alternative):
            if chosen is not None:
                check_grid(chosen.grid, chosen.source_path, target)
    return launches
