"""A directed graph of hashable nodes, for the orders a build computes (node order, group order,
a document's node order), without importing networkx (0.18 s and ~290 modules per process).

The two sorts give exactly networkx 3's orders for the same insertion order of nodes and edges
(tests/api/test_dag.py compares them): `topological_sort` is networkx's `topological_sort`
(generation by generation, each in insertion order) and `lexicographical_topological_sort` is its
heap-based namesake (least key first, ties by insertion order). A cycle raises CycleError.
`Graph.to_networkx()` still gives a networkx DiGraph to users who ask for one.
"""
from __future__ import annotations

import heapq


class CycleError(ValueError):
    """The graph has a cycle: it has no topological order."""


class Dag:
    """Nodes in insertion order; successors and predecessors of each in edge insertion order; an
    edge added twice is one edge (as in networkx's DiGraph)."""

    def __init__(self, nodes=()):
        self._succ: dict = {}
        self._pred: dict = {}
        self.add_nodes_from(nodes)

    def add_node(self, node) -> None:
        if node not in self._succ:
            self._succ[node] = {}
            self._pred[node] = {}

    def add_nodes_from(self, nodes) -> None:
        for node in nodes:
            self.add_node(node)

    def add_edge(self, source, target) -> None:
        self.add_node(source)
        self.add_node(target)
        self._succ[source][target] = None
        self._pred[target][source] = None

    def __iter__(self):
        return iter(self._succ)

    def __len__(self) -> int:
        return len(self._succ)

    def __contains__(self, node) -> bool:
        return node in self._succ

    def successors(self, node):
        return iter(self._succ[node])

    def predecessors(self, node):
        return iter(self._pred[node])

    def edges(self):
        return [(source, target) for source, targets in self._succ.items() for target in targets]

    def topological_sort(self) -> list:
        """Nodes, each after its predecessors: generation by generation, in insertion order."""
        indegree = {node: len(pred) for node, pred in self._pred.items() if pred}
        ready = [node for node, pred in self._pred.items() if not pred]
        order = []
        while ready:
            generation, ready = ready, []
            for node in generation:
                for child in self._succ[node]:
                    indegree[child] -= 1
                    if indegree[child] == 0:
                        ready.append(child)
                        del indegree[child]
            order.extend(generation)
        if indegree:
            raise CycleError("the graph contains a cycle")
        return order

    def lexicographical_topological_sort(self, key=None) -> list:
        """Nodes, each after its predecessors, the ready node of least `key` first (ties: the
        one added first)."""
        key = key or (lambda node: node)
        position = {node: index for index, node in enumerate(self._succ)}
        indegree = {node: len(pred) for node, pred in self._pred.items() if pred}
        ready = [(key(node), position[node], node) for node, pred in self._pred.items() if not pred]
        heapq.heapify(ready)
        order = []
        while ready:
            _, _, node = heapq.heappop(ready)
            for child in self._succ[node]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    heapq.heappush(ready, (key(child), position[child], child))
                    del indegree[child]
            order.append(node)
        if indegree:
            raise CycleError("the graph contains a cycle")
        return order


def node_dag(nodes) -> Dag:
    """The DAG of graph nodes `nodes` (in graph order): an edge producer -> consumer per input
    tensor made by another node (Graph.to_networkx's edges, in the same order)."""
    dag = Dag(nodes)
    for node in nodes:
        for tensor in node.input_tensors():
            if tensor.producer is not None:
                dag.add_edge(tensor.producer, node)
    return dag
