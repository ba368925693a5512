"""The "all_heads" decode schedule alone and as the cascade's decode level, by prefix split.

    python -m benchmarks.tools.probe_all_heads [--shapes B,P,S ...] [--splits 1 2 3 4] [--json PATH]

Per shape (default: the engine's decode batch at 144, 256 and 384 own tokens, then the four
bar shapes), CUDA-graph replays over rotated inputs: the decode level alone with the default
schedule and with ``schedule="all_heads"``; the public cascade as planned; and the cascade
with its decode level on ``"all_heads"`` beside the prefix level, with the plan's prefix
split count and with each of ``--splits``; with ``--hopper``, also the cascade as planned
with its prefix level on ``backend="hopper"``. Each cascade's output is checked against
the default cascade's (max abs difference). GPU only.
"""

from __future__ import annotations

import contextlib

from benchmarks._common import environment, markdown_table, measure_ceilings, write_json
from benchmarks.fixtures import level_alone_calls, ours, shape_tool_start, shape_workloads

SHAPES = ("256,4096,144", "256,4096,256", "256,4096,384",
          "64,8192,256", "128,32768,512", "256,4096,128", "16,65536,1024")


@contextlib.contextmanager
def decode_beside(schedule: str | None, splits: int | None):
    """Plans made inside take ``schedule`` for the decode level beside the prefix level
    (None: the policy's) and ``splits`` prefix splits (None: the plan's)."""
    from cascadeinfer.cascade import multi_level  # noqa: PLC0415

    old = multi_level.decode_schedule_beside_prefill, multi_level.prefix_splits_beside_decode
    if schedule is not None:
        multi_level.decode_schedule_beside_prefill = lambda sched, lens: schedule
    if splits is not None:
        multi_level.prefix_splits_beside_decode = lambda *a, **k: splits
    try:
        yield
    finally:
        multi_level.decode_schedule_beside_prefill, multi_level.prefix_splits_beside_decode = old


def options(ap) -> None:
    ap.add_argument("--splits", nargs="*", type=int, default=[1, 2, 3, 4])
    ap.add_argument("--hopper", action="store_true", help="also the cascade with its prefix level on the Hopper kernel")


def main() -> None:
    from cascadeinfer import batch_decode_paged  # noqa: PLC0415

    args, device, timer = shape_tool_start(__doc__, "probe_all_heads", SHAPES, 100, options)
    copy_bw, _ = measure_ceilings()
    rows = []
    for text, s, wl in shape_workloads(args.shapes, device):
        nbytes = s.decode_level_bytes
        outs, lses = wl.out_buffers()
        heads = [lambda i=i: batch_decode_paged(wl.qs[i], wl.pools[i], wl.kv_indptr[1], wl.kv_indices[1],
                                                wl.kv_last[1], out=outs[i], lse=lses[i], validate=False,
                                                schedule="all_heads") for i in range(wl.rot)]
        default = ours(wl, True)
        o_ref, _ = default.result()
        o_ref = o_ref.float().clone()
        row = {"shape": text, "decode bytes floor us": nbytes / copy_bw * 1e6,
               "decode alone us": timer(level_alone_calls(wl, 1)) * 1e6,
               "all_heads alone us": timer(heads) * 1e6,
               "cascade us": timer([default.call(i) for i in range(wl.rot)]) * 1e6}
        for splits in (None, *args.splits):
            with decode_beside("all_heads", splits):
                m = ours(wl, True)
            o, _ = m.result()
            name = f"all_heads beside, {splits or 'plan'} split" + ("s" if splits != 1 else "")
            row[f"{name} max diff"] = (o.float() - o_ref).abs().nan_to_num(float("inf")).max().item()
            row[f"{name} us"] = timer([m.call(i) for i in range(wl.rot)]) * 1e6
        if args.hopper:
            m = ours(wl, True, backend="hopper")
            o, _ = m.result()
            row["cascade, hopper prefix max diff"] = (o.float() - o_ref).abs().nan_to_num(float("inf")).max().item()
            row["cascade, hopper prefix us"] = timer([m.call(i) for i in range(wl.rot)]) * 1e6
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "copy_bytes_per_s": copy_bw, "rows": rows})


if __name__ == "__main__":
    main()
