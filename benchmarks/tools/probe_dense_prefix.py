"""How fast would the cascade be with a warp-specialised prefix kernel? A measured proxy.

    python -m benchmarks.tools.probe_dense_prefix                      # (128, 32768, 512)
    python -m benchmarks.tools.probe_dense_prefix --shapes 64,8192,256

Our prefix kernel (Triton 3.6, no warpgroup specialisation on Hopper) is what bounds the
cascade at (128, 32768, 512) (NOTES.md v9). PyTorch's SDPA backends include kernels that
do specialise warpgroups on Hopper (cuDNN's). They need contiguous K/V and return no LSE,
so they cannot be a cascade level, but they can stand in for one: the prefix level's
work is ``Hkv`` heads of ``G·batch`` packed query rows over ``L`` keys, cut here into ``S``
key chunks (the batch dimension), the same grid shape as our split-KV prefix level.

For each chunk count: our prefix kernel (paged, the same grid), each SDPA backend on the
packed contiguous copy (gather and packing not timed), each alone and then beside our
suffix decode on a side stream (the public path's schedule, without the final merges:
add ~4 µs). CUDA-graph times (µs) and the SM clock / power while each replays. The outputs
are checked against each other (same math, no LSE) before timing.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks._common import bench_rotating, environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import MIN_POOL_BYTES, Shape, Workload
from benchmarks.tools.probe_interference import sampled_clocks
from benchmarks.tools.tune_overlap import two_streams
from cascadeinfer.kernels.decode import batch_decode_paged
from cascadeinfer.layouts.paged_cache import gather_paged_kv, unpack_paged_kv_cache

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def packed_prefix(wl: Workload, chunks: int):
    """(q, k, v) for SDPA: q ``[chunks, Hkv, G·batch, D]`` (the G query heads of a kv head
    stacked as rows, repeated per chunk), k/v ``[chunks, Hkv, L / chunks, D]``."""
    s = wl.shape
    g = s.hq // s.hkv
    kv = unpack_paged_kv_cache(wl.pools[0], "NHD")
    k, v = gather_paged_kv(kv, wl.kv_indptr[0], wl.kv_indices[0], wl.kv_last[0], 0)  # [L, Hkv, D]
    per = s.prefix // chunks
    k, v = ((t[: per * chunks].view(chunks, per, s.hkv, s.head_dim).transpose(1, 2).contiguous()) for t in (k, v))
    q = wl.qs[0].view(s.batch, s.hkv, g, s.head_dim).permute(1, 2, 0, 3).reshape(1, s.hkv, g * s.batch, s.head_dim)
    return q.expand(chunks, -1, -1, -1).contiguous(), k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["128,32768,512"])
    ap.add_argument("--chunks", nargs="*", type=int, default=[2, 3, 4])
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_dense_prefix needs a CUDA device")
    dev = torch.device("cuda")
    print("#", environment(), flush=True)
    copy_bw, mm_rate = measure_ceilings()
    rows = []
    for text in args.shapes:
        s = Shape(*map(int, text.split(",")))
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=1)
        flops = 4 * s.batch * s.prefix * s.hq * s.head_dim
        _, kp, ki, kl = wl.tables()
        side = torch.cuda.Stream()
        o_s = torch.empty_like(wl.qs[0])
        l_s = torch.empty(wl.qs[0].shape[:2], device=dev)

        def decode():
            batch_decode_paged(wl.qs[0], wl.pools[0], kp[1], ki[1], kl[1], out=o_s, lse=l_s, validate=False)

        def beside(prefix):
            def run():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                prefix()
                with torch.cuda.stream(side):
                    decode()
                main.wait_stream(side)
            return run

        for chunks in args.chunks:
            q, k, v = packed_prefix(wl, chunks)
            ours_alone = two_streams(wl, chunks, "prefix")[0]
            variants = {"ours (paged)": ours_alone}
            ref = None
            for name, backend in BACKENDS.items():
                def sdpa(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v)
                try:
                    o = sdpa()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 — a backend that does not run is a row
                    rows.append(dict(shape=text, chunks=chunks, kernel=f"SDPA {name}",
                                     error=f"{type(exc).__name__}: {str(exc)[:80]}"))
                    continue
                if ref is None:
                    ref = o.float()
                err = (o.float() - ref).abs().max().item()
                if err > 2e-2:
                    rows.append(dict(shape=text, chunks=chunks, kernel=f"SDPA {name}", error=f"WRONG {err:.2g}"))
                    continue
                variants[f"SDPA {name}"] = sdpa
            for name, fn in variants.items():
                alone = bench_rotating([fn], rep_ms=args.rep_ms)
                both = bench_rotating([beside(fn)], rep_ms=args.rep_ms)
                row = dict(shape=text, chunks=chunks, kernel=name, alone_us=round(alone * 1e6, 1),
                           tflops=round(flops / alone / 1e12), of_matmul=round(flops / alone / mm_rate, 3),
                           beside_decode_us=round(both * 1e6, 1))
                clk = sampled_clocks(beside(fn))
                row.update(beside_mhz=clk["mhz"], beside_watts=clk["watts"], cap=clk["reasons"])
                print("#", row, flush=True)
                rows.append(row)
            del q, k, v
        torch.cuda.synchronize()
        rows.append(dict(shape=text, kernel="our decode alone", alone_us=round(bench_rotating(
            [decode], rep_ms=args.rep_ms) * 1e6, 1)))
        del wl
        torch.cuda.empty_cache()
    print(markdown_table(rows, ["shape", "chunks", "kernel", "alone_us", "tflops", "of_matmul", "beside_decode_us",
                                "beside_mhz", "beside_watts", "cap", "error"]))
    write_json(args.json, dict(env=environment(), copy_bw=copy_bw, mm_rate=mm_rate, rows=rows))


if __name__ == "__main__":
    main()
