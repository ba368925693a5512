"""Triton kernels that return attention states ``(o, lse)``, and the merge that combines them.

Beside the kernels, their launch policy (``kernels/policy.py``) as the launchers apply
it, for planners that size work ahead of a launch: :func:`decode_num_splits`,
:func:`pick_decode_schedule`, :func:`paged_num_splits` and :func:`groups_tile_config`
(from shapes only).
"""

from cascadeinfer.kernels.append import append_paged_kv_cache
from cascadeinfer.kernels.copy_pages import copy_pages
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.kernels.merge import merge_state, merge_state_in_place
from cascadeinfer.kernels.merge_many import merge_states, merge_states_ragged
from cascadeinfer.kernels.policy import (
    decode_num_splits,
    groups_tile_config,
    paged_num_splits,
    pick_decode_schedule,
)
from cascadeinfer.kernels.prefill import (
    batch_prefill_paged,
    batch_prefill_ragged,
    shared_prefix_attention,
)
from cascadeinfer.kernels.rope_append import append_paged_kv_cache_rope

__all__ = [
    "append_paged_kv_cache",
    "append_paged_kv_cache_rope",
    "batch_decode_paged",
    "batch_prefill_paged",
    "batch_prefill_ragged",
    "copy_pages",
    "decode_num_splits",
    "groups_tile_config",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_ragged",
    "paged_num_splits",
    "pick_decode_schedule",
    "shared_prefix_attention",
]
