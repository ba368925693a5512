"""Can a decode level with many page streams per SM read at the SM's rate beside the prefix level?

    python -m benchmarks.tools.probe_decode_streams [--shapes B,P,S ...] [--streams 4 8 12] [--programs 68 132]
        [--json PATH]

The decode kernels tried so far stream about 38 GB/s per SM wherever they run: 8 one-warp
programs an SM, each a chain of page steps too slow to keep more bytes coming
(benchmarks/NOTES.md, "Cascade" v15), while one SM can read 100 GB/s and 68 SMs the whole
GPU's rate. ``decode_streams`` tries more chains per SM: one persistent program per SM
(``--programs`` of them), each ``STREAMS`` one-warp page streams (the worker partitions; the
default partition's 4 warps, which Gluon requires, idle); stream ``w`` of program ``p`` takes the (request, kv head) items
``p * STREAMS + w``, then every ``programs * STREAMS``-th, its pages by TMA into its own
ring of two slots (one page's K and V a slot), issued across item boundaries so the ring
never drains between items, and ``tma_decode_t``'s step on each page (keys on the M side
of ``mma.sync``, the query group on an 8-wide N side, 95 registers). Per shape (default:
the engine's decode batch), CUDA-graph times over pools rotated past L2: the decode level
alone, the prefix level alone on one split (64 programs here), the public cascade, and
``decode_streams`` for each ``--streams`` on each ``--programs`` count, alone and (68
programs) on a side stream beside that prefix level; each checked against
``batch_decode_paged``. Compute capability 9.0 only; bf16, head_dim 128, page size 16,
groups of at most 8, every request with at least one page.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from benchmarks._common import environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import PAGE, level_alone_calls, ours, shape_tool_start, shape_workloads
from benchmarks.tools.probe_tma_read import _issue_page, beside, page_descriptors, prefix_calls
from cascadeinfer.kernels.constants import KERNEL_LN2

ENGINE_SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384")
SLOTS = ttgl.constexpr(2)  # page slots per stream
STREAM_REGS = 128


@gluon.jit
def _issue(desc, k_bufs, v_bufs, bars, slot, page, item, num_kv_heads, PAGE_SIZE: ttgl.constexpr,
           HND: ttgl.constexpr):
    """Page ``page``'s K and V of item ``item``'s kv head into ``slot``: NHD pools as rows of
    ``Hkv x HEAD_DIM`` (the head a column offset), HND pools as rows of ``HEAD_DIM`` (the
    head's ``PAGE_SIZE`` rows one contiguous block)."""
    HEAD_DIM: ttgl.constexpr = k_bufs.shape[2]
    head = item % num_kv_heads
    if HND:
        mbarrier.expect(bars.index(slot), 2 * PAGE_SIZE * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(desc, [(page * 2 * num_kv_heads + head) * PAGE_SIZE, 0], bars.index(slot),
                                        k_bufs.index(slot))
        tma.async_copy_global_to_shared(desc, [((page * 2 + 1) * num_kv_heads + head) * PAGE_SIZE, 0],
                                        bars.index(slot), v_bufs.index(slot))
    else:
        _issue_page(desc, k_bufs, v_bufs, bars, slot, page, head * HEAD_DIM, PAGE_SIZE, HEAD_DIM)


@gluon.jit
def _stream(q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
            pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
            W: ttgl.constexpr, STREAMS: ttgl.constexpr, GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr,
            HND: ttgl.constexpr):
    """Stream ``W`` of this program: its items one after another, pages issued ``SLOTS``
    ahead through the item boundaries."""
    HEAD_DIM: ttgl.constexpr = k_bufs.shape[2]
    SLOTS_W: ttgl.constexpr = k_bufs.shape[0] // STREAMS
    base = W * SLOTS_W
    first = pid * STREAMS + W
    stride = programs * STREAMS
    n_mine = ttgl.cdiv(ttgl.maximum(n_items - first, 0), stride)

    # The issue cursor: item index ii of this stream, its page ij, the item's first page
    # entry and page count, its kv head's column. Advanced once per page issued.
    ii = n_mine * 0
    ij = n_mine * 0
    i_item = first
    i_start = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads, mask=n_mine > 0, other=0)
    i_n = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads + 1, mask=n_mine > 0, other=0) - i_start
    for s in ttgl.static_range(SLOTS_W):
        if ii < n_mine:
            _issue(desc, k_bufs, v_bufs, bars, base + s, ttgl.load(kv_indices_ptr + i_start + ij), i_item,
                   num_kv_heads, PAGE_SIZE, HND)
            ij += 1
            if ij == i_n:
                ii += 1
                ij = ij * 0
                i_item += stride
                nxt = ii < n_mine
                i_start = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads, mask=nxt, other=0)
                i_n = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads + 1, mask=nxt, other=0) - i_start

    mma_l: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    ld: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [16, 2], [1, 1], [0, 1])
    dq = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(1, ld))
    nq = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, ld))
    s_zero = ttgl.zeros([PAGE_SIZE, 8], ttgl.float32, layout=mma_l)
    keys = ttgl.arange(0, PAGE_SIZE, layout=ttgl.SliceLayout(1, mma_l))
    d = ttgl.arange(0, HEAD_DIM, layout=ttgl.SliceLayout(1, mma_l))
    n = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, mma_l))
    c = n_mine * 0  # pages consumed by this stream
    for it in range(n_mine):
        item = first + it * stride
        request = item // num_kv_heads
        head = item % num_kv_heads
        q_off = request.to(ttgl.int64) * stride_qt + (head * GROUP + nq).to(ttgl.int64) * stride_qh
        qt = ttgl.load(q_ptr + (ttgl.expand_dims(dq, 1) + ttgl.expand_dims(q_off, 0)),
                       mask=ttgl.expand_dims(nq < GROUP, 0), other=0.0)
        qt = ttgl.convert_layout(qt, b_l)
        n_pages = ttgl.load(kv_indptr_ptr + request + 1) - ttgl.load(kv_indptr_ptr + request)
        last_len = ttgl.load(kv_last_ptr + request)
        m_i = ttgl.full([8], float("-inf"), ttgl.float32, layout=ttgl.SliceLayout(0, mma_l))
        l_i = ttgl.full([8], 0.0, ttgl.float32, layout=ttgl.SliceLayout(0, mma_l))
        acc = ttgl.zeros([HEAD_DIM, 8], ttgl.float32, layout=mma_l)
        for j in range(n_pages):
            slot = base + c % SLOTS_W
            mbarrier.wait(bars.index(slot), (c // SLOTS_W) & 1)
            k = k_bufs.index(slot).load(a_l)
            vt = v_bufs.index(slot).permute((1, 0)).load(a_l)
            st = mma_v2(k, qt, s_zero)
            valid = ttgl.where(j == n_pages - 1, last_len, PAGE_SIZE)
            st = ttgl.where(ttgl.expand_dims(keys < valid, 1), st * qk_scale, float("-inf"))
            m_new = ttgl.maximum(m_i, ttgl.max(st, axis=0))
            p = ttgl.exp2(st - ttgl.expand_dims(m_new, 0))
            alpha = ttgl.exp2(m_i - m_new)
            l_i = l_i * alpha + ttgl.sum(p, axis=0)
            m_i = m_new
            acc = acc * ttgl.expand_dims(alpha, 0)
            acc = mma_v2(vt, ttgl.convert_layout(p.to(ttgl.bfloat16), b_l), acc)
            c += 1
            if ii < n_mine:  # both products read the slot: the cursor's next page into it
                _issue(desc, k_bufs, v_bufs, bars, slot, ttgl.load(kv_indices_ptr + i_start + ij), i_item,
                       num_kv_heads, PAGE_SIZE, HND)
                ij += 1
                if ij == i_n:
                    ii += 1
                    ij = ij * 0
                    i_item += stride
                    nxt = ii < n_mine
                    i_start = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads, mask=nxt, other=0)
                    i_n = ttgl.load(kv_indptr_ptr + i_item // num_kv_heads + 1, mask=nxt, other=0) - i_start
        l_safe = ttgl.where(l_i == 0.0, 1.0, l_i)
        o = acc / ttgl.expand_dims(l_safe, 0)
        lse = ttgl.where(l_i == 0.0, float("-inf"), (m_i + ttgl.log2(l_safe)) * KERNEL_LN2)
        o_off = request.to(ttgl.int64) * stride_ot + (head * GROUP + n).to(ttgl.int64) * stride_oh
        ttgl.store(o_ptr + (ttgl.expand_dims(d, 1) + ttgl.expand_dims(o_off, 0)), o.to(ttgl.bfloat16),
                   mask=ttgl.expand_dims(n < GROUP, 0))
        ttgl.store(lse_ptr + request.to(ttgl.int64) * stride_lt + head * GROUP + n, lse, mask=n < GROUP)


@gluon.jit
def _idle(pid):
    """The default partition: Gluon's warp specialisation wants 4 warps there; the streams
    are the workers."""
    pass


@gluon.jit
def decode_streams(q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr,
                   n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, qk_scale,
                   GROUP: ttgl.constexpr, PAGE_SIZE: ttgl.constexpr, HEAD_DIM: ttgl.constexpr,
                   STREAMS: ttgl.constexpr, REGS: ttgl.constexpr, HND: ttgl.constexpr):
    """``STREAMS`` one-warp page streams per program (see the module docstring)."""
    pid = ttgl.program_id(0)
    programs = ttgl.num_programs(0)
    sl: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], ttgl.bfloat16)
    k_bufs = ttgl.allocate_shared_memory(ttgl.bfloat16, [STREAMS * SLOTS, PAGE_SIZE, HEAD_DIM], sl)
    v_bufs = ttgl.allocate_shared_memory(ttgl.bfloat16, [STREAMS * SLOTS, PAGE_SIZE, HEAD_DIM], sl)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STREAMS * SLOTS, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STREAMS * SLOTS):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    # (Each partition's arguments written out: a tuple held in a variable would turn its
    # constexprs into runtime values.)
    if STREAMS == 4:
        ttgl.warp_specialize([
            (_idle, (pid,)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 0, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 1, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 2, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 3, STREAMS, GROUP, PAGE_SIZE, HND)),
        ], [1, 1, 1, 1], [REGS, REGS, REGS, REGS])
    else:
        ttgl.warp_specialize([
            (_idle, (pid,)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 0, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 1, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 2, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 3, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 4, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 5, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 6, STREAMS, GROUP, PAGE_SIZE, HND)),
            (_stream, (q_ptr, desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, o_ptr, lse_ptr, k_bufs, v_bufs, bars,
                       pid, programs, n_items, num_kv_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       qk_scale, 7, STREAMS, GROUP, PAGE_SIZE, HND)),
        ], [1, 1, 1, 1, 1, 1, 1, 1], [REGS, REGS, REGS, REGS, REGS, REGS, REGS, REGS])


class Streams:
    """``decode_streams`` over one workload's decode level on ``programs`` programs."""

    def __init__(self, wl, streams: int, programs: int, hnd_pools: list | None = None):
        s = wl.shape
        if s.head_dim != 128 or s.hq // s.hkv > 8 or streams not in (4, 8):
            raise SystemExit("probe_decode_streams: head_dim 128, groups of <= 8, 4 or 8 streams")
        if int((wl.kv_indptr[1][1:] - wl.kv_indptr[1][:-1]).min()) < 1:
            raise SystemExit("probe_decode_streams: every request needs a page")
        self.wl, self.streams, self.programs = wl, streams, programs
        self.hnd = hnd_pools is not None
        self.descs = page_descriptors(wl, hnd_pools, self.hnd)
        self.outs, self.lses = wl.out_buffers()
        self.qk_scale = s.head_dim ** -0.5 * 1.4426950408889634

    def call(self, i: int):
        wl, s = self.wl, self.wl.shape

        def run():
            q, o, lse = wl.qs[i], self.outs[i], self.lses[i]
            decode_streams[(self.programs,)](
                q, self.descs[i], wl.kv_indices[1], wl.kv_indptr[1], wl.kv_last[1], o, lse, s.batch * s.hkv, s.hkv,
                q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0), self.qk_scale,
                s.hq // s.hkv, PAGE, s.head_dim, self.streams, STREAM_REGS, self.hnd, num_warps=4)
        return run

    def max_error(self, o_ref: torch.Tensor) -> float:
        """Max |o - o_ref| on rotation 0, the output poisoned first."""
        self.outs[0].fill_(float("nan"))
        self.call(0)()
        return (self.outs[0].float() - o_ref.float()).abs().nan_to_num(float("inf")).max().item()


def options(ap) -> None:
    ap.add_argument("--streams", nargs="*", type=int, default=[4, 8])
    ap.add_argument("--programs", nargs="*", type=int, default=[68, 132])
    ap.add_argument("--hnd", action="store_true",
                    help="also from HND copies of the pools (each head's page one contiguous 4 KiB block)")


def main() -> None:
    from cascadeinfer import batch_decode_paged

    args, device, timer = shape_tool_start(__doc__, "probe_decode_streams", ENGINE_SHAPES, 100, options)
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise SystemExit("probe_decode_streams: Gluon TMA needs compute capability 9.0")
    copy_bw, _ = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        nbytes = s.decode_level_bytes
        prefix = prefix_calls(wl, 1)
        cascade = ours(wl, True)
        row = {"shape": text, "bytes floor us": nbytes / copy_bw * 1e6,
               "decode alone us": timer(level_alone_calls(wl, 1)) * 1e6, "prefix alone us": timer(prefix) * 1e6,
               "cascade us": timer([cascade.call(i) for i in range(wl.rot)]) * 1e6}
        o_ref, _ = batch_decode_paged(wl.qs[0], wl.pools[0], wl.kv_indptr[1], wl.kv_indices[1], wl.kv_last[1])
        # HND copies ([pages, 2, Hkv, page, D]): each (page, kv head) one contiguous block.
        hnd = [pool.transpose(2, 3).contiguous() for pool in wl.pools] if args.hnd else None
        for k in args.streams:
            for n in args.programs:
                for layout, pools in (("", None), (" HND", hnd)) if hnd else (("", None),):
                    st = Streams(wl, k, n, pools)
                    name = f"{k} streams{layout} on {n}"
                    row[f"{name} max err"] = st.max_error(o_ref)
                    calls = [st.call(i) for i in range(wl.rot)]
                    t = timer(calls)
                    row[f"{name} us"] = t * 1e6
                    row[f"{name} GB/s per SM"] = nbytes / t / n / 1e9
                    if n < 132:
                        row[f"prefix + {name} us"] = timer(beside(prefix, calls)) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "rows": rows})


if __name__ == "__main__":
    main()
