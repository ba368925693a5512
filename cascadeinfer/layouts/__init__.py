"""NHD/HND paged caches, ragged indptr tensors, CSR page tables and the paged KV pool."""

from cascadeinfer.layouts.indptr import indptr_from_lengths, lengths_from_indptr, validate_indptr
from cascadeinfer.layouts.page_table import (
    PageTable,
    get_batch_indices_positions,
    get_seq_lens,
    validate_page_table,
)
from cascadeinfer.layouts.paged_cache import PagedKV, gather_paged_kv, unpack_paged_kv_cache
from cascadeinfer.layouts.pool import OutOfPagesError, PagedKVPool, copy_pages_torch

__all__ = [
    "OutOfPagesError",
    "PageTable",
    "PagedKV",
    "PagedKVPool",
    "copy_pages_torch",
    "gather_paged_kv",
    "get_batch_indices_positions",
    "get_seq_lens",
    "indptr_from_lengths",
    "lengths_from_indptr",
    "unpack_paged_kv_cache",
    "validate_indptr",
    "validate_page_table",
]
