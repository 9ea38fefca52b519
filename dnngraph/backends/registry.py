"""The backends a build can choose from, by name: one registry line per backend.

ranked() ranks the (backend, Candidate) pairs of every backend of the build's preference order
(BuildOptions.backends) that supports a problem, together. An entry of options.backends is a
backend's name (every family it has) or `name:family,family` (only those families: the default
names a backend whose `verified_families` are some of its families so, e.g. "gluon:sdpa"). The rule:

- every backend of options.backends that supports the problem on the target (on interpreted
  builds, only those whose kernels run in Triton's interpreter; only for the families its entry
  takes) contributes its candidates
  (backend.candidates(problem, target, options)), best first by its own model (none offered:
  one candidate without config or estimate, the backend's own choice);
- where every pair has an estimate, pairs are ordered by it (seconds, lower first): estimates
  from different backends are comparable because each is a time in seconds from the same target
  model (the build's Target);
- where any pair has none, pairs are ordered by preference (options.backends order) alone: a
  backend that gives no estimate is ranked by preference only;
- ties are broken by preference order, then by the backend's own order of its candidates;
- where options force a backend's config for the problem (its forced_options: conv_config for
  Triton's conv kernels, say), only the backends forced take part: a forced config runs, never
  silently replaced by another backend's kernel that its model ranks first.

choose() is the backend of the first ranked pair (without asking for candidates where only one
backend supports the problem); families() is every group kind some backend lowers (what the
partition may form groups for); signature() is what the plan key holds of them.
"""
from __future__ import annotations

from ..errors import UnsupportedError
from .contract import Candidate, supported
from .gluon.backend import GLUON
from .triton.backend import TRITON

# One line per backend. A backend verified for none of its families (no GPU run has checked its
# kernels) is registered, so BuildOptions(backends=(...)) may name it, but is left out of the
# default preference order (verified()); one verified for some families enters it for those.
BACKENDS = {TRITON.name: TRITON, GLUON.name: GLUON}
FAMILY_SEPARATOR = ":"


def names() -> tuple:
    """The registered backend names, in registry order."""
    return tuple(BACKENDS)


def verified_families(backend) -> frozenset:
    """The families of `backend` a default build takes from it: its `verified_families` where
    it has them, else all of its families where `verified` (True where absent), else none."""
    declared = getattr(backend, "verified_families", None)
    if declared is not None:
        return frozenset(declared) & frozenset(backend.families)
    return frozenset(backend.families) if getattr(backend, "verified", True) else frozenset()


def entry(name: str, taken=None) -> str:
    """The options.backends entry of backend `name` taking the families `taken` (None: all)."""
    return name if taken is None else name + FAMILY_SEPARATOR + ",".join(sorted(taken))


def parse(entry_: str) -> tuple:
    """(name, families taken: a frozenset, or None for every family) of an options.backends entry."""
    name, separator, listed = entry_.partition(FAMILY_SEPARATOR)
    return name, (frozenset(f for f in listed.split(",") if f) if separator else None)


def canonical(entry_: str) -> str:
    """The one spelling of an options.backends entry (of a registered backend): families sorted
    and once, the name alone where they are all of its families. Equal choices are equal options,
    so they share a plan (runtime/plan_cache.py) whichever way they were written."""
    name, taken = parse(entry_)
    return entry(name, None if taken is None or taken >= frozenset(BACKENDS[name].families) else taken)


def verified() -> tuple:
    """The default BuildOptions.backends, in registry order: each backend verified for all its
    families by name, one verified for some as `name:family,...` (only those), the rest left out."""
    found = []
    for name, backend in BACKENDS.items():
        taken = verified_families(backend)
        if taken == frozenset(backend.families):
            found.append(name)
        elif taken:
            found.append(entry(name, taken))
    return tuple(found)


def taken_families(entry_: str) -> frozenset:
    """The families the options.backends entry `entry_` takes from its (registered) backend."""
    name, taken = parse(entry_)
    families_ = frozenset(BACKENDS[name].families)
    return families_ if taken is None else families_ & taken


def families(names_=None) -> frozenset:
    """The group kinds any backend of `names_` (options.backends entries; None: every registered
    backend) supports, as far as each entry takes them."""
    chosen = names() if names_ is None else [n for n in names_ if parse(n)[0] in BACKENDS]
    found = frozenset()
    for entry_ in chosen:
        found |= taken_families(entry_)
    return found


def signature(names_) -> tuple:
    """What a plan built with the backends `names_` depends on of them, one entry per name in
    order: the entry (with the families it takes), the backend object itself (another instance
    registered under the name misses the cache) and its cache_key() (name, version, families and
    the code that lowers each: a builder swapped in place misses it too); an unregistered name as
    itself (choose() refuses it)."""
    found = []
    for entry_ in names_:
        backend = BACKENDS.get(parse(entry_)[0])
        found.append((entry_, id(backend), backend.cache_key()) if backend is not None else (entry_,))
    return tuple(found)


def forced_options(backend, problem, options) -> tuple:
    """The options fields that force `backend`'s kernel for `problem` (its forced_options();
    none for a backend without the method)."""
    method = getattr(backend, "forced_options", None)
    return tuple(method(problem, options)) if method is not None else ()


def _forcing(backends: list, problem, options) -> list:
    """Those of `backends` whose kernel the options force for `problem` (see the module's rule)."""
    return [backend for backend in backends if forced_options(backend, problem, options)]


def supporting(problem, target, options, interpreted: bool = False) -> list:
    """The backends of options.backends that support `problem` on `target`, in preference order
    (when the kernels run in the interpreter, only those whose kernels can; where the options
    force some backends' configs, those only); UnsupportedError naming the node and the backends
    tried when none does."""
    found, tried = [], []
    for entry_ in options.backends:
        name, taken = parse(entry_)
        backend = BACKENDS.get(name)
        if backend is None:
            tried.append(f"{name}: not registered")
            continue
        if taken is not None and problem.family not in taken:
            tried.append(f"{name}: taken for {', '.join(sorted(taken))} only (options.backends entry {entry_!r}; "
                         f"name {name!r} alone to take its {problem.family} kernels too)")
            continue
        if interpreted and not backend.interpretable:
            tried.append(f"{name}: its kernels cannot run in Triton's interpreter")
            continue
        ok, why = supported(backend, problem, target)
        if ok:
            found.append(backend)
        else:
            tried.append(f"{name}: {why}")
    if not found:
        raise UnsupportedError(
            f"{problem.where}: no {problem.family} kernel exists yet in the backends tried "
            f"({'; '.join(tried)}), so the group [{', '.join(problem.node_names)}] cannot run; "
            f"graph.reference() computes it")
    return _forcing(found, problem, options) or found


def refusals(problem, target, options, interpreted: bool = False) -> str:
    """Why each backend of options.backends that does not take `problem` refuses it, or is left
    out because the options force another's kernel ("name: why" joined by "; "), "" where all
    take it: explain() shows it beside the backend that did."""
    refused, taking = [], []
    for entry_ in options.backends:
        name, taken = parse(entry_)
        backend = BACKENDS.get(name)
        if backend is None:
            continue  # supporting() names these where nothing takes the group
        if taken is not None and problem.family not in taken:
            continue  # an entry for other families (e.g. "gluon:sdpa" for a conv): not a refusal
        ok, why = supported(backend, problem, target)
        if interpreted and not backend.interpretable:
            if ok and not target.interpreted:  # built here for a GPU by name: its build there may differ
                refused.append(f"{name}: its kernels cannot run in Triton's interpreter, where this plan was built "
                               f"(a build on the {target.name} itself may take them)")
            continue
        if ok:
            taking.append(backend)
        else:
            refused.append(f"{name}: {why}")
    forcing = _forcing(taking, problem, options)
    forced = ", ".join(f"BuildOptions.{option} forces {backend.name}'s kernel"
                       for backend in forcing for option in forced_options(backend, problem, options))
    refused += [f"{backend.name}: {forced}" for backend in taking if forcing and backend not in forcing]
    return "; ".join(refused)


def ranked(problem, target, options, interpreted: bool = False, backends=None) -> list:
    """(backend, Candidate) pairs of every supporting backend (`backends`: those of supporting(),
    when already known), best first by the rule of this module's docstring."""
    backends = supporting(problem, target, options, interpreted) if backends is None else backends
    keyed = []
    for preference, backend in enumerate(backends):
        offered = backend.candidates(problem, target, options) or [Candidate(backend.name, None, None)]
        for order, candidate in enumerate(offered):
            keyed.append((preference, order, backend, candidate))
    if keyed and all(c.estimate is not None for _, _, _, c in keyed):
        keyed.sort(key=lambda k: (k[3].estimate, k[0], k[1]))
    else:
        keyed.sort(key=lambda k: (k[0], k[1]))
    return [(backend, candidate) for _, _, backend, candidate in keyed]


def ranking_reason(pairs: list) -> str:
    """Why the first backend of ranked() `pairs` leads the other backends ("" for one backend)."""
    firsts = {}
    for backend, candidate in pairs:
        firsts.setdefault(backend.name, candidate)
    if len(firsts) < 2:
        return ""
    (lead, best), others = next(iter(firsts.items())), list(firsts.items())[1:]
    names = ", ".join(name for name, _ in others)
    if all(c.estimate is not None for _, c in pairs):
        against = ", ".join(f"{name} {c.estimate * 1e6:.1f} us" for name, c in others)
        return f"backend {lead} ranked over {names} by the model: {best.estimate * 1e6:.1f} us vs {against}"
    missing = sorted({b.name for b, c in pairs if c.estimate is None})
    return (f"backend {lead} ranked over {names} by preference order "
            f"(no model estimate from {', '.join(missing)})")


def choose(problem, target, options, interpreted: bool = False):
    """The backend of ranked()'s first pair: the first of options.backends that supports
    `problem` on `target` (when the kernels run in the interpreter, one whose kernels can) unless
    the estimates of several rank another first; UnsupportedError naming the node and the
    backends tried when none supports it."""
    backends = supporting(problem, target, options, interpreted)
    if len(backends) == 1:
        return backends[0]
    return ranked(problem, target, options, interpreted, backends)[0][0]


def choices(problem, target, options, interpreted: bool = False) -> list:
    """The plans a build may be told to take for `problem` (BuildOptions.plan): ranked()'s
    pairs whose config the backend runs as given (its `forces(problem, candidate)`), and for a
    backend that forces none of its candidates one pair with config None, its lowering's own
    choice, in the place of its best ranked candidate (whose estimate it keeps)."""
    found, own_choice = [], set()
    for backend, candidate in ranked(problem, target, options, interpreted):
        forces = getattr(backend, "forces", None)
        if forces is not None and candidate.config is not None and forces(problem, candidate):
            found.append((backend, candidate))
        elif backend.name not in own_choice:
            own_choice.add(backend.name)
            found.append((backend, Candidate(backend.name, None, candidate.estimate)))
    return found
