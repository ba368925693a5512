"""``MultiLevelCascadeAttention``: plan once on the host, run many times on the device.

``run`` launches one kernel per level (tensor-core prefill for levels with many queries
per group, split-KV decode for a last level of one query per request) and merges the
level states. The decode level under a prefill level (the shared-prefix batch decode
case) runs on a side stream while the prefill level, sized to leave it a share of the
SMs, runs on the caller's stream: one is compute-bound, the other bandwidth-bound. Or,
when the planner predicts it is faster, one flat paged decode over
each request's concatenated page list. ``run`` reads nothing back from the device, so
it can be captured in a CUDA graph; re-planning with tables of the same shapes writes
into the same device buffers, so a captured graph replays with the new tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cascadeinfer._checks import FLOAT_DTYPES, check_tensor, default_sm_scale, normalize_device
from cascadeinfer.cascade.plan import HostLevel, choose_cascade, flat_page_table, host_levels
from cascadeinfer.kernels.decode import pick_decode_schedule
from cascadeinfer.kernels.prefill import paged_num_splits
from cascadeinfer.ops import split_cache
from cascadeinfer.layouts.paged_cache import check_kv_layout, check_layout_fits, unpack_paged_kv_cache


@dataclass(slots=True)
class _DeviceLevel:
    """One level's int32 metadata on the device; ``decode`` when every group has one query."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    decode: bool
    num_splits: int | None = None  # prefill levels: KV splits (None: the kernel's default)
    schedule: str | None = None  # decode levels: batch_decode_paged's schedule (None: from shapes)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len


def _device_level(level: HostLevel, device: torch.device, old: _DeviceLevel | None) -> _DeviceLevel:
    tensors = [t.to(device=device, dtype=torch.int32)
               for t in (level.qo_indptr, level.kv_indptr, level.kv_indices, level.kv_last_page_len)]
    q_per_group = level.qo_indptr[1:] - level.qo_indptr[:-1]
    decode = bool((q_per_group == 1).all())
    if old is not None and all(o.shape == n.shape for o, n in zip(old.tensors(), tensors)):
        for o, n in zip(old.tensors(), tensors):
            o.copy_(n)  # in place: a graph captured on these buffers sees the new tables
        old.decode = decode
        old.num_splits = None
        old.schedule = None
        return old
    return _DeviceLevel(*tensors, decode=decode)


class MultiLevelCascadeAttention:
    """Attention over a KV cache split into levels, each level's state merged into one.

    Args:
        num_levels: number of levels (≥ 1); level 0 is the most shared (e.g. a system
            prompt for all requests), the last is each request's own suffix.
        kv_layout: ``"NHD"`` or ``"HND"``, the layout of the paged cache given to ``run``.
        device: where the metadata lives (default: CUDA if available, else CPU).

    Example (two levels, shared-prefix batch decode)::

        attn = MultiLevelCascadeAttention(2)
        attn.plan([shared_qo_indptr, unique_qo_indptr], [shared_kv_indptr, unique_kv_indptr],
                  [shared_kv_indices, unique_kv_indices], [shared_last, unique_last],
                  num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
        o, lse = attn.run(q, paged_kv_cache, return_lse=True)
    """

    def __init__(self, num_levels: int, *, kv_layout: str = "NHD", device: torch.device | str | None = None):
        if not isinstance(num_levels, int) or isinstance(num_levels, bool) or num_levels < 1:
            raise ValueError(f"num_levels: expected a positive int, got {num_levels!r}")
        self.num_levels = num_levels
        self.kv_layout = check_kv_layout(kv_layout)
        self.device = normalize_device(device if device is not None else (
            "cuda" if torch.cuda.is_available() else "cpu"))
        self._levels: list[_DeviceLevel] = []
        self._flat: _DeviceLevel | None = None
        self._overlap = False
        self._stream: torch.cuda.Stream | None = None
        self._planned = False

    def plan(
        self,
        qo_indptr_arr: Sequence[torch.Tensor],
        kv_indptr_arr: Sequence[torch.Tensor],
        kv_indices_arr: Sequence[torch.Tensor],
        kv_last_page_len_arr: Sequence[torch.Tensor],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        num_pages: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        use_cascade: bool | None = None,
    ) -> None:
        """Validate the levels on the host and lay out the metadata for :meth:`run`.

        Args:
            qo_indptr_arr: per level, int32 ``[groups_l + 1]`` splitting the query tokens
                into that level's groups. Every level covers the same tokens, and each group
                lies inside one group of every level above it.
            kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr: per level, the CSR page
                table of its groups (DESIGN.md conventions). A group may have no pages.
            num_qo_heads, num_kv_heads, head_dim, page_size: the geometry ``run`` will see.
            causal: causal mask on the last level (its last query aligned with its last key);
                the levels above are always fully visible.
            sm_scale: default softmax scale for ``run`` (``head_dim ** -0.5`` if None).
            num_pages: pool size, to check that every page index lies inside it.
            dtype: the cache dtype, for the cost model's byte count.
            use_cascade: force cascade (True) or flat decode (False); None lets the cost
                model choose. Flat needs every level above the last to end on a full page
                (or be empty); where it cannot, cascade is used and forcing flat raises.

        This reads the tables on the host (a sync): call it once per batch shape change,
        not per layer. Re-planning with tables of the same shapes updates the device
        buffers in place, so a CUDA graph captured around :meth:`run` stays valid.
        """
        for name, x in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"{name}: expected a positive int, got {x!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads: {num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        levels = host_levels(qo_indptr_arr, kv_indptr_arr, kv_indices_arr, kv_last_page_len_arr,
                             self.num_levels, page_size, num_pages)
        if causal:
            last = levels[-1]
            short = (last.qo_indptr[1:] - last.qo_indptr[:-1]) > last.kv_lens(page_size)
            if bool(short.any()):
                g = int(torch.nonzero(short)[0])
                raise ValueError(
                    f"qo_indptr_arr[{self.num_levels - 1}]: with causal=True each last-level group's queries must be "
                    f"its last keys, but group {g} has more queries than keys")
        cascade, self.predicted_cascade_s, self.predicted_flat_s, prefix_share = choose_cascade(
            levels, page_size=page_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, elem_bytes=torch.empty((), dtype=dtype).element_size(), device=self.device,
        )
        if use_cascade is not None:
            cascade = use_cascade
        flat = None
        if not cascade and self.num_levels > 1:  # the flat table is built only when flat is wanted
            flat = flat_page_table(levels, page_size)
            if flat is None:
                if use_cascade is False:
                    raise ValueError("use_cascade: flat decode needs every level above the last to end on a full page")
                cascade = True
        self.use_cascade = cascade or self.num_levels == 1
        self._overlap = False
        if self.use_cascade:
            old = self._levels if len(self._levels) == self.num_levels else [None] * self.num_levels
            self._levels = [_device_level(lv, self.device, o) for lv, o in zip(levels, old)]
            # The decode level runs on a side stream beside the prefill level above it; that
            # level's grid is sized to leave the decode its share of the SMs (from shapes).
            # The planner gives a share only where the prefill level is compute-bound: 64- or
            # 128-row tiles (cost.side_stream_runs), one or two programs per SM, so a smaller
            # grid leaves SMs free. Groups of a few rows (16-32-row tiles) keep one stream.
            self._overlap = prefix_share is not None and self.device.type == "cuda"
            if self._overlap:
                pre = levels[-2]
                self._levels[-2].num_splits = paged_num_splits(
                    int(pre.qo_indptr[-1]), pre.num_groups, num_qo_heads, num_kv_heads, head_dim, dtype,
                    pre.kv_indices.numel() * page_size, self.device, sm_share=prefix_share)
        else:
            self._flat = _device_level(flat, self.device, self._flat)
        # A decode level's schedule from its lengths, known here on the host: the balanced
        # one when they vary a lot or the per-request grid ends in a partial wave.
        dev_level, host_level = (self._levels[-1], levels[-1]) if self.use_cascade else (self._flat, flat)
        if dev_level.decode:
            dev_level.schedule = pick_decode_schedule(
                host_level.num_groups, num_kv_heads, self.device, head_dim=head_dim, dtype=dtype,
                seq_lens=host_level.kv_lens(page_size))
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.num_tokens = int(levels[0].qo_indptr[-1])
        self.causal = bool(causal)
        self.sm_scale = default_sm_scale(head_dim, sm_scale)
        self._planned = True

    def _level_state(self, level: _DeviceLevel, q, k_cache, v_cache, causal, sm_scale, out, lse) -> None:
        """One level's state into ``out``/``lse``, through the custom ops (see cascadeinfer.ops)."""
        if level.decode:
            # One query per group: causal changes nothing (the query sees every key).
            torch.ops.cascadeinfer.batch_decode_paged(
                q, k_cache, v_cache, level.kv_indptr, level.kv_indices, level.kv_last_page_len,
                self.kv_layout, sm_scale, None, out, lse, level.schedule)
        else:
            torch.ops.cascadeinfer.batch_prefill_paged(
                q, level.qo_indptr, k_cache, v_cache, level.kv_indptr, level.kv_indices,
                level.kv_last_page_len, causal, self.kv_layout, sm_scale, level.num_splits, out, lse)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _merged_levels(self, levels, q, k_cache, v_cache, sm_scale):
        """The merged state of ``levels`` (none of them the last, so never causal)."""
        o_acc, lse_acc = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        self._level_state(levels[0], q, k_cache, v_cache, False, sm_scale, o_acc, lse_acc)
        for level in levels[1:]:
            o_i, lse_i = torch.empty_like(o_acc), torch.empty_like(lse_acc)
            self._level_state(level, q, k_cache, v_cache, False, sm_scale, o_i, lse_i)
            o_next, lse_next = torch.empty_like(o_acc), torch.empty_like(lse_acc)
            torch.ops.cascadeinfer.merge_state(o_acc, lse_acc, o_i, lse_i, o_next, lse_next)
            o_acc, lse_acc = o_next, lse_next
        return o_acc, lse_acc

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        sm_scale: float | None = None,
    ):
        """Attention of ``q: [num_tokens, num_qo_heads, head_dim]`` over all levels.

        Args:
            q: the query tokens of the plan, fp16/bf16/fp32, last dim contiguous.
            paged_kv_cache: the paged cache (single tensor or ``(k, v)``) in the planned layout.
            out: optional output buffer like ``q``.
            lse: optional float32 ``[num_tokens, num_qo_heads]`` buffer for the LSE.
            return_lse: return ``(o, lse)`` instead of ``o``.
            sm_scale: this call's softmax scale (one plan serves every layer).

        Returns ``o`` (like ``q``), or ``(o, lse)`` with the natural-log LSE in float32;
        a token that sees no key gets ``(0, -inf)``. No host synchronisation.
        """
        if not self._planned:
            raise RuntimeError("MultiLevelCascadeAttention.run called before plan()")
        check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=self.device,
                     shape=(self.num_tokens, self.num_qo_heads, self.head_dim))
        kv = unpack_paged_kv_cache(paged_kv_cache, self.kv_layout)
        check_layout_fits(kv, num_kv_heads=self.num_kv_heads, page_size=self.page_size)
        if (kv.page_size, kv.num_kv_heads, kv.head_dim) != (self.page_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"paged_kv_cache: planned for page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}; got {kv.page_size}, {kv.num_kv_heads}, {kv.head_dim}")
        scale = self.sm_scale if sm_scale is None else default_sm_scale(self.head_dim, sm_scale)
        if out is None:
            out = torch.empty_like(q)
        if lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        k_cache, v_cache = split_cache(paged_kv_cache)
        if not self.use_cascade:
            self._level_state(self._flat, q, k_cache, v_cache, self.causal, scale, out, lse)
        elif self.num_levels == 1:
            self._level_state(self._levels[0], q, k_cache, v_cache, self.causal, scale, out, lse)
        else:
            o_last, lse_last = torch.empty_like(q), torch.empty_like(lse)
            last = lambda: self._level_state(  # noqa: E731
                self._levels[-1], q, k_cache, v_cache, self.causal, scale, o_last, lse_last)
            side = self._side_stream() if self._overlap and not torch.compiler.is_compiling() else None
            if side is None:
                o_up, lse_up = self._merged_levels(self._levels[:-1], q, k_cache, v_cache, scale)
                last()
            else:
                # Prefill levels (compute-bound, on the current stream) first, so that their
                # programs take their share of the SMs; the decode level (bandwidth-bound)
                # fills the others from a side stream. Both streams only read q and the cache.
                main = torch.cuda.current_stream(q.device)
                side.wait_stream(main)
                o_up, lse_up = self._merged_levels(self._levels[:-1], q, k_cache, v_cache, scale)
                with torch.cuda.stream(side):
                    last()
                main.wait_stream(side)
            torch.ops.cascadeinfer.merge_state(o_up, lse_up, o_last, lse_last, out, lse)
        return (out, lse) if return_lse else out
