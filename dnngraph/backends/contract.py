"""The contract every backend (one kernel language) keeps, as cuDNN's frontend engines do.

A backend says which problems it supports on a target, offers candidate configs with a model
estimate, and lowers a group to launches (choosing, rendering, loading and binding its kernels;
autotuning inside when the build's context has a tuner). The registry (registry.py) ranks the
(backend, candidate) pairs of every supporting backend together; the build lowers with the first
ranked backend (or, autotuning, the fastest of the top ranked backends).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Union, runtime_checkable

import torch

from ..runtime.autotune import Tuner
from ..runtime.workspace import WorkspaceBudget

if TYPE_CHECKING:
    from ..options import BuildOptions
    from ..problems import Problem
    from ..target import Target


@dataclass(frozen=True)
class BuildContext:
    """What a backend's lowering of one build reads besides its graph, group and problem: the
    device the launches are built for (autotuning times candidates there), its target, the
    build's options, the tuner (None: the model's choices) and the workspace budget the groups
    draw optional scratch from in graph order (None: unlimited)."""

    device: torch.device
    target: "Target"
    options: "BuildOptions"
    tuner: Optional[Tuner] = None
    budget: Optional[WorkspaceBudget] = None


@dataclass(frozen=True)
class Candidate:
    """One way a backend would run a problem: its config (backend-specific; None: the config
    the backend's lowering chooses itself) and the model's time in seconds (None: no estimate)."""

    backend: str
    config: object
    estimate: Optional[float] = None


@dataclass(frozen=True)
class KernelSource:
    """Generated source of one kernel, with what its launch needs besides (its arguments): what
    a renderer hands back. name: the stem the kernel is defined under in `text`, as load_kernel
    takes it (it appends the digest of `text`); text: the source; arguments: the KernelArgument
    list of its signature, in order. runtime/launch.py's launch_of turns one into a launch."""

    name: str
    text: str
    arguments: tuple = ()


@runtime_checkable
class Backend(Protocol):
    """name: the backend's name in BuildOptions.backends. version: a text that changes when its
    kernels may (part of the plan key). families: the group kinds it can lower at all.
    interpretable: its kernels run in Triton's interpreter on CPU tensors. prologue_stored_apart:
    families whose prologue values that are outputs a pointwise kernel stores first.

    Optional: verified (True where absent: a GPU run has checked every family's kernels) and
    verified_families (a frozenset: the families checked, where not all are). The default
    BuildOptions.backends (registry.verified()) names a backend verified for all its families,
    takes one verified for some as "name:family,..." (those families only), leaves out the rest."""

    name: str
    version: str
    families: frozenset
    interpretable: bool
    prologue_stored_apart: frozenset

    def supports(self, problem: "Problem", target: "Target") -> Union[bool, str]:
        """True when it can lower `problem` for `target`; else False or a reason (a str)."""

    def candidates(self, problem: "Problem", target: "Target", options) -> list:
        """Candidates (Candidate) for `problem` on `target` under `options` (BuildOptions), best
        first by the backend's own model."""

    def estimate(self, problem: "Problem", config, target: "Target") -> Optional[float]:
        """The model's seconds for `config` on `problem` (None where it has no model)."""

    def cache_key(self) -> tuple:
        """What a cached plan depends on of this backend beyond its object: name, version,
        families and the code that lowers each (a builder swapped in place changes it)."""
        ...

    def lower(self, graph, group, problem: "Problem", context, candidate: Optional[Candidate] = None) -> list:
        """The KernelLaunches of `group` (whose problem is `problem`) under the build's context;
        `candidate` (one of its candidates()) names the config to run where the backend can
        force it, None lets the backend choose (what the build passes)."""


def supported(backend: Backend, problem: "Problem", target: "Target") -> tuple:
    """(True, "") when `backend` supports `problem` on `target`, else (False, why)."""
    answer = backend.supports(problem, target)
    if answer is True:
        return True, ""
    return False, answer if isinstance(answer, str) and answer else f"{backend.name} has no {problem.family} kernel"
