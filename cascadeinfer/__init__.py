"""cascadeinfer: Triton kernels for cascade attention.

Every kernel returns an attention state ``(o, lse)`` with a natural-log, float32 LSE of
shape ``[tokens, heads]``; states merge associatively. See DESIGN.md for the contract.
"""

from cascadeinfer.cascade import MultiLevelCascadeAttention
from cascadeinfer.kernels import (
    append_paged_kv_cache,
    append_paged_kv_cache_rope,
    batch_decode_paged,
    batch_prefill_paged,
    batch_prefill_ragged,
    merge_state,
    merge_state_in_place,
    merge_states,
    merge_states_ragged,
    pick_decode_schedule,
    shared_prefix_attention,
)
from cascadeinfer.layouts import PagedKVPool, PageTable, get_batch_indices_positions, get_seq_lens

__version__ = "0.1.0"

__all__ = [
    "MultiLevelCascadeAttention",
    "PageTable",
    "PagedKVPool",
    "append_paged_kv_cache",
    "append_paged_kv_cache_rope",
    "batch_decode_paged",
    "batch_prefill_paged",
    "batch_prefill_ragged",
    "get_batch_indices_positions",
    "get_seq_lens",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_ragged",
    "pick_decode_schedule",
    "shared_prefix_attention",
]
