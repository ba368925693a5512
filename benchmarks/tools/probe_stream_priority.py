"""Does the side stream's priority change how the cascade's two levels share the GPU?

    python -m benchmarks.tools.probe_stream_priority [--shapes B,P,S ...] [--json PATH]

The cascade's decode level runs on a side stream beside the prefix level on the caller's
stream; both streams have the default priority, the lowest. A stream of higher priority
has its pending programs placed first wherever an SM frees up. For each shape (the
engine's decode batch and the bar shapes) this times the public two-level ``run``
(CUDA-graph replays over pools rotated past L2) with the side stream at each priority the
device offers, and checks every answer against the default's.
"""

from __future__ import annotations

from unittest import mock

import torch

from benchmarks._common import environment, markdown_table, write_json
from benchmarks.fixtures import ours, shape_tool_start, shape_workloads
from cascadeinfer.cascade import multi_level

SHAPES = ("256,4096,144", "256,4096,256", "64,8192,256", "128,32768,512", "256,4096,128", "16,65536,1024")


def main() -> None:
    args, device, timer = shape_tool_start(__doc__, "probe_stream_priority", SHAPES, 100)
    low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): numerically high to low
    priorities = sorted({low, high, (low + high) // 2}, reverse=True)
    rows = []
    for text, _, wl in shape_workloads(args.shapes, device):
        row, base = {"shape": text}, None
        for p in priorities:
            def side(self, p=p):
                if self._stream is None:
                    self._stream = torch.cuda.Stream(self.device, priority=p)
                return self._stream

            with mock.patch.object(multi_level.MultiLevelCascadeAttention, "_side_stream", side):
                m = ours(wl, True)
            o, _ = m.result()
            o = o.float().clone()
            base = o if base is None else base
            torch.testing.assert_close(o, base, atol=2e-2, rtol=2e-2)
            row[f"side priority {p} us"] = round(timer([m.call(i) for i in range(wl.rot)]) * 1e6, 1)
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    write_json(args.json, {"environment": environment(), "priority_range": [low, high], "rows": rows})


if __name__ == "__main__":
    main()
