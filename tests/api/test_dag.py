"""dnngraph/dag.py gives networkx's orders, and neither `import dnngraph` nor a build imports
networkx, torch._dynamo or Gluon (each is a cost a build does not need)."""
import random
import subprocess
import sys

import networkx as nx
import pytest

from dnngraph.dag import CycleError, Dag


def _random_dag(seed):
    rng = random.Random(seed)
    count = rng.randint(1, 30)
    names = rng.sample(range(1000), count)  # insertion order unlike the keys' order
    edges = [(names[i], names[j]) for i in range(count) for j in range(i + 1, count) if rng.random() < 0.15]
    rng.shuffle(edges)
    edges += edges[: len(edges) // 4]  # an edge added twice is one edge
    rng.shuffle(names)  # nodes added out of dependency order, as a document may list them
    return names, edges


@pytest.mark.parametrize("seed", range(60))
def test_orders_are_networkx_orders(seed):
    names, edges = _random_dag(seed)
    ours, theirs = Dag(names), nx.DiGraph()
    theirs.add_nodes_from(names)
    for source, target in edges:
        ours.add_edge(source, target)
        theirs.add_edge(source, target)
    assert ours.topological_sort() == list(nx.topological_sort(theirs))
    assert ours.lexicographical_topological_sort() == list(nx.lexicographical_topological_sort(theirs))
    key = {n: (n * 7919) % 13 for n in names}.__getitem__  # ties broken by insertion order
    assert ours.lexicographical_topological_sort(key=key) == list(
        nx.lexicographical_topological_sort(theirs, key=key))
    for node in names:
        assert list(ours.predecessors(node)) == list(theirs.predecessors(node))
        assert list(ours.successors(node)) == list(theirs.successors(node))


def test_cycle_raises():
    dag = Dag([1, 2, 3])
    dag.add_edge(1, 2)
    dag.add_edge(2, 3)
    dag.add_edge(3, 2)
    with pytest.raises(CycleError):
        dag.topological_sort()
    with pytest.raises(CycleError):
        dag.lexicographical_topological_sort()


NOT_IMPORTED = ("networkx", "torch._dynamo", "torch._inductor", "triton.experimental.gluon",
                "dnngraph.torch_backend", "dnngraph.backends.gluon.library")

_BUILD = """
import sys
import dnngraph as dg
imported = {name for name in NOT_IMPORTED if name in sys.modules}
g = dg.Graph()
a, w = g.tensor(name="a", dim=[8, 8]), g.tensor(name="w", dim=[8, 8])
g.relu(g.matmul(a, w)).set_output(True)
g.build()
g2 = dg.Graph.from_json(g.to_json())
imported |= {name for name in NOT_IMPORTED if name in sys.modules}
print(sorted(imported))
"""


def test_import_and_build_import_nothing_they_do_not_need(tmp_path):
    """A process that imports dnngraph, builds a graph and reads a document back imports none of
    NOT_IMPORTED (a module made lazy that comes back fails here)."""
    code = f"NOT_IMPORTED = {NOT_IMPORTED!r}\n" + _BUILD
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "DNNGRAPH_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
