"""Dead-code elimination that keeps writes. FX's own treats every Tensor method call as pure, so a
write whose result nobody reads was dropped: ``keys.index_copy_(2, positions, k)``, a static KV
cache's update, vanished and attention read the cache's zeros (a Llama prompt through
``StaticCache``: logits cosine 0.09 against eager)."""
from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

# x[i] = v, x += v, ...: Python's in-place operators, which Dynamo records as calls
_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul}


def writes(node: Node) -> bool:
    """``node`` may write into a tensor: FX's impure nodes, in-place Tensor methods and functions
    (torch's trailing underscore: ``add_``, ``index_copy_``, ``torch.relu_``), in-place operators."""
    if node.is_impure():
        return True
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (isinstance(name, str) and name.endswith("_") and not name.endswith("__")) or node.target in _IN_PLACE_OPERATORS


def eliminate_dead_code(gm: GraphModule) -> bool:
    """``gm.graph.eliminate_dead_code`` keeping every node that ``writes``."""
    return gm.graph.eliminate_dead_code(is_impure_node=writes)
