"""Where the stream-K prefix grid loses against the split grid: kernel and merge apart.

    python -m benchmarks.tune_streamk

The shared-prefix level of the bar shapes (bf16, Hq 32, Hkv 8, D 128, pages of 16 in a
rotated pool): the prefill kernel alone into partial-state buffers (no merge), on the split
grid (tiles x Hkv x splits) and on the stream-K grid (tiles x programs), including the
stream-K grid that deals exactly the split grid's runs (programs = Hkv x splits); then the
merge of S partial states alone. Each launch is checked against the public path first.
"""

from __future__ import annotations

import sys

import torch

from benchmarks._common import bench_rotating, environment, markdown_table, write_json
from benchmarks.bench_cascade import DTYPE, MIN_POOL_BYTES, Shape, Workload
from cascadeinfer.kernels import prefill as P
from cascadeinfer.kernels.merge import merge_states
from cascadeinfer.layouts.paged_cache import unpack_paged_kv_cache

SHAPES = ((128, 32768, 512), (256, 4096, 128), (64, 8192, 256))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("tune_streamk needs a CUDA device")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("#", environment(), flush=True)
    rows = []
    for b, pre, suf in SHAPES:
        s = Shape(b, pre, suf)
        wl = Workload(s, dev, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=16)
        qo, kp, ki, kl = wl.tables()
        cfg = P.default_tile_config(s.head_dim, DTYPE, s.batch * s.hq // s.hkv)
        tiles = P.num_m_tiles(s.batch, 1, s.hq // s.hkv, cfg.block_m)
        full = sms // (tiles * s.hkv)
        scale = s.head_dim ** -0.5
        srcs = [P._paged_source(unpack_paged_kv_cache(p, "NHD"), kp[0], ki[0], kl[0]) for p in wl.pools]
        ref = P._run(wl.qs[0], qo[0], srcs[0], torch.empty_like(wl.qs[0]), torch.empty(wl.qs[0].shape[:2], device=dev),
                     causal=False, sm_scale=scale)
        row = dict(shape=f"{b},{pre},{suf}")

        def parts(slots):
            return [(torch.empty(s.batch, slots, s.hq, s.head_dim, dtype=DTYPE, device=dev),
                     torch.empty(s.batch, slots, s.hq, device=dev)) for _ in range(wl.rot)]

        def launch_only(name, slots, **kw):
            bufs = parts(slots)
            calls = [lambda i=i: P._launch(wl.qs[i], qo[0], srcs[i], *bufs[i], causal=False, sm_scale=scale,
                                           config=cfg, **kw) for i in range(wl.rot)]
            calls[0]()
            o, lse = torch.empty_like(wl.qs[0]), torch.empty(wl.qs[0].shape[:2], device=dev)
            merge_states(*bufs[0], out=o, out_lse=lse)
            err = (o.float() - ref[0].float()).abs().max().item()
            row[name] = f"WRONG {err:.2g}" if err > 3e-2 else bench_rotating(calls, rep_ms=60) * 1e6
            merge_calls = [lambda i=i: merge_states(*bufs[i], out=o, out_lse=lse) for i in range(wl.rot)]
            row[f"merge of {slots}"] = bench_rotating(merge_calls, rep_ms=60) * 1e6

        i32 = P.AddressPath(offsets_32=True, aligned_pages=True)
        for splits in sorted({full, max(1, full - 1)}):
            launch_only(f"split grid s{splits} ({tiles * s.hkv * splits} progs)", splits)
            launch_only(f"split grid s{splits} int32", splits, address=i32)
            g = s.hkv * splits
            launch_only(f"stream-K {g}x{tiles} (same runs)", P.stream_k_slots(g, s.hkv), tile_programs=g)
            launch_only(f"stream-K {g}x{tiles} (same runs) int32", P.stream_k_slots(g, s.hkv), tile_programs=g,
                        address=i32)
        for g in sorted({sms // tiles, sms * 27 // 33 // tiles, s.hkv * full - 1}):
            launch_only(f"stream-K {g}x{tiles} ({g * tiles} progs) int32", P.stream_k_slots(g, s.hkv),
                        tile_programs=g, address=i32)
        print("#", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
        del wl, srcs
        torch.cuda.empty_cache()
    for r in rows:
        print(markdown_table([dict(variant=k, us=v) for k, v in r.items()], ["variant", "us"]))
    write_json("tune_streamk.json", dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
