"""Triton kernels that return attention states ``(o, lse)``, and the merge that combines them."""

from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.decode import batch_decode_paged, decode_num_splits, pick_decode_schedule
from cascadeinfer.kernels.merge import merge_state, merge_state_in_place, merge_states, merge_states_ragged
from cascadeinfer.kernels.prefill import batch_prefill_paged, batch_prefill_ragged, shared_prefix_attention

__all__ = [
    "append_paged_kv_cache",
    "batch_decode_paged",
    "batch_prefill_paged",
    "batch_prefill_ragged",
    "decode_num_splits",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_ragged",
    "pick_decode_schedule",
    "shared_prefix_attention",
]
