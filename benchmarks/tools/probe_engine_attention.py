"""One layer of the engine's decode attention, timed as its step runs it and with its tables moved.

    python -m benchmarks.tools.probe_engine_attention --suffix 256 --json PATH

Builds the engine as ``tools/profile_engine_step`` does (a preset's shapes, random bf16
weights, page 16), runs the workload until every request decodes, and takes the full
batch's page lists at that step. One layer's attention over them (layer 0's cache, random
queries; CUDA-graph replays) is then timed five ways:

- ``engine step``: the captured step's own ``MultiLevelCascadeAttention`` (graph mode,
  fixed-capacity tables), as every layer of the step runs it;
- ``eager plan``: a plain ``MultiLevelCascadeAttention`` planned with the same levels
  (``group_levels``, as the engine groups the rows);
- ``compact pool, pages in order``: the same rows with every page they read renumbered
  0, 1, ... in order of first use, in a pool of just those pages;
- ``compact pool, pages shuffled``: renumbered by a random permutation instead;
- ``synthetic``: ``benchmarks.fixtures.Workload`` at (batch, prefix, mean own tokens), the
  inputs of ``tools/tune_decode_level`` (pages at random over a pool, rotated pools).

Each cascade is checked against the eager plan's output. What separates the first two is
the plan (graph mode against eager); the next two, where the pages lie; the last, the
rows' shapes (the engine's rows end in a partly filled page).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from benchmarks._common import bench_rotating, bench_seconds, environment, gpu_start, markdown_table, write_json
from benchmarks.fixtures import MAX_ROTATIONS, MIN_POOL_BYTES, Shape, Workload
from benchmarks.tools.profile_engine_step import add_workload_args, engine_in_full_decode
from cascadeinfer.cascade.multi_level import MultiLevelCascadeAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, new_tokens=16)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--json", metavar="PATH", help="write the results and the environment here as JSON")
    args = ap.parse_args()
    device = gpu_start("probe_engine_attention")
    rows, (n, shared, own) = engine_rows(args, device)
    gc.collect()  # the engine's objects, then their memory
    torch.cuda.empty_cache()
    real = [t for t in own if t]  # rows padded to the graph's bucket have no pages
    s = Shape(len(real), shared, round(sum(real) / len(real)))
    wl = Workload(s, device, seed=0, min_pool_bytes=MIN_POOL_BYTES, max_rot=MAX_ROTATIONS)
    attn = MultiLevelCascadeAttention(2, device=device)
    attn.plan(*wl.tables(), s.hq, s.hkv, s.head_dim, 16, num_pages=wl.num_pages, dtype=torch.bfloat16,
              use_cascade=True)
    us = bench_rotating([lambda i=i: attn.run(wl.qs[i], wl.pools[i]) for i in range(wl.rot)], rep_ms=args.rep_ms)
    row = dict(variant=f"synthetic {s}", us=round(us * 1e6, 1), max_abs_err="—",
               prefix_splits=attn._levels[-2].num_splits, decode_schedule=attn._levels[-1].schedule)
    print("#", row, flush=True)
    rows.append(row)
    print(markdown_table(rows, list(rows[0])))
    write_json(args.json, dict(env=environment(), args={k: v for k, v in vars(args).items() if k != "json"},
                               rows=rows))


def engine_rows(args, device: torch.device) -> tuple[list[dict], tuple[int, int, list[int]]]:
    """The first four variants' rows, and (rows, shared tokens, each row's own tokens)."""
    llm = engine_in_full_decode(args, device, warm_up=False)
    runner, ps = llm.runner, llm.config.page_size
    scale = runner.sm_scale
    hq, hkv, d = runner.model.num_qo_heads, runner.model.num_kv_heads, runner.model.head_dim
    steps = [st for key, st in runner.graphs.steps.items() if key[1] and st.graph is not None]
    if not steps:
        sys.exit("no captured cascade step")
    graph_attn = max(steps, key=lambda st: st.attn.num_tokens).attn  # the full batch's bucket
    # The tables the last step's attention read (its fixed-capacity buffers' used entries).
    levels = []
    for lv in graph_attn._levels:
        kp = lv.table.kv_indptr.cpu()
        levels.append((lv.qo_indptr.cpu(), kp, lv.table.kv_indices[:int(kp[-1])].cpu(),
                       lv.table.kv_last_page_len.cpu()))
    n = graph_attn.num_tokens
    cache = llm.pool.layer(0)
    q = torch.randn(n, hq, d, dtype=torch.bfloat16, device=device)

    def tokens(level) -> list[int]:
        _, kp, _, kl = level
        pages = (kp[1:] - kp[:-1]).tolist()
        return [(p - 1) * ps + int(k) if p else 0 for p, k in zip(pages, kl.tolist())]

    own = tokens(levels[-1])
    shared = max(tokens(levels[0])) if len(levels) > 1 else 0
    print(f"# {n} rows; shared level {shared} tokens; own tokens {min(own)}..{max(own)} (mean {sum(own) / n:.1f});"
          f" pool {llm.pool.num_pages} pages", flush=True)

    def planned(tables, num_pages):
        attn = MultiLevelCascadeAttention(len(tables[0]), device=device)
        attn.plan(*tables, hq, hkv, d, ps, sm_scale=scale, num_pages=num_pages, dtype=torch.bfloat16,
                  use_cascade=True)
        return attn

    tables = [[lv[i] for lv in levels] for i in range(4)]
    eager = planned(tables, llm.pool.num_pages)
    ref = eager.run(q, cache, sm_scale=scale).float().clone()
    rows = []

    def timed(name: str, fn, attn, check_cache) -> None:
        out = attn.run(q, check_cache, sm_scale=scale)
        err = (out.float() - ref).abs().max().item()
        us = bench_seconds(fn, rep_ms=args.rep_ms) * 1e6
        level = attn._levels[-2] if attn.use_cascade and len(attn._levels) > 1 else None
        row = dict(variant=name, us=round(us, 1), max_abs_err=f"{err:.1e}",
                   prefix_splits=level.num_splits if level else None,
                   decode_schedule=attn._levels[-1].schedule if attn.use_cascade else attn._flat.schedule)
        print("#", row, flush=True)
        rows.append(row)

    timed("engine step", lambda: graph_attn.run(q, cache, sm_scale=scale), graph_attn, cache)
    timed("eager plan", lambda: eager.run(q, cache, sm_scale=scale), eager, cache)

    listed = torch.cat([lv[2] for lv in levels]).long()
    used = torch.unique(listed)
    in_order = _first_occurrences(listed)
    g = torch.Generator().manual_seed(0)
    for name, pages in (("compact pool, pages in order", in_order),
                        ("compact pool, pages shuffled", used[torch.randperm(used.numel(), generator=g)])):
        remap = torch.full((llm.pool.num_pages,), -1, dtype=torch.int32)
        remap[pages] = torch.arange(pages.numel(), dtype=torch.int32)
        moved = [[t if i != 2 else remap[t.long()] for i, t in enumerate(lv)] for lv in levels]
        small = cache.index_select(0, pages.to(device))
        attn = planned([[m[i] for m in moved] for i in range(4)], pages.numel())
        timed(name, lambda a=attn, c=small: a.run(q, c, sm_scale=scale), attn, small)
        del small

    return rows, (n, shared, own)


def _first_occurrences(pages: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``pages`` in the order they first occur."""
    seen: dict[int, None] = dict.fromkeys(pages.tolist())
    return torch.tensor(list(seen), dtype=torch.long)


if __name__ == "__main__":
    main()
