"""The fused elementwise ops against their references (and the references against the
decoder's unfused modules, which follow Hugging Face's code op by op)."""

from __future__ import annotations

import math

import pytest
import torch

from cascadeinfer.engine.llama import RMSNorm, _rotate_half
from cascadeinfer.kernels.fused import (
    MAX_HIDDEN,
    apply_rope,
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
)
from cascadeinfer.kernels.reference import (
    apply_rope_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Two units in the last place: the kernels reproduce the references' roundings, but on a
# GPU rsqrt/exp may differ by one unit and flip a rounding; fp32 sums may be contracted.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SIZES = (64, 96, 576, 4096)
TOKENS = (0, 1, 7)
EPS = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _rows(tokens: int, cols: int, dtype, device, gen, *, pad: int = 0, scale: float = 1.0) -> torch.Tensor:
    """``[tokens, cols]`` random rows inside a NaN-filled buffer with ``pad`` spare columns
    and two spare rows, so reads past the view show up as NaN and writes past it stay NaN."""
    buf = torch.full((tokens + 2, cols + pad), math.nan, dtype=dtype, device=device)
    buf[:tokens, :cols] = (torch.randn(tokens, cols, generator=gen) * scale).to(dtype)
    return buf[:tokens, :cols]


def _spare_is_nan(view: torch.Tensor) -> bool:
    """The NaN padding around a view made by :func:`_rows` is untouched."""
    base = view._base
    mask = torch.ones(base.shape, dtype=torch.bool, device=base.device)
    mask[:view.shape[0], :view.shape[1]] = False
    return bool(base[mask].float().isnan().all())


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


# ---- RMSNorm --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(dtype, hidden, tokens, device):
    gen = _gen("rms", str(dtype), hidden, tokens)
    x = _rows(tokens, hidden, dtype, device, gen, pad=32, scale=3.0)  # strided rows
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    out = torch.full((tokens, hidden), math.nan, dtype=dtype, device=device)  # poisoned
    assert rms_norm(x, weight, EPS, out=out) is out
    _close(out, rms_norm_ref(x, weight, EPS))
    _close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    assert _spare_is_nan(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm(dtype, hidden, tokens, device):
    gen = _gen("add", str(dtype), hidden, tokens)
    x = _rows(tokens, hidden, dtype, device, gen, pad=16)
    residual = _rows(tokens, hidden, dtype, device, gen, pad=48, scale=4.0)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    want_x, want_res = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert fused_add_rms_norm(x, residual, weight, EPS) is None
    _close(residual, want_res)
    _close(x, want_x)
    assert _spare_is_nan(x) and _spare_is_nan(residual)


def test_rms_norm_in_place_and_on_the_plain_cpu_path(device, monkeypatch):
    gen = _gen("inplace")
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16).to(device)
    weight = torch.randn(96, generator=gen).to(torch.bfloat16).to(device)
    want = rms_norm_ref(x, weight, EPS)
    assert rms_norm(x, weight, EPS, out=x) is x
    _close(x, want)
    # CPU tensors without the interpreter take the references' PyTorch path.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu_x = torch.randn(3, 64, generator=gen)
    cpu_r = torch.randn(3, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    want_x, want_r = fused_add_rms_norm_ref(cpu_x, cpu_r, w, EPS)
    fused_add_rms_norm(cpu_x, cpu_r, w, EPS)
    assert torch.equal(cpu_x, want_x) and torch.equal(cpu_r, want_r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_the_decoders_module(dtype):
    """The reference and llama.RMSNorm (HF's formula, op by op) agree bit for bit."""
    gen = _gen("module", str(dtype))
    x = (torch.randn(6, 96, generator=gen) * 2).to(dtype)
    module = RMSNorm(96, EPS, dtype=dtype, device=torch.device("cpu"))
    module.weight.data.copy_(1 + 0.5 * torch.randn(96, generator=gen))
    assert torch.equal(rms_norm_ref(x, module.weight, EPS), module(x))
    res = torch.randn(6, 96, generator=gen).to(dtype)
    normed, new_res = fused_add_rms_norm_ref(x, res, module.weight, EPS)
    assert torch.equal(new_res, res + x) and torch.equal(normed, module(res + x))
    # float32 math with HF's roundings stays within a unit of the float64 value
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * module.weight.double()
    torch.testing.assert_close(rms_norm_ref(x, module.weight, EPS).double(), exact,
                               rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


# ---- SiLU and mul -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(dtype, inter, tokens, device):
    gen = _gen("silu", str(dtype), inter, tokens)
    gate_up = _rows(tokens, 2 * inter, dtype, device, gen, pad=8, scale=4.0)
    out = torch.full((tokens, inter), math.nan, dtype=dtype, device=device)
    assert silu_and_mul(gate_up, out=out) is out
    want = silu_and_mul_ref(gate_up)
    _close(out, want)
    _close(silu_and_mul(gate_up), want)
    assert _spare_is_nan(gate_up)
    if dtype != torch.float32:  # HF's act_fn(gate) * up, op by op in the dtype
        gate, up = gate_up.cpu().chunk(2, dim=-1)
        assert torch.equal(want.cpu(), torch.nn.functional.silu(gate) * up)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # e^1e4 = inf is the point
def test_silu_and_mul_extreme_gates(device):
    gate = torch.tensor([[-1e4, -100.0, -0.0, 0.0, 100.0, 1e4, -88.0, 89.0]])
    gate_up = torch.cat((gate, torch.full_like(gate, 2.0)), dim=-1).to(device)
    out = silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    _close(out, silu_and_mul_ref(gate_up))


# ---- RoPE ---------------------------------------------------------------------------------


def _cos_sin(max_positions: int, head_dim: int, dtype, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 16), ((6, 2), 96), ((8, 1), 128), ((3, 3), 64)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_apply_rope(dtype, heads, head_dim, tokens, device):
    hq, hkv = heads
    gen = _gen("rope", str(dtype), heads, head_dim, tokens)
    # q and k are views of one fused qkv row buffer (strided rows), padded with NaN
    qkv = _rows(tokens, (hq + 2 * hkv) * head_dim, dtype, device, gen, pad=8, scale=2.0)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    cache = _cos_sin(300, head_dim, dtype, device)
    positions = torch.randint(0, 300, (tokens,), generator=gen).to(device)
    want_q, want_k = apply_rope_ref(q, k, positions, cache)
    apply_rope(q, k, positions, cache, validate=True)
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before) and _spare_is_nan(qkv)


def test_apply_rope_int32_positions_and_reference_is_rotate_half(device):
    dtype, head_dim = torch.bfloat16, 64
    gen = _gen("rope32")
    q = torch.randn(5, 4, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(5, 2, head_dim, generator=gen).to(dtype).to(device)
    cache = _cos_sin(40, head_dim, dtype, device)
    positions = torch.tensor([0, 39, 7, 7, 1], dtype=torch.int32, device=device)
    want_q, want_k = apply_rope_ref(q, k, positions, cache)
    apply_rope(q, k, positions, cache)
    _close(q, want_q)
    _close(k, want_k)
    # HF: x * cos + rotate_half(x) * sin, in the dtype, with cos/sin = cat(f, f) tables
    x = torch.randn(5, 4, head_dim, generator=gen).to(dtype)
    cs = _cos_sin(40, head_dim, dtype, "cpu").index_select(0, positions.cpu().long())[:, None, :]
    cos, sin = cs[..., :head_dim // 2].repeat(1, 1, 2), cs[..., head_dim // 2:].repeat(1, 1, 2)
    hf = x * cos + _rotate_half(x) * sin
    assert torch.equal(apply_rope_ref(x, x[:, :1], positions.cpu(), _cos_sin(40, head_dim, dtype, "cpu"))[0], hf)


# ---- bad input ----------------------------------------------------------------------------


def test_bad_inputs_are_named(device):
    bf16 = torch.bfloat16
    x = torch.randn(3, 64, device=device)
    w = torch.ones(64, device=device)
    cases = [
        (lambda: rms_norm([[1.0] * 64], w, EPS), TypeError, "x: expected a torch.Tensor"),
        (lambda: rms_norm(x[None], w, EPS), ValueError, "x: expected 2 dimensions"),
        (lambda: rms_norm(x.to(torch.int32), w, EPS), TypeError, "x: expected dtype"),
        (lambda: rms_norm(x.t(), torch.ones(3, device=device), EPS), ValueError, "x: the last dimension"),
        (lambda: rms_norm(x, w.to(bf16), EPS), TypeError, "weight"),
        (lambda: rms_norm(x, w[:32], EPS), ValueError, "weight: expected shape"),
        (lambda: rms_norm(x, torch.ones(128, device=device)[::2], EPS), ValueError, "weight: expected a contiguous"),
        (lambda: rms_norm(x, w, -1.0), ValueError, "eps"),
        (lambda: rms_norm(x, w, True), TypeError, "eps"),
        (lambda: rms_norm(x, w, EPS, out=torch.empty(3, 64, dtype=bf16, device=device)), TypeError, "out"),
        (lambda: rms_norm(x, w, EPS, out=torch.empty(3, 32, device=device)), ValueError, "out"),
        (lambda: rms_norm(torch.empty(1, MAX_HIDDEN + 1, device=device),
                          torch.empty(MAX_HIDDEN + 1, device=device), EPS), ValueError, "hidden size"),
        (lambda: fused_add_rms_norm(x, x, w, EPS), ValueError, "residual: overlaps x"),
        (lambda: fused_add_rms_norm(x, x[:2].clone(), w, EPS), ValueError, "residual: expected shape"),
        (lambda: fused_add_rms_norm(x, x.to(bf16), w, EPS), TypeError, "residual"),
        (lambda: silu_and_mul(torch.empty(3, 7, device=device)), ValueError, "gate_up: expected an even"),
        (lambda: silu_and_mul(x, out=torch.empty(3, 64, device=device)), ValueError, "out"),
        (lambda: silu_and_mul(x, out=x[:, :32]), ValueError, "out: overlaps gate_up"),
        (lambda: silu_and_mul(x[None]), ValueError, "gate_up"),
    ]
    q = torch.randn(3, 4, 16, device=device)
    k = torch.randn(3, 2, 16, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    cache = torch.randn(8, 16, device=device)
    cases += [
        (lambda: apply_rope(q[..., :15], k[..., :15], pos, cache[:, :15]), ValueError, "even head_dim"),
        (lambda: apply_rope(q, k.to(bf16), pos, cache), TypeError, "k: expected dtype"),
        (lambda: apply_rope(q, k[:2], pos, cache), ValueError, "k: expected shape"),
        (lambda: apply_rope(q, q[:, :2], pos, cache), ValueError, "k: overlaps q"),
        (lambda: apply_rope(q, k, pos.float(), cache), TypeError, "positions"),
        (lambda: apply_rope(q, k, pos[:2], cache), ValueError, "positions"),
        (lambda: apply_rope(q, k, pos, cache[:, :8]), ValueError, "cos_sin_cache"),
        (lambda: apply_rope(q, k, pos + 8, cache, validate=True), ValueError, r"positions: expected values in \[0, 8\)"),
        (lambda: apply_rope(q.transpose(1, 2), k, pos, cache), ValueError, "q"),
    ]
    before = (x.clone(), q.clone(), k.clone())
    for fn, exc, words in cases:
        with pytest.raises(exc, match=words):
            fn()
    assert torch.equal(before[0], x) and torch.equal(before[1], q) and torch.equal(before[2], k)


# ---- the decoder, fused and op by op ------------------------------------------------------


def _causal_attention(layer, q, k, v):
    """Plain causal attention over the step's tokens (one sequence), for the model tests."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), k.float()) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hts,shd->thd", s.softmax(-1), v.float()).to(q.dtype).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plain_cpu", [False, True])
def test_decoder_fused_equals_op_by_op(dtype, plain_cpu, device, monkeypatch):
    from cascadeinfer.engine.llama import LlamaForCausalLM  # noqa: PLC0415
    from cascadeinfer.engine.model_loader import ModelConfig  # noqa: PLC0415

    if plain_cpu:
        if device.type != "cpu":
            pytest.skip("the plain-CPU path is a CPU path")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    config = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=96, intermediate_size=160, num_layers=2,
                         num_qo_heads=6, num_kv_heads=2, head_dim=16, qkv_bias=True)
    model = LlamaForCausalLM(config, dtype=dtype, device=device, max_positions=32)
    assert model.fused == (not plain_cpu)
    model.init_random_(seed=3, std=0.2)
    with torch.no_grad():
        for layer in model.layers:
            layer.qkv_bias.normal_(0.0, 0.3)
    ids = torch.randint(0, 64, (9,), generator=_gen("ids")).to(device)
    positions = torch.arange(9, device=device)
    index = torch.tensor([8, 3], device=device)
    with torch.inference_mode():
        model.fused = True
        fused = model(ids, positions, _causal_attention, index)
        model.fused = False
        plain = model(ids, positions, _causal_attention, index)
    # Same roundings on both paths; what differs (rsqrt, exp, the order of a sum) moves
    # an activation by a unit in the last place now and then, and the layers carry it on.
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}[dtype]
    torch.testing.assert_close(fused, plain, rtol=tol, atol=tol)
    with pytest.raises(TypeError, match="fused"):
        LlamaForCausalLM(config, dtype=dtype, device=device, fused="yes")
