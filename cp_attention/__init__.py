"""cp_attention: exact decode attention over long KV caches, on one GPU and across GPUs.

Every piece of attention work returns an attention state ``(o, lse)``; states of disjoint key sets merge
exactly with ⊕ (:func:`merge`). See ``state.py`` for the algebra.
"""
from .cascade import CascadeLevel, cascade_decode
from .decode import flash_decode
from .quant import quantize_kv
from .state import AttentionState, lse_from_base2, lse_to_base2, merge, merge_states

__all__ = [
    "AttentionState",
    "merge",
    "merge_states",
    "lse_to_base2",
    "lse_from_base2",
    "flash_decode",
    "quantize_kv",
    "CascadeLevel",
    "cascade_decode",
]
