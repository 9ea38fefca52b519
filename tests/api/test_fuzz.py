"""Random graphs across every family with kernels, compared with the float64 reference.

Each seed is one graph (tests/graphgen.py): reproduce a failure with
`python -c "import graphgen; c = graphgen.generate(SEED); print(c.describe()); print(graphgen.run_case(c))"`
from tests/ (add `families=[...]` where its description lists them: fuzz_gpu.py --families). A graph
that no kernel can run yet is skipped with its reason, never passed.
"""
import functools

import pytest

import graphgen

CPU_GRAPHS = 300


@pytest.mark.parametrize("seed", range(CPU_GRAPHS))
def test_random_graph_matches_reference(seed):
    case = graphgen.generate(seed)
    verdict = graphgen.run_case(case)
    if verdict.status == "unsupported":
        pytest.skip(f"unsupported: {verdict.detail}")
    assert verdict.status == "passed", f"{verdict.status}: {verdict.detail}\n{case.describe()}"


def test_a_seed_reproduces_its_graph():
    first, second = graphgen.generate(12345), graphgen.generate(12345)
    assert first.describe() == second.describe()
    assert first.graph.to_json() == second.graph.to_json()
    for name, value in first.inputs.items():
        assert value.stride() == second.inputs[name].stride()
        assert graphgen.torch.equal(value.nan_to_num(), second.inputs[name].nan_to_num())


def _binding_kinds(case) -> set:
    """The kinds of bindings `case` shapes itself (its shared buffers, refusals, negated inputs,
    paged tables with ids outside the pools)."""
    kinds = {refusal.kind for refusal in case.refusals}
    kinds.update("negated input" for value in case.inputs.values() if value.is_neg())
    for shared in case.shared:
        tensors = [view[0] for view in shared.views]
        outputs = sum(t.is_output for t in tensors)
        kinds.update({"interleaved outputs"} if outputs >= 2 else set())
        kinds.update({"interleaved input and output"} if outputs < len(tensors) else set())
        kinds.update({"gap between views"} if not shared.claimed().all() else set())
    for node in case.graph.nodes:
        if node.op == "sdpa" and node.inputs[6] is not None:  # inputs q k v bias lens_q lens_kv ktab vtab
            pages = node.inputs[1].dim[0]
            for table in node.inputs[6:8]:
                ids = case.inputs[table.name]
                kinds.update({"id past the pool"} if (ids >= pages).any() else set())
                kinds.update({"negative id"} if (ids < 0).any() else set())
                kinds.update({"id near 2**31"} if (ids.abs() >= 2**30).any() else set())
    return kinds


@functools.lru_cache(maxsize=None)
def _drawn() -> tuple:
    """(ops, binding kinds) of each CI seed's graph, drawn once per process."""
    cases = [graphgen.generate(seed) for seed in range(CPU_GRAPHS)]
    return tuple(({node.op for node in case.graph.nodes}, _binding_kinds(case)) for case in cases)


def test_the_generator_covers_every_family():
    ops, kinds = set().union(*(o for o, _ in _drawn())), set().union(*(k for _, k in _drawn()))
    expected = {"reduction", "softmax", "softmax_backward", "layernorm", "rmsnorm", "batchnorm",
                "batchnorm_inference", "instancenorm", "groupnorm", "genstats", "layernorm_backward",
                "rmsnorm_backward", "batchnorm_backward", "instancenorm_backward",
                "groupnorm_backward", "pooling", "pooling_backward", "dropout", "matmul", "where",
                "cast", "logical_and", "logical_or", "logical_not", "cmp_lt", "add", "pow", "div", "sdpa"}
    assert expected <= ops, sorted(expected - ops)
    expected_kinds = {"negated input", "negated output", "conjugate input", "conjugate output",
                      "interleaved outputs", "interleaved input and output", "gap between views", "overlap",
                      "id past the pool", "negative id", "id near 2**31"}
    assert expected_kinds <= kinds, sorted(expected_kinds - kinds)


def _first_case(kind):
    return graphgen.generate(next(seed for seed, (_, kinds) in enumerate(_drawn()) if kind in kinds))


def test_verdict_reports_a_write_between_interleaved_views(monkeypatch):
    # an element of the shared buffer that belongs to no binding keeps its poison, bit for bit
    case = _first_case("gap between views")
    shared = next(shared for shared in case.shared if not shared.claimed().all())
    gap = int((~shared.claimed()).nonzero()[0])
    execute = case.graph.execute

    def execute_writing_the_gap(bindings, *args, **kwargs):
        execute(bindings, *args, **kwargs)
        view = bindings[shared.views[0][0].name]
        graphgen.torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())[gap] = 0.0

    monkeypatch.setattr(case.graph, "execute", execute_writing_the_gap)
    verdict = graphgen.run_case(case)
    assert verdict.status == "binding" and "outside the outputs' views" in verdict.detail, verdict


def _first_refused_case(kind):
    """The first case drawing a refusal of `kind` that execute must refuse: an overlap that binds
    an output to exactly the view of an input the plan may overwrite runs (in place)."""
    for seed, (_, kinds) in enumerate(_drawn()):
        if kind not in kinds:
            continue
        case = graphgen.generate(seed)
        case.graph.build(options=graphgen.forced_row_mode(case.row_mode))
        if not any(graphgen._allowed_in_place(case.graph, r) for r in case.refusals):
            return case
    raise AssertionError(f"no case draws a refused {kind}")


@pytest.mark.parametrize("kind", ["negated output", "conjugate input", "overlap"])
def test_verdict_reports_a_refused_binding_that_runs(monkeypatch, kind):
    case = _first_refused_case(kind)
    execute = case.graph.execute

    def lenient(bindings, *args, **kwargs):
        try:
            execute(bindings, *args, **kwargs)
        except graphgen.dg.ExecutionError:
            pass

    monkeypatch.setattr(case.graph, "execute", lenient)
    verdict = graphgen.run_case(case)
    assert verdict.status == "binding" and "executed, not refused" in verdict.detail, verdict


def test_an_overlap_the_plan_runs_in_place_is_checked_against_an_execute_apart(monkeypatch):
    """A drawn overlap that is an allowed in-place binding runs; its output must hold what an
    execute into memory of its own writes, so an in-place kernel that wrote wrong values fails."""
    for seed, (_, kinds) in enumerate(_drawn()):
        if "overlap" not in kinds:
            continue
        case = graphgen.generate(seed)
        case.graph.build(options=graphgen.forced_row_mode(case.row_mode))
        allowed = [r for r in case.refusals if graphgen._allowed_in_place(case.graph, r)]
        if allowed:
            break
    else:
        raise AssertionError("no drawn overlap is an allowed in-place binding: the generator no longer covers in-place runs")
    assert graphgen.run_case(case).status == "passed"
    output = graphgen._allowed_in_place(case.graph, allowed[0])[0]
    execute = case.graph.execute

    def corrupting(bindings, *args, **kwargs):
        execute(bindings, *args, **kwargs)
        aliased = bindings[output.name]
        if any(aliased.data_ptr() == bindings[t.name].data_ptr() for t in case.graph.inputs()
               if t.name != output.name and t.name in bindings):
            aliased.fill_(12345.0)

    monkeypatch.setattr(case.graph, "execute", corrupting)
    verdict = graphgen.run_case(case)
    assert verdict.status == "binding" and "differ from an execute into its own memory" in verdict.detail, verdict


def test_the_generator_stores_outputs_narrow_that_other_ops_read():
    # the consumers of such an output must read the stored value, fused or not (DESIGN.md)
    read_narrow = 0
    for seed in range(CPU_GRAPHS):
        graph = graphgen.generate(seed).graph
        read_narrow += any(t.is_output and t.data_type.name in ("float16", "bfloat16") and graph.consumers(t)
                           for t in graph.outputs())
    assert read_narrow >= CPU_GRAPHS // 10, read_narrow


def test_norm_backward_reference_keeps_parameter_shape_when_every_axis_is_normalized():
    # scale covers every axis of x: dscale and dbias are per element, not summed over everything
    g = graphgen.dg.Graph()
    x, s, b = (g.tensor(name=n, dim=[4, 3]) for n in ("x", "s", "b"))
    y, mean, inv = g.layernorm(x, s, b)
    dy = g.tensor(name="dy", dim=[4, 3])
    dx, dscale, dbias = g.layernorm_backward(dy, x, s, mean, inv)
    for t in (dx, dscale, dbias):
        t.set_output(True)
    torch = graphgen.torch
    xt, st, bt, dyt = (torch.randn(4, 3, dtype=torch.float64) for _ in range(4))
    refs = g.reference({"x": xt, "s": st, "b": bt, "dy": dyt})
    leaf_s, leaf_b = st.clone().requires_grad_(True), bt.clone().requires_grad_(True)
    out = torch.nn.functional.layer_norm(xt, [4, 3], leaf_s, leaf_b, eps=1e-5)
    grad_s, grad_b = torch.autograd.grad(out, (leaf_s, leaf_b), dyt)
    assert torch.allclose(refs[dscale.name], grad_s) and torch.allclose(refs[dbias.name], grad_b)


def test_average_pooling_reference_takes_inputs_smaller_than_the_window():
    # valid once padded; torch's 3D average pooling alone would refuse it
    g = graphgen.dg.Graph()
    x = g.tensor(name="x", dim=[1, 2, 5, 1, 1])
    y = g.pooling(x, "avg_exclude_pad", [3, 2, 1], [1, 1, 1], [0, 1, 0]).set_output(True)
    xt = graphgen.torch.randn(1, 2, 5, 1, 1, dtype=graphgen.torch.float64)
    ref = g.reference({"x": xt})[y.name]
    expected = graphgen.torch.nn.functional.avg_pool1d(xt.reshape(1, 2, 5), 3, 1).reshape(1, 2, 3, 1, 1)
    assert graphgen.torch.allclose(ref, expected.expand(1, 2, 3, 2, 1))


def _tanh_matmul_case(w_type):
    """tanh of an fp16 input (an fp32 virtual tensor) times a `w_type` weight, plus a bias."""
    torch, dg = graphgen.torch, graphgen.dg
    g = dg.Graph(io_data_type=dg.float16)
    a = g.tensor(name="a", dim=[3, 2])
    w, bias = g.tensor(name="w", dim=[2, 7], data_type=w_type), g.tensor(name="bias", dim=[1, 7])
    g.add(g.matmul(g.tanh(a), w), bias).set_output(True).set_name("y").set_data_type(dg.float32)
    gen = torch.Generator().manual_seed(202)
    inputs = {"a": torch.randn(3, 2, generator=gen).half(),
              "w": torch.randn(2, 7, generator=gen).to(w_type.torch_dtype),
              "bias": torch.randn(1, 7, generator=gen).half()}
    return graphgen.Case(202, g, inputs, "float16", None)


def test_verdict_allows_the_rounding_of_a_mixed_matmul_operand_and_no_more():
    # DESIGN.md's precision rule: the fp32 tanh output meets an fp16 weight, so the dot runs in
    # fp16 and rounds it at load (kernel accuracy: test_matmul_precision.py). The noise model
    # must allow that rounding (seed 202 failed on it) yet stay at fp32 drift when no operand
    # is rounded (fp32 x fp32 is IEEE).
    torch = graphgen.torch
    mixed, plain = _tanh_matmul_case(graphgen.dg.float16), _tanh_matmul_case(graphgen.dg.float32)
    assert graphgen.run_case(mixed).status == "passed"
    for case, low, high in ((mixed, 1e-4, 4e-3), (plain, 0.0, 1e-6)):
        inputs = case.inputs
        ref = case.graph.reference(inputs)["y"]
        noisy = graphgen.noisy_reference(case.graph, inputs)
        drift = max(((n["y"] - ref).norm() / ref.norm()).item() for n in noisy)
        assert low <= drift < high, (case.graph.nodes[1].inputs[1].data_type.name, drift)


def _attention_case(io_type):
    """sdpa of `io_type` q, k and v, o stored in float32."""
    torch, dg = graphgen.torch, graphgen.dg
    g = dg.Graph(io_data_type=io_type)
    gen = torch.Generator().manual_seed(1006)
    inputs = {n: torch.randn(1, 2, 5, 16, generator=gen).to(io_type.torch_dtype) for n in ("q", "k", "v")}
    q, k, v = (g.tensor_like(inputs[n], n) for n in ("q", "k", "v"))
    g.sdpa(q, k, v)[0].set_output(True).set_name("o").set_data_type(dg.float32)
    return graphgen.Case(1006, g, inputs, io_type.name, None)


def test_verdict_allows_the_rounding_of_attention_probabilities_to_a_16_bit_v():
    # the kernels meet the probabilities with v in v's type (p.to(v.dtype)): an fp16 v rounds
    # them, even when o is stored in float32 (seed 1006 failed on it); an fp32 v does not
    narrow, plain = _attention_case(graphgen.dg.float16), _attention_case(graphgen.dg.float32)
    assert graphgen.run_case(narrow).status == "passed"
    for case, low, high in ((narrow, 1e-4, 2e-3), (plain, 0.0, 1e-6)):
        ref = case.graph.reference(case.inputs)["o"]
        noisy = graphgen.noisy_reference(case.graph, case.inputs)
        drift = max(((n["o"] - ref).norm() / ref.norm()).item() for n in noisy)
        assert low <= drift < high, (case.io, drift)


def test_verdict_allows_one_storage_step_below_the_smallest_normal_number():
    # seed 100253: an fp16 product of 9.8e-7, correctly rounded to 9.54e-7 (a 2.7% relative
    # error: subnormal spacing is absolute). One step is allowed there; two are not.
    torch = graphgen.torch
    ref = torch.tensor([[9.797803951677808e-07]], dtype=torch.float64)
    step = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps
    noisy = [ref * (1 + 1e-3)]
    assert graphgen.compare("y", ref.half(), ref, noisy, 1e-5) == ""
    assert graphgen.compare("y", (ref - 2 * step).half(), ref, noisy, 1e-5) != ""
    assert graphgen.compare("y", (ref * 1.02).float(), ref, noisy, 1e-5) != ""  # fp32 holds it
    # seed 100329: an fp32 product of -9.05e-47, below fp32's smallest subnormal, is stored as -0
    tiny = torch.tensor([[-9.053764005559113e-47]], dtype=torch.float64)
    assert graphgen.compare("y", tiny.float(), tiny, [tiny * (1 + 1e-7)], 1e-5) == ""
