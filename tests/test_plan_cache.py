"""The plan cache: a second build of an identical graph reuses the first plan, and nothing that
changes what a build makes (the graph, build options, the target, environment, tuning cache) can
bring back a stale one."""
import dataclasses
import importlib
import pathlib
import pkgutil
import re
import sys
import threading

import pytest
import torch

import dnngraph as dg
import dnngraph.heuristics
import dnngraph.plan as plan_module
from dnngraph.heuristics import depthwise, matmul as mm, rows, sdpa
from dnngraph.plan import cache as plan_cache
from helpers import check, poisoned, rel_err

SOURCES = pathlib.Path(dg.__file__).parent


def _mlp(name="mlp", names=("x", "w", "y")):
    """relu(x @ w) then a row softmax: two kernels, a workspace tensor between them."""
    g = dg.Graph(name=name)
    x = g.tensor(name=names[0], dim=[5, 24])
    w = g.tensor(name=names[1], dim=[24, 40])
    y = g.softmax(g.relu(g.matmul(x, w)), axis=1).set_output(True).set_name(names[2])
    return g, x, w, y


def _inputs(x, w, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {x: torch.randn(x.dim, generator=generator), w: torch.randn(w.dim, generator=generator)}


def _hits():
    return plan_cache.PLANS.hits


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear()
    yield
    plan_cache.clear()


# --- hits ----------------------------------------------------------------------------------------
def test_identical_graph_is_a_hit_that_binds_its_own_handles():
    g1, x1, w1, y1 = _mlp("first")
    g1.build()
    g2, x2, w2, y2 = _mlp("second")  # the graph's own name is not in the key
    hits = _hits()
    g2.build()
    assert _hits() == hits + 1
    assert g2.plan.launches is g1.plan.launches and g2.plan is not g1.plan
    check(g2, _inputs(x2, w2))
    out = poisoned(y2)
    g2.execute({"x": _inputs(x2, w2)[x2], "w": _inputs(x2, w2)[w2], "y": out})  # names work too
    assert rel_err(out, g2.reference(_inputs(x2, w2))["y"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="not a tensor of graph 'second'"):
        g2.execute({x1: torch.randn(5, 24), w2: torch.randn(24, 40), y2: poisoned(y2)})
    assert "graph 'second'" in g2.explain() and "graph 'first'" in g1.explain()


def test_hit_does_no_build_work():
    """Structure, not wall clock: a hit partitions, schedules, generates and loads nothing, and
    makes a small fraction of a miss's Python calls."""
    def calls_of(build):
        called = []

        def profile(frame, event, arg):
            if event == "call":
                called.append(frame.f_code.co_name)
        sys.setprofile(profile)
        try:
            build()
        finally:
            sys.setprofile(None)
        return called

    first, second = _mlp()[0], _mlp()[0]
    miss = calls_of(first.build)
    hit = calls_of(second.build)
    for work in ("partition", "build_launches", "load_kernel", "_build_new"):
        assert work in miss and work not in hit, work
    assert len(hit) * 10 < len(miss), (len(hit), len(miss))


def test_hit_gives_view_strides_like_a_build():
    def transposed():
        g = dg.Graph(name="t")
        a = g.tensor(name="a", dim=[6, 8])
        b = g.tensor(name="b", dim=[6, 4])
        at = g.transpose(g.relu(a), [1, 0])  # a view: the matmul reads relu(a) transposed
        y = g.matmul(at, b).set_output(True)
        return g, a, b, at, y

    g1, _, _, at1, _ = transposed()
    g1.build()
    g2, a2, b2, at2, _ = transposed()
    hits = _hits()
    g2.build()
    assert _hits() == hits + 1
    assert at2.stride == at1.stride and at2.own_stride == at1.own_stride
    check(g2, {a2: torch.randn(6, 8), b2: torch.randn(6, 4)})


def test_hit_explains_and_draws_like_a_build():
    g1 = _mlp()[0].build()
    g2 = _mlp()[0].build()
    assert g2.plan.launches is g1.plan.launches
    assert g2.explain() == g1.explain()
    assert g2.to_dot() == g1.to_dot() and "(view)" not in g2.to_dot()


def test_threads_building_one_graph_get_working_plans():
    errors = []

    def work(seed):
        try:
            g, x, w, _ = _mlp()
            check(g.build(), _inputs(x, w, seed))
        except Exception as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


# --- misses: the graph ---------------------------------------------------------------------------
def test_changing_a_built_graph_misses_and_leaves_the_cached_plan_alone():
    g1, x1, w1, y1 = _mlp()
    g1.build()
    first = g1.plan
    y1.set_data_type(dg.float16)
    g1.build()
    assert g1.plan.launches is not first.launches
    assert g1.plan.dtypes[y1.uid] == torch.float16
    x1.set_name("renamed")  # the plan cached first was built on a snapshot: this cannot reach it
    g2, x2, w2, y2 = _mlp()
    g2.build()
    assert g2.plan.launches is first.launches
    assert "renamed" not in g2.explain() and "x [5, 24]" in g2.explain()
    check(g2, _inputs(x2, w2))


@pytest.mark.parametrize("change", ["stride", "output", "dtype", "tf32", "attribute", "dims"])
def test_every_kind_of_graph_change_misses(change):
    def make(changed: bool):
        g = dg.Graph(name="g", allow_tf32=changed and change == "tf32")
        x = g.tensor(name="x", dim=[5, 3 if changed and change == "dims" else 4],
                     stride=[1, 5] if changed and change == "stride" else None)
        h = g.scale(x, 3.0 if changed and change == "attribute" else 2.0)
        w = g.tensor(name="w", dim=[3 if changed and change == "dims" else 4, 6])
        y = g.matmul(h, w).set_output(True)
        if changed and change == "output":
            h.set_output(True)
        if changed and change == "dtype":
            y.set_data_type(dg.float16)
        return g

    make(False).build()
    hits = _hits()
    changed = make(True).build()
    assert _hits() == hits
    inputs = {t: torch.randn(t.dim).as_strided(t.dim, t.stride) for t in changed.inputs()}
    check(changed, inputs, tolerance=2e-3)


def test_int_and_float_attributes_are_different_graphs():
    def make(constant):
        g = dg.Graph(name="g", io_data_type=dg.int32)
        x = g.tensor(name="x", dim=[7])
        g.add(x, constant).set_output(True).set_name("y")
        return g

    make(2).build()
    hits = _hits()
    g = make(2.0).build()
    assert _hits() == hits
    assert g.plan.dtypes[g.tensor_by_name("y").uid] == torch.int32
    check(g, {"x": torch.arange(7, dtype=torch.int32)})


def test_same_structure_with_other_names_binds_by_its_own_names():
    g1, x1, w1, _ = _mlp(names=("x", "w", "y"))
    g1.build()
    g2, x2, w2, y2 = _mlp(names=("w", "x", "out"))  # the names swapped: uids alike, names not
    g2.build()
    assert g2.plan.launches is not g1.plan.launches
    inputs = _inputs(x2, w2)
    out = poisoned(y2)
    g2.execute({"w": inputs[x2], "x": inputs[w2], "out": out})
    assert rel_err(out, g2.reference(inputs)["out"]) < 2e-5
    with pytest.raises(dg.ExecutionError, match="expects shape"):
        g2.execute({"x": inputs[x2], "w": inputs[w2], "out": poisoned(y2)})


def test_tensors_declared_in_another_order_run_correctly():
    g1 = dg.Graph(name="g")
    a, b = g1.tensor(name="a", dim=[4, 3]), g1.tensor(name="b", dim=[4, 3])
    g1.sub(a, b).set_output(True).set_name("y")
    g1.build()
    g2 = dg.Graph(name="g")
    b2, a2 = g2.tensor(name="b", dim=[4, 3]), g2.tensor(name="a", dim=[4, 3])
    g2.sub(a2, b2).set_output(True).set_name("y")
    check(g2.build(), {"a": torch.randn(4, 3), "b": torch.randn(4, 3)})


# --- misses: build arguments, overrides, environment ---------------------------------------------
def test_build_arguments_are_in_the_key(monkeypatch):
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "1")
    g = _mlp()[0]
    g.build()
    for arguments in ({"workspace_limit": 0}, {"workspace_limit": 1 << 20}, {"autotune": True}):
        hits = _hits()
        _mlp()[0].build(**arguments)
        assert _hits() == hits, arguments
        _mlp()[0].build(**arguments)
        # an autotuned build stores its winners: the next one sees a new tuning cache and misses
        assert _hits() == hits + (0 if arguments.get("autotune") else 1), arguments


def test_a_changed_tuning_cache_file_misses(monkeypatch, tmp_path):
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "1")
    g = _mlp()[0].build(autotune=True)
    assert {launch.tuning.source for launch in g.plan.launches} == {"tuned"}
    g = _mlp()[0].build(autotune=True)  # the winners were stored: a miss that reads them
    assert {launch.tuning.source for launch in g.plan.launches} == {"cache"}
    hits = _hits()
    _mlp()[0].build(autotune=True)
    assert _hits() == hits + 1
    (tmp_path / "tuning.json").write_text('{"format": "dnngraph-tuning", "version": 1, "entries": {}}')
    g = _mlp()[0].build(autotune=True)
    assert _hits() == hits + 1 and {launch.tuning.source for launch in g.plan.launches} == {"tuned"}


def test_forced_configs_change_the_plan():
    g, x, w, _ = _mlp()
    g.build()
    split = dg.BuildOptions(matmul_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2, split_k=3))
    forced, x2, w2, _ = _mlp()
    forced.build(options=split)
    assert forced.plan.launches[0].config_text.startswith("split_k")
    check(forced, _inputs(x2, w2))
    both, x3, w3, _ = _mlp()
    both.build(options=dataclasses.replace(split, row_mode="looped", row_loop_tile=16))
    assert "(looped)" in both.plan.launches[-1].config_text
    assert "(looped)" not in forced.plan.launches[-1].config_text
    check(both, _inputs(x3, w3))
    again = _mlp()[0].build()
    assert [launch.config_text for launch in again.plan.launches] == [launch.config_text for launch in g.plan.launches]


def _key(g, options=None):
    from dnngraph.plan import KERNEL_BUILDERS, _build_device, _target_for
    options, device = options or dg.BuildOptions(), _build_device()
    return plan_cache.plan_key(g, options, device, _target_for(device, options), KERNEL_BUILDERS)


# One value other than the default for every option (each a valid one).
OTHER_OPTIONS = dict(
    autotune=True, autotune_top=2, workspace_limit=0, backends=["triton"], target=dg.target.H200,
    matmul_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2), conv_config=mm.MatmulConfig("tiled", 32, 16, 16, 4, 2),
    depthwise_config=depthwise.DepthwiseConfig("gather", 4, 32, 2), row_mode="looped",
    row_config=rows.RowConfig("split", 8, 4, 1, 3, 0.0), norm_backward_programs=3,
    sdpa_config=sdpa.AttentionConfig(16, 16, 1, 1), sdpa_dkdv_config=sdpa.AttentionConfig(16, 16, 1, 1),
    sdpa_dq_config=sdpa.AttentionConfig(16, 32, 1, 1), sdpa_splits=3, sdpa_head_group=0, sdpa_index_64=True,
    row_loop_tile=16, row_split_min_reduced=8, row_combine_values=16, norm_backward_max_reduced=64,
    column_prefetch_tiles=0, column_stream_apply=False, conv_fold_channels_below=0)


def test_other_options_cover_every_field():
    assert set(OTHER_OPTIONS) == {f.name for f in dataclasses.fields(dg.BuildOptions)}


@pytest.mark.parametrize("name", sorted(OTHER_OPTIONS))
def test_every_option_is_in_the_key(name):
    """Options that differ in any field file different plans; equal options made apart (each
    field equal, none the same object) share one."""
    g = _mlp()[0]
    default = dg.BuildOptions()
    changed = dataclasses.replace(default, **{name: OTHER_OPTIONS[name]})
    if name == "backends":  # the one backend there is: a list of it is the default tuple
        assert changed == default and _key(g, changed) == _key(g, default)
        return
    assert changed != default and _key(g, changed) != _key(g, default)
    assert _key(g, changed) == _key(g, dataclasses.replace(dg.BuildOptions(), **{name: OTHER_OPTIONS[name]}))


def test_equal_options_share_a_plan_and_different_ones_do_not():
    tiled = mm.MatmulConfig("tiled", 16, 16, 16, 4, 2)
    first = _mlp()[0].build(options=dg.BuildOptions(matmul_config=tiled))
    hits = _hits()
    same = _mlp()[0].build(options=dg.BuildOptions(matmul_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2)))
    assert _hits() == hits + 1 and same.plan.launches is first.plan.launches
    other = _mlp()[0].build(options=dg.BuildOptions(matmul_config=tiled, row_mode="looped", row_loop_tile=16))
    assert _hits() == hits + 1 and other.plan.launches is not first.plan.launches
    shorthand = _mlp()[0].build(workspace_limit=0, options=dg.BuildOptions(matmul_config=tiled))
    assert shorthand.plan.launches is not first.plan.launches  # workspace_limit=0 replaced the option's None
    assert _mlp()[0].build(options=dg.BuildOptions(matmul_config=tiled, workspace_limit=0)).plan.launches \
        is shorthand.plan.launches


def test_module_assignments_change_no_plan():
    """The heuristics read no module state a caller sets: no FORCE_* knob exists, and a build
    after assigning a module value (what once forced a config) is a hit on the same plan."""
    for info in pkgutil.iter_modules(dnngraph.heuristics.__path__):
        module = importlib.import_module(f"dnngraph.heuristics.{info.name}")
        assert not [name for name in vars(module) if name.startswith("FORCE_")], module.__name__
    first = _mlp()[0].build()
    hits = _hits()
    rows.NEW_KNOB = 3
    try:
        again = _mlp()[0].build()
    finally:
        del rows.NEW_KNOB
    assert _hits() == hits + 1 and again.plan.launches is first.plan.launches


def test_cache_folder_is_in_the_key(monkeypatch, tmp_path):
    g = _mlp()[0].build()
    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    moved = _mlp()[0].build()
    assert all(launch.source_path.parent == tmp_path / "kernels" for launch in moved.plan.launches)
    assert all(launch.source_path.parent != tmp_path / "kernels" for launch in g.plan.launches)


def test_every_environment_variable_read_is_accounted_for():
    read = set()
    for path in SOURCES.rglob("*.py"):
        read |= set(re.findall(r"""(?:environ\.get|environ\[|getenv)\(?\s*["']([A-Z_]+)["']""", path.read_text()))
    assert read, "the pattern finds nothing: fix it"
    assert read <= set(plan_cache.BUILD_ENVIRONMENT) | set(plan_cache.IGNORED_ENVIRONMENT), read


def test_the_target_is_in_the_key(monkeypatch):
    """The device's target (read from its driver), and a target the options name."""
    g = _mlp()[0].build()
    small = dataclasses.replace(dg.target.INTERPRETER, name="small", sms=5)
    assert _mlp()[0].build(options=dg.BuildOptions(target=small)).plan.launches is not g.plan.launches
    monkeypatch.setattr(plan_module, "target_of", lambda device=None: small)
    other = _mlp()[0].build()
    assert other.plan.launches is not g.plan.launches
