"""Context-parallel decode: a KV cache sharded along the sequence across the ranks of a process group, each rank's
attention state merged exactly with ⊕ (Note [Context-parallel decode] in ``distributed/decode.py``).

``decode`` holds the context-parallel calls, ``cache`` the sharded cache, ``shard`` the placements,
``exchange`` how states travel between ranks and ``agree`` the checks of what must be equal on every rank.
"""
from .cache import CPKVCache
from .decode import all_gather_states, cp_cascade_decode, cp_flash_decode, init_distributed, merge_across_ranks
from .exchange import set_exchange
from .shard import shard_kv

__all__ = ["all_gather_states", "merge_across_ranks", "shard_kv", "cp_flash_decode", "cp_cascade_decode", "CPKVCache",
           "init_distributed", "set_exchange"]
