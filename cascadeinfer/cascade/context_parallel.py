"""Context parallelism for a cascade level: each rank of a group takes a share of every
group's pages, and the level's states are merged across the ranks.

Attention over a set of keys is the merge of the states over any partition of it, so a
level whose pages are cut across ranks gives the same state, once merged
(:func:`cascadeinfer.distributed.merge_states_across`), as the level computed whole. The
share is contiguous and page-aligned: rank ``r`` of ``w`` takes pages
``[P * r // w, P * (r + 1) // w)`` of a group of ``P`` pages (some ranks get none of a
short group's); only the rank holding a group's last page sees its partial length.
"""

from __future__ import annotations

import numpy as np

from cascadeinfer.cascade.plan import LevelArrays


def page_share(level: LevelArrays, rank: int, world: int) -> LevelArrays:
    """Rank ``rank``'s share (of ``world``) of every group's pages of ``level``.

    The groups and their queries stay as they are; a group's share may be empty (no pages,
    last-page length 0), and its state is then ``(0, -inf)``, the merge's identity.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world ({world}), got {rank}")
    pages = level.pages
    start = level.kv_indptr[:-1].astype(np.int64)
    lo = start + pages * rank // world
    hi = start + pages * (rank + 1) // world
    counts = hi - lo
    indptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    # every kept page's position in the level's kv_indices, in order
    where = np.repeat(lo - indptr[:-1], counts) + np.arange(int(indptr[-1]), dtype=np.int64)
    holds_last = (hi == start + pages) & (counts > 0)
    last = np.where(counts == 0, 0, np.where(holds_last, level.kv_last_page_len, level.page_size))
    return LevelArrays.build(level.qo_indptr, indptr.astype(np.int32), level.kv_indices[where].astype(np.int32),
                             last.astype(np.int32), level.page_size, level.num_pages, parent=level.parent)
