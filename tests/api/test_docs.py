"""The docs name only what exists.

docs/ARCHITECTURE.md promises that every file and function it names exists, and README.md points
readers at files and API names. This test reads every backticked span of both files (outside
fenced code blocks) and checks:

  * path-like tokens (a '/' or a .py/.md/.sh/.json/.toml ending): the path exists, relative to the
    repository root or to dnngraph/. A `<placeholder>` matches any name (`ops/<family>.py`).
    Runtime paths under `$DNNGRAPH_CACHE_DIR` are skipped. Inside a command (`python x.py --y`)
    each path-like word is checked.
  * code names: CamelCase names, ALL_CAPS names, snake_case names (called, like `build_plan(...)`,
    or bare with an underscore, like `plan_key`) and dotted names (`Class.member`,
    `module.function`) must be defined under dnngraph/: a def, a class, an assignment at module or
    class level, an attribute set on `self`, a dataclass field, or a parameter name (keyword
    arguments such as `io_data_type`). For `Class.member`, the member must be defined in that
    class. Test helpers named in the testing section (`check`, `TOLERANCE`, `LAYERS`, ...) may
    be defined in the helper modules of tests/ and in tests/api/test_layers.py.

Names of torch, Triton and Python, and user-facing option values, are in ALLOWED below, each with
its reason. The failure lists every stale token with its file and line.
"""
from __future__ import annotations

import ast
import glob
import pathlib
import re

from dnngraph.ops.pointwise import POINTWISE_OPS
from dnngraph.frontend import FRONTEND_METHODS

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dnngraph"
DOCS = [ROOT / "docs" / "ARCHITECTURE.md", ROOT / "README.md"]

# Modules of tests/ whose definitions the docs may name (the testing section describes them).
TEST_HELPERS = ["conftest.py", "helpers.py", "graphgen.py", "fuzz_gpu.py", "pretend_gpu.py",
                "sm90_compile.py", "target_problems.py", "rowmodes.py", "api/test_layers.py"]

# Tokens that are not dnngraph's own definitions, each with why it may appear.
ALLOWED = {
    # torch, Triton and Python API the docs refer to
    "ImportError": "Python's exception, raised when the Triton version is wrong",
    "JITFunction": "Triton's kernel object (triton.runtime.jit.JITFunction)",
    "warmup": "Triton's JITFunction.warmup, which compiles without launching",
    "TYPE_CHECKING": "typing.TYPE_CHECKING",
    "sys.path": "Python's import path, set by tests/conftest.py",
    "torch.compile": "torch's compiler entry point",
    "torch.autograd": "torch's autograd",
    "pytest.mark.gpu": "the pytest marker declared in pyproject.toml",
    "ast": "Python's ast module, which tests/api/test_layers.py uses",
    "None": "Python's None, as a default value (`candidate=None`)",
    "help(dg.Graph)": "Python's help(), pointed at the Graph class",
    # names in generated kernel source, not Python definitions of the package
    "MASKED": "a constexpr parameter of the generated attend_blocks device function",
    "attend_blocks": "a device function generated into attention kernels' source",
    "dnngraph_kernels.<name>": "the module name a kernel's source is run as",
    # user-facing values and keys, not definitions
    "avg_include_pad": "a pooling mode value",
    "avg_exclude_pad": "a pooling mode value",
    "cross_correlation": "a convolution mode value",
    "ceil_mode": "a pooling keyword, as torch names it",
    "build_options": "the key of torch.compile's options dict that carries BuildOptions",
    "DNNGRAPH_LOG": "an environment variable",
    "DNNGRAPH_AUTOTUNE_TOP": "an environment variable",
    "DNNGRAPH_CACHE_DIR": "an environment variable",
    "FORCE_*": "a pattern of removed globals that a test checks do not come back",
    "*_backward": "a pattern of op names",
    "dnngraph_matmul_relu_<digest>": "a kernel name as explain() prints it",
}

# Prefixes of dotted names that belong to other libraries.
FOREIGN_PREFIXES = ("torch.", "tl.", "triton.", "np.", "os.", "sys.")
# Prefixes that stand for the package in the README's snippets (`dg.Graph`, `g.build(...)`).
PACKAGE_PREFIXES = ("dg.", "dnngraph.", "g.")


def _definitions(paths) -> tuple[set[str], dict[str, set[str]]]:
    """All names defined in `paths`, and each class's members."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}

    def targets(node):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                yield from targets(element)
        elif isinstance(node, ast.Attribute):
            yield node.attr  # self.x = ..., obj.attr = ...

    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                own = members.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, ast.Assign):
                        for target in item.targets:
                            own.update(targets(target))
                    elif isinstance(item, (ast.AnnAssign, ast.AugAssign)):
                        own.update(targets(item.target))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                arguments = node.args
                for argument in (arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                                 + [a for a in (arguments.vararg, arguments.kwarg) if a]):
                    names.add(argument.arg)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(targets(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                names.update(targets(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:  # a name a module re-exports (`dg.float32`)
                    names.add((alias.asname or alias.name).split(".")[-1])
    for own in members.values():
        names.update(own)
    return names, members


PACKAGE_FILES = sorted(PACKAGE.rglob("*.py"))
NAMES, MEMBERS = _definitions(PACKAGE_FILES)
MODULES = {path.stem for path in PACKAGE_FILES} | {path.name for path in PACKAGE.rglob("*")
                                                   if path.is_dir()}
HELPER_NAMES, HELPER_MEMBERS = _definitions([ROOT / "tests" / name for name in TEST_HELPERS])

BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH_END = (".py", ".md", ".sh", ".json", ".toml")
CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
CAPS = re.compile(r"^_?[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
SNAKE = re.compile(r"^_*[a-z][a-z0-9]*(_[a-z0-9]+)*_?$")
NAME_HEAD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(.*)$", re.S)


def tokens(path: pathlib.Path):
    """(line number, token) for each backticked span outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            for match in BACKTICKED.finditer(line):
                yield number, match.group(1).strip()


def path_exists(word: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", word).rstrip("/")
    return any(glob.glob(str(base / pattern)) for base in (ROOT, PACKAGE))


def looks_like_path(word: str) -> bool:
    return ("/" in word or word.endswith(PATH_END)) and not any(c in word for c in "$=()[]{},'\"")


def stale_paths(token: str) -> list[str]:
    if " " not in token:
        return [token] if looks_like_path(token) and not path_exists(token) else []
    # a command: its scripts and paths, not its arguments' file names (`graph.json`)
    return [w for w in token.split() if looks_like_path(w) and ("/" in w or w.endswith((".py", ".sh")))
            and not path_exists(w)]


def known(name: str) -> bool:
    return name in NAMES or name in HELPER_NAMES or name in MODULES


def member_known(owner: str, member: str) -> bool:
    return member in MEMBERS.get(owner, set()) or member in HELPER_MEMBERS.get(owner, set())


def stale_name(token: str) -> str | None:
    """The part of `token` that names no definition, or None."""
    if token in ALLOWED:
        return None
    match = NAME_HEAD.match(token)
    if not match:
        return None
    name, rest = match.groups()
    called = rest.startswith("(")
    if rest.startswith("="):  # `fusion=AnchorRule((), 0)`: check the value
        return stale_name(rest[1:].strip())
    if rest and not called:
        return None  # not a name: an expression, an option list, a command
    if name in ALLOWED or name.startswith(FOREIGN_PREFIXES):
        return None
    for prefix in PACKAGE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            if prefix == "g.":  # a Graph in the README's snippets
                name = "Graph." + name
            break
    if "." in name:
        parts = name.split(".")
        owner, member = parts[-2], parts[-1]
        if CAMEL.match(owner) or (CAPS.match(owner) and owner in MEMBERS):
            if owner not in MEMBERS and owner not in HELPER_MEMBERS:
                return owner
            if member_known(owner, member) or f"{owner}.{member}" in GENERATED:
                return None
            return name
        bad = [part for part in parts if part.isidentifier() and not known(part)
               and (CAMEL.match(part) or CAPS.match(part) or "_" in part)]
        return name if bad or not known(member) else None
    if CAMEL.match(name) or (CAPS.match(name) and len(name.strip("_")) > 1):
        return None if known(name) else name
    if SNAKE.match(name) and (called or "_" in name):
        return None if known(name) else name
    return None


# Members that exist without a definition of their own in the class body: Graph's pointwise
# methods, generated per POINTWISE_OPS entry by graph.py's _pointwise_method.
GENERATED = {f"Graph.{name}" for name in POINTWISE_OPS} | {f"Graph.{name}" for name in FRONTEND_METHODS}


def test_docs_name_only_what_exists():
    stale = []
    for path in DOCS:
        for number, token in tokens(path):
            if token in ALLOWED or token.startswith("$"):
                continue
            for word in stale_paths(token):
                stale.append(f"{path.relative_to(ROOT)}:{number}: path `{word}` (in `{token}`)")
            if looks_like_path(token) or " " in token and not NAME_HEAD.match(token):
                continue
            name = stale_name(token)
            if name:
                stale.append(f"{path.relative_to(ROOT)}:{number}: name `{name}` (in `{token}`)")
    assert not stale, "stale references in the docs:\n" + "\n".join(stale)


def test_the_checker_catches_stale_tokens():
    assert stale_paths("backends/triton/lower/sdpa.py") == []
    assert stale_paths("nowhere/missing.py") == ["nowhere/missing.py"]
    assert stale_paths("ops/<family>.py") == []
    assert stale_name("BUILDERS") is None
    assert stale_name("KERNEL_BUILDERS") == "KERNEL_BUILDERS"
    assert stale_name("build_plan(graph)") is None
    assert stale_name("BuildContext.attention") == "BuildContext.attention"
    assert stale_name("Tuner.choose") is None
    assert stale_name("tl.swizzle2d") is None
    assert stale_name("g.mul(x, 0.5)") is None
    assert stale_name("g.nonesuch(x)") == "Graph.nonesuch"
