"""``merge_states_across``: the merged attention state of every rank's part of the keys."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cascadeinfer._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor
from cascadeinfer.kernels.merge_many import merge_states


def merge_states_across(
    o: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention states that the ranks of ``group`` hold of the same rows.

    Every rank holds the state of the same ``n`` query rows over its own part of the keys
    (e.g. its share of a long prefix's pages) and calls this with tensors of the same
    shapes and dtypes (a collective). Each rank gets the state over all the parts: the
    states are gathered (one all-gather of both, as bytes) and merged locally by
    :func:`~cascadeinfer.kernels.merge_many.merge_states`, in rank order on every rank, so every
    rank gets the same bits.

    Args:
        o: ``[n, H, D]`` fp16/bf16/fp32, last dim contiguous (it is copied once, with
            ``lse``, into the one buffer the collective sends).
        lse: ``[n, H]`` float32, NATURAL-log sum of exp of the scaled scores; ``-inf`` marks
            an empty part (a rank that saw none of a row's keys holds ``(0, -inf)``, which
            changes nothing and never gives NaN).
        group: the process group (default: the default group).
        out, out_lse: optional ``[n, H, D]`` (``o``'s dtype) and ``[n, H]`` float32 outputs.

    Returns:
        ``(o [n, H, D], lse [n, H])``, the LSE float32, natural log. A row no rank saw a
        key of gives ``(0, -inf)``.
    """
    check_tensor("o", o, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous("o", o)
    check_tensor("lse", lse, dtypes=(torch.float32,), device=o.device, shape=tuple(o.shape[:2]))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("merge_states_across: torch.distributed is not initialised (init_process_group first)")
    world = dist.get_world_size(group)
    # One collective, not two: each rank's o and lse go as the bytes of one row of a
    # [world, bytes] buffer (o first, padded so that the lse that follows is 4-byte aligned).
    o_bytes = o.numel() * o.element_size()
    at = -(-o_bytes // 4) * 4
    row = at + lse.numel() * 4
    mine = torch.empty(row, dtype=torch.uint8, device=o.device)
    mine[:o_bytes].view(o.dtype).view(o.shape).copy_(o)
    mine[at:].view(torch.float32).view(lse.shape).copy_(lse)
    rows = torch.empty((world, row), dtype=torch.uint8, device=o.device)
    if o.device.type == "cuda":  # NCCL gathers straight into the buffer
        dist.all_gather_into_tensor(rows, mine, group=group)
    else:
        dist.all_gather(list(rows.unbind(0)), mine, group=group)
    all_o = rows[:, :o_bytes].view(o.dtype).view(world, *o.shape)
    all_lse = rows[:, at:].view(torch.float32).view(world, *lse.shape)
    return merge_states(all_o.transpose(0, 1), all_lse.transpose(0, 1), out=out, out_lse=out_lse)
