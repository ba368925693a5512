"""Fused elementwise kernels against the op-by-op PyTorch sequence and torch.compile of it.

Run from the repository root on a GPU machine:

    python -m benchmarks.bench_fused                 # correctness, then the tables
    python -m benchmarks.bench_fused --json PATH     # also every row as JSON

Llama-3-8B decode shapes, bf16: T = 256 tokens, hidden 4096, intermediate 14336, 32 q
heads and 8 kv heads of 128, positions anywhere in an 8192-entry RoPE table. For each op
(``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``apply_rope``) three
implementations: ours (``cascadeinfer.kernels.fused``), the decoder's op-by-op modules
(``engine/llama.py`` with ``fused=False``: what Hugging Face runs) and ``torch.compile`` of
that same sequence. Every timing is a ``do_bench_cudagraph`` median over input sets
rotated so that nothing is served from L2; each sits beside its bandwidth floor: the
bytes the op must move (inputs read once, outputs written once) over the kernel-copy
bandwidth measured in the same run.

Then one decoder layer at those shapes, attention left out (its output is a fixed
buffer): its elementwise work alone, and with its four matmuls, fused against op by op
(and the elementwise sequence under torch.compile), with the difference for 32 layers.
Correctness against the float32 references runs first, on the GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

T, HIDDEN, INTER, HQ, HKV, D = 256, 4096, 14336, 32, 8, 128
MAX_POS = 8192
EPS = 1e-5
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so that a CPU dry run of the set-up can swap it
LAYERS = 32  # Llama-3-8B
TOL = 1.6e-2  # two bf16 units in the last place


# ----------------------------------------------------------------------------------
# The op-by-op sequences (the decoder's modules, as functions torch.compile can take)
# ----------------------------------------------------------------------------------


def norm_ref(x, w):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return w * x32.to(x.dtype)


def add_norm_ref(x, residual, w):
    residual = residual + x
    return norm_ref(residual, w), residual


def silu_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_ref(q, k, positions, cos_sin):
    cos, sin = cos_sin.index_select(0, positions)[:, None, :].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def rot(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rot(q), rot(k)


def layer_elementwise_ref(x, residual, qkv, positions, cos_sin, gate_up, w1, w2):
    """The elementwise work of one layer, op by op: input add+norm, RoPE, post-attention
    add+norm, SiLU-and-mul (the matmul outputs ``qkv``, ``gate_up`` are given)."""
    h1, residual = add_norm_ref(x, residual, w1)
    q = qkv[:, :HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    q, k = rope_ref(q, k, positions, cos_sin)
    h2, residual = add_norm_ref(h1, residual, w2)  # h1 stands in for the o_proj output
    return q, k, h2, silu_mul_ref(gate_up), residual


# ----------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------


def rows(n: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, cols, device=DEVICE) * scale).to(DTYPE)


def rope_table() -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    freqs = torch.arange(MAX_POS, device=DEVICE).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DTYPE)


def positions() -> torch.Tensor:
    return torch.randint(0, MAX_POS, (T,), device=DEVICE)


E = DTYPE.itemsize
BYTES = {
    # x read, weight read, out written
    "rms_norm": 2 * T * HIDDEN * E + HIDDEN * E,
    # x and residual read and written, weight read
    "fused_add_rms_norm": 4 * T * HIDDEN * E + HIDDEN * E,
    # gate and up read, out written
    "silu_and_mul": 3 * T * INTER * E,
    # q and k read and written, one cos/sin row and one position per token
    "apply_rope": 2 * T * (HQ + HKV) * D * E + T * (D * E + 8),
}


# ----------------------------------------------------------------------------------
# Correctness on the GPU
# ----------------------------------------------------------------------------------


def check() -> None:
    from cascadeinfer.kernels import fused  # noqa: PLC0415
    from cascadeinfer.kernels import reference as ref_mod  # noqa: PLC0415

    x, r, w = rows(T, HIDDEN, 2.0), rows(T, HIDDEN, 4.0), rows(1, HIDDEN)[0] * 0.1 + 1
    gu = rows(T, 2 * INTER, 3.0)
    qkv = rows(T, (HQ + 2 * HKV) * D, 2.0)
    q, k = qkv[:, :HQ * D].view(T, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
    cs, pos = rope_table(), positions()
    results = {
        "rms_norm": (fused.rms_norm(x, w, EPS), ref_mod.rms_norm_ref(x, w, EPS), norm_ref(x, w)),
        "silu_and_mul": (fused.silu_and_mul(gu), ref_mod.silu_and_mul_ref(gu), silu_mul_ref(gu)),
    }
    want_x, want_r = ref_mod.fused_add_rms_norm_ref(x, r, w, EPS)
    plain_x, plain_r = add_norm_ref(x, r, w)
    fx, fr = x.clone(), r.clone()
    fused.fused_add_rms_norm(fx, fr, w, EPS)
    results["fused_add_rms_norm"] = (torch.cat((fx, fr)), torch.cat((want_x, want_r)), torch.cat((plain_x, plain_r)))
    want_q, want_k = ref_mod.apply_rope_ref(q, k, pos, cs)
    plain_q, plain_k = rope_ref(q, k, pos, cs)
    fused.apply_rope(q, k, pos, cs, validate=True)
    results["apply_rope"] = (torch.cat((q.flatten(), k.flatten())), torch.cat((want_q.flatten(), want_k.flatten())),
                             torch.cat((plain_q.flatten(), plain_k.flatten())))
    for name, (got, ref, plain) in results.items():
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n} vs reference: {m}")
        torch.testing.assert_close(got, plain, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n} vs op by op: {m}")
        differ = (got != plain).float().mean().item()
        print(f"# {name}: ok; {differ:.2e} of the elements differ from op by op (a unit in the last place)")


# ----------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------


def op_cases() -> dict[str, dict[str, Callable[[], Callable[[], object]]]]:
    """name -> {implementation: factory}; a factory makes fresh inputs and returns the call."""
    from cascadeinfer.kernels import fused  # noqa: PLC0415

    c_norm, c_add, c_silu, c_rope = (torch.compile(f, dynamic=False) for f in
                                     (norm_ref, add_norm_ref, silu_mul_ref, rope_ref))
    cs = rope_table()

    def norm_inputs():
        return rows(T, HIDDEN, 2.0), rows(1, HIDDEN)[0]

    def add_inputs():
        return rows(T, HIDDEN), rows(T, HIDDEN, 4.0), rows(1, HIDDEN)[0]

    def rope_inputs():
        qkv = rows(T, (HQ + 2 * HKV) * D)
        return (qkv[:, :HQ * D].view(T, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), positions())

    def with_inputs(make, call):
        def factory():
            args = make()
            return lambda: call(*args)
        return factory

    return {
        "rms_norm": {
            "fused": with_inputs(norm_inputs, lambda x, w: fused.rms_norm(x, w, EPS)),
            "op by op": with_inputs(norm_inputs, norm_ref),
            "torch.compile": with_inputs(norm_inputs, c_norm),
        },
        "fused_add_rms_norm": {
            "fused": with_inputs(add_inputs, lambda x, r, w: fused.fused_add_rms_norm(x, r, w, EPS)),
            "op by op": with_inputs(add_inputs, add_norm_ref),
            "torch.compile": with_inputs(add_inputs, c_add),
        },
        "silu_and_mul": {
            "fused": with_inputs(lambda: (rows(T, 2 * INTER),), fused.silu_and_mul),
            "op by op": with_inputs(lambda: (rows(T, 2 * INTER),), silu_mul_ref),
            "torch.compile": with_inputs(lambda: (rows(T, 2 * INTER),), c_silu),
        },
        "apply_rope": {
            "fused": with_inputs(rope_inputs, lambda q, k, p: fused.apply_rope(q, k, p, cs)),
            "op by op": with_inputs(rope_inputs, lambda q, k, p: rope_ref(q, k, p, cs)),
            "torch.compile": with_inputs(rope_inputs, lambda q, k, p: c_rope(q, k, p, cs)),
        },
    }


def time_case(factory: Callable[[], Callable[[], object]], nbytes: int, rep_ms: int) -> float:
    from benchmarks._common import bench_rotating, rotation_count  # noqa: PLC0415

    fns = [factory() for _ in range(rotation_count(nbytes))]
    return bench_rotating(fns, rep_ms=rep_ms)


def layer_cases():
    """One decoder layer without attention: (elementwise only, with the matmuls) factories."""
    from cascadeinfer.engine.llama import DecoderLayer, RotaryEmbedding  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import ModelConfig  # noqa: PLC0415
    from cascadeinfer.kernels import fused  # noqa: PLC0415

    config = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, rms_norm_eps=EPS,
                         rope_theta=500000.0, max_position_embeddings=MAX_POS)
    layer = DecoderLayer(config, 0, dtype=DTYPE, device=torch.device(DEVICE))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.02 if p.dim() > 1 else 0.1) + ("norm" in name))
    rotary = RotaryEmbedding(config, MAX_POS, dtype=DTYPE, device=torch.device(DEVICE))
    o_buf = rows(T, HQ * D).view(T, HQ, D)
    w1, w2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
    c_elementwise = torch.compile(layer_elementwise_ref, dynamic=False)

    def elementwise_inputs():
        qkv = rows(T, (HQ + 2 * HKV) * D)
        return rows(T, HIDDEN), rows(T, HIDDEN, 4.0), qkv, positions(), rows(T, 2 * INTER)

    def elementwise(kind):
        def factory():
            x, r, qkv, pos, gu = elementwise_inputs()
            if kind == "fused":
                q = qkv[:, :HQ * D].view(T, HQ, D)
                k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)

                def run():
                    fused.fused_add_rms_norm(x, r, w1, EPS)
                    fused.apply_rope(q, k, pos, rotary.cos_sin)
                    fused.fused_add_rms_norm(x, r, w2, EPS)  # x stands in for the o_proj output
                    return fused.silu_and_mul(gu)
                return run
            fn = layer_elementwise_ref if kind == "op by op" else c_elementwise
            return lambda: fn(x, r, qkv, pos, rotary.cos_sin, gu, w1, w2)
        return factory

    def whole(kind):
        def factory():
            x, r, pos = rows(T, HIDDEN), rows(T, HIDDEN, 4.0), positions()

            def attention(index, q, k, v):
                return o_buf

            is_fused = kind == "fused"
            return lambda: layer(x, r, pos, rotary, attention, is_fused)
        return factory

    bytes_elementwise = 2 * BYTES["fused_add_rms_norm"] + BYTES["apply_rope"] + BYTES["silu_and_mul"]
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    return ({k: elementwise(k) for k in ("fused", "op by op", "torch.compile")}, bytes_elementwise,
            {k: whole(k) for k in ("fused", "op by op")}, bytes_elementwise + weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write every row as JSON to PATH")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench_cudagraph rep per timing")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused needs a CUDA GPU: it times kernels with CUDA graphs "
                 "(the kernels' correctness is tested on a CPU by tests/test_fused.py)")

    from benchmarks._common import (  # noqa: PLC0415
        environment,
        markdown_table,
        measure_copy_bandwidth,
        write_json,
    )

    torch.manual_seed(0)
    env = environment()
    print(f"# {env['device']}, torch {env['torch']}, triton {env['triton']}")
    print(f"# T={T} hidden={HIDDEN} intermediate={INTER} heads={HQ}/{HKV} head_dim={D} {DTYPE}")
    check()
    copy_bw = measure_copy_bandwidth()
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)

    table = []
    with torch.inference_mode():
        for name, impls in op_cases().items():
            floor = BYTES[name] / copy_bw
            for impl, factory in impls.items():
                if args.no_compile and impl == "torch.compile":
                    continue
                t = time_case(factory, BYTES[name], args.rep_ms)
                table.append({"op": name, "impl": impl, "us": t * 1e6, "GB/s": BYTES[name] / t / 1e9,
                              "floor_us": floor * 1e6, "floor/time": floor / t})
                print(f"{name:20s} {impl:14s} {t * 1e6:8.2f} us  floor {floor * 1e6:6.2f} us", flush=True)
        print()
        print(markdown_table(table, ["op", "impl", "us", "GB/s", "floor_us", "floor/time"]))

        elementwise, ew_bytes, whole, whole_bytes = layer_cases()
        layer_rows = []
        for label, impls, nbytes in (("elementwise only", elementwise, ew_bytes),
                                     ("layer without attention", whole, whole_bytes)):
            floor = nbytes / copy_bw
            for impl, factory in impls.items():
                if args.no_compile and impl == "torch.compile":
                    continue
                t = time_case(factory, nbytes, args.rep_ms)
                layer_rows.append({"part": label, "impl": impl, "us": t * 1e6, "floor_us": floor * 1e6,
                                   "floor/time": floor / t})
                print(f"{label:24s} {impl:14s} {t * 1e6:8.2f} us  floor {floor * 1e6:6.2f} us", flush=True)
    by = {(r["part"], r["impl"]): r["us"] for r in layer_rows}
    print()
    print(markdown_table(layer_rows, ["part", "impl", "us", "floor_us", "floor/time"]))
    for part in ("elementwise only", "layer without attention"):
        saved = by[(part, "op by op")] - by[(part, "fused")]
        print(f"# {part}: fused saves {saved:.1f} us per layer, {saved * LAYERS / 1e3:.2f} ms per "
              f"{LAYERS}-layer step")

    payload = {"env": env, "shapes": {"T": T, "hidden": HIDDEN, "intermediate": INTER, "hq": HQ, "hkv": HKV,
                                      "head_dim": D, "dtype": str(DTYPE)},
               "copy_bandwidth": copy_bw, "ops": table, "layer": layer_rows}
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
