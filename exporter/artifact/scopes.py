"""torch.onnx's name scopes, recorded in each node's metadata: which module of the reference model a node computes.

The export reads them to grow a deep model's graph layer by layer and to keep MoE routers float; the verification
reads them to name the module of a weight or of the first diverging node.
"""

from __future__ import annotations

import ast
import re

import onnx

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# The module scope of a MoE router (MiniMind's `...layers.{i}.mlp.gate`): its scores pick the experts; the routing
# checks find it by this, and quantization leaves it float.
ROUTER_SCOPE = re.compile(r"layers\.(\d+)\.mlp\.gate$")


def parse_scopes(entry: str | None) -> list[str] | None:
    """torch.onnx's name scopes of a node (its SCOPES_KEY metadata, a Python list literal), or None where the node
    has none or they do not parse."""
    if entry is None:
        return None
    try:
        scopes = ast.literal_eval(entry)
    except (ValueError, SyntaxError):
        return None
    return scopes if isinstance(scopes, list) else None


def module_of(node: onnx.NodeProto) -> str | None:
    """The reference module path of a node from torch.onnx's name scopes, e.g. 'model.layers.1.self_attn.k_proj'.

    The scopes run from the exported wrapper ('') through its child holding the model ('model') down to the op
    itself (last), so the module is the second to last scope with the wrapper's child stripped.
    """
    scopes = parse_scopes(next((p.value for p in node.metadata_props if p.key == SCOPES_KEY), None))
    if scopes is None:
        return None
    if len(scopes) < 3:
        return ""
    root, path = scopes[1], scopes[-2]
    return path[len(root) + 1 :] if path.startswith(root + ".") else ""
