"""Graphviz text of a graph: ops as boxes, tensors as ellipses, each kernel's ops in a cluster."""
from __future__ import annotations


def _quoted(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _tensor_label(tensor) -> str:
    kind = "input" if tensor.is_input else "output" if tensor.is_output else "virtual"
    return f"{tensor.name}\n{list(tensor.dim)} {tensor.data_type.name} ({kind})"


def render_dot(graph, groups) -> str:
    """The digraph of `graph` with `groups` (fusion groups, in kernel order) as clusters."""
    lines = [f"digraph {_quoted(graph.name)} {{", '  node [fontname="monospace"];']
    clustered = set()
    for index, group in enumerate(groups):
        members = [group.origin] if group.origin is not None else list(group.nodes)
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f"    label={_quoted(f'kernel {index} [{group.kind}]')}; style=rounded;")
        for node in members:
            if node.uid not in clustered:  # by uid: a plan's groups may hold a snapshot's nodes
                clustered.add(node.uid)
                lines.append(f"    op_{node.uid} [shape=box, label={_quoted(f'{node.op}: {node.name}')}];")
        lines.append("  }")
    for node in graph.nodes:
        if node.uid not in clustered:  # a layout op that is a view: no kernel
            lines.append(f"  op_{node.uid} [shape=box, style=dashed, label={_quoted(f'{node.op}: {node.name} (view)')}];")
    for tensor in graph.tensors:
        style = "filled" if tensor.is_input or tensor.is_output else "dotted"
        lines.append(f"  t_{tensor.uid} [shape=ellipse, style={style}, label={_quoted(_tensor_label(tensor))}];")
    for node in graph.nodes:
        for tensor in node.input_tensors():
            lines.append(f"  t_{tensor.uid} -> op_{node.uid};")
        for tensor in node.output_tensors():
            lines.append(f"  op_{node.uid} -> t_{tensor.uid};")
    lines.append("}")
    return "\n".join(lines) + "\n"
