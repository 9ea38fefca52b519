"""Random graphs across every family with kernels, compared with the float64 reference.

Each seed is one graph (tests/graphgen.py): reproduce a failure with
`python -c "import graphgen; c = graphgen.generate(SEED); print(c.describe()); print(graphgen.run_case(c))"`
from tests/. A graph that no kernel can run yet is skipped with its reason, never passed.
"""
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


def test_the_generator_covers_every_family():
    ops = set()
    for seed in range(CPU_GRAPHS):
        ops.update(node.op for node in graphgen.generate(seed).graph.nodes)
    expected = {"reduction", "softmax", "softmax_backward", "layernorm", "rmsnorm", "batchnorm",
                "batchnorm_inference", "instancenorm", "groupnorm", "genstats", "layernorm_backward",
                "rmsnorm_backward", "batchnorm_backward", "instancenorm_backward",
                "groupnorm_backward", "pooling", "pooling_backward", "dropout", "matmul", "where",
                "cast", "logical_and", "logical_or", "logical_not", "cmp_lt", "add", "pow", "div"}
    assert expected <= ops, sorted(expected - ops)
