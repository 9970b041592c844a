"""A graph with its params' names wiped, for tests that passes find what they rewrite from the
dataflow alone, not from HF param names."""

from llmc.compiler.ir import Graph


def renamed(graph: Graph) -> Graph:
    """A copy of `graph` with every param called p0, p1, ... (no layer or projection names left to read)."""
    g = graph.copy()
    names = {old: f"p{i}" for i, old in enumerate(g.params)}
    g.params = {names[k]: p for k, p in g.params.items()}
    for new, p in g.params.items():
        p.name = new
    g.weights = {names[k]: w for k, w in g.weights.items()}
    for node in g.nodes:
        node.inputs = [names.get(i, i) for i in node.inputs]
    g.verify()
    return g
