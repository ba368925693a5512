"""One decoder module for Llama 2/3, Mistral and Qwen2.

The architecture: token embedding, ``num_layers`` blocks of (RMSNorm → GQA attention with
RoPE → residual, RMSNorm → SwiGLU MLP → residual), a final RMSNorm and the LM head
(tied to the embedding when the checkpoint says so). The differences between the three
families are flags of :class:`~cascadeinfer.engine.model_loader.ModelConfig`: Qwen2 has
q/k/v biases, Llama may have attention and MLP biases, Mistral may have a sliding window
(the engine caps the context at it), and the RoPE frequencies follow the checkpoint's
theta and scaling (default, linear, llama3).

Tokens are flat: ``[num_tokens, hidden]`` with an explicit position per token; there is no
batch dimension. Attention is not done here: each layer hands its ``q, k, v`` to the
``attention`` callable of the step (the model runner's, which appends K/V to the paged
pool and runs the prefill / cascade kernels). With the fused kernels on, an attention
that says it can (:data:`Attention`) also takes over the rotary embedding, so that the
rotation of k and its append to the pool are one pass. The operations and their order
follow Hugging Face's implementation, so that both give the same numbers.

q/k/v and gate/up projections are fused into one weight each; loading a checkpoint
copies the Hugging Face tensors into their slices.

The elementwise work runs one of two ways, chosen by ``fused`` (same numbers either way):
the fused kernels of :mod:`cascadeinfer.kernels.fused` (the residual add folded into the
next RMSNorm, RoPE in place on the q/k views of the qkv output, SiLU-and-mul in one pass),
or the modules below, written op by op like Hugging Face's. Layers pass the residual
stream beside their output (``x, residual``) so that the add can live in the next norm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cascadeinfer._device import use_triton
from cascadeinfer.engine.model_loader import (
    ModelConfig,
    ModelLoadError,
    iter_checkpoint_tensors,
)
from cascadeinfer.kernels.fused import (
    apply_rope,
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
)

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D], q and k
# rotated. An attention whose attribute ``applies_rope`` is true is called instead, when the
# layer runs fused, as attention(layer_index, q, k, v, positions [T], cos_sin [max_positions, D])
# with q and k not yet rotated: it rotates both in place (apply_rope's contract: cos_sin is
# RotaryEmbedding's table) before it reads them. Unfused layers call every attention the
# first way, so such an attention still accepts it.
Attention = Callable[..., torch.Tensor]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, scaled as the checkpoint says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of positions ``[0, max_positions)`` in the model dtype (HF rounds them so).

    One table ``cos_sin [max_positions, head_dim]``: the cos of the ``head_dim / 2``
    frequencies, then their sin (the layout :func:`apply_rope` reads).
    """

    def __init__(self, config: ModelConfig, max_positions: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(config).to(device)
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (positions ``[T]``), op by op."""
        cos, sin = self.cos_sin.index_select(0, positions)[:, None, :].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # HF's cat(freqs, freqs)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """The same rotation in place, one kernel for q and k (strided views are fine)."""
        apply_rope(q, k, positions, self.cos_sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; with no residual yet, ``(norm(x), x)``.

        Fused, the sum and the norm are written over ``residual`` and ``x`` in one pass;
        both must be tensors this model owns (fresh outputs of its own ops).
        """
        if residual is None:
            return (rms_norm(x, self.weight, self.eps) if fused else self(x)), x
        if fused:
            fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


def _bias(rows: int, enabled: bool, dtype: torch.dtype, device: torch.device) -> nn.Parameter | None:
    if not enabled:
        return None
    return nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)


class TensorParallel:
    """This process's shard of a tensor-parallel model (Megatron-style).

    ``size`` ranks of ``group`` (``torch.distributed``) split the query and KV heads and
    the MLP's intermediate dimension evenly: rank ``rank`` holds heads
    ``[rank * H / size, (rank + 1) * H / size)`` of q, k and v and the same slice of the
    intermediate units, so the QKV and gate/up projections are column-parallel (its rows
    of their weights) and the o and down projections row-parallel (its columns), summed
    across ranks by one all-reduce each. Embedding, norms and LM head are whole on every
    rank, so every rank computes the same logits. Head and unit counts must divide.
    """

    def __init__(self, rank: int, size: int, group=None):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size: expected a positive int, got {size!r}")
        if not 0 <= rank < size:
            raise ValueError(f"rank: expected 0 <= rank < {size}, got {rank}")
        self.rank, self.size, self.group = rank, size, group

    def check(self, config: ModelConfig) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(config, name)
            if value % self.size:
                raise ValueError(f"tensor_parallel_size: {self.size} does not divide the model's {name} ({value})")

    def part(self, n: int) -> slice:
        """This rank's slice of ``n`` (a multiple of ``size``)."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x


_WHOLE = TensorParallel(0, 1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, *, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = _WHOLE):
        super().__init__()
        self.index = index
        self.tp = tp
        h, d = config.hidden_size, config.head_dim
        hq, hkv, inter = config.num_qo_heads // tp.size, config.num_kv_heads // tp.size, config.intermediate_size // tp.size
        self.num_qo_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        qkv_rows = (hq + 2 * hkv) * d
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.qkv_proj = _weight(qkv_rows, h, dtype, device)
        self.qkv_bias = _bias(qkv_rows, config.qkv_bias, dtype, device)
        self.o_proj = _weight(h, hq * d, dtype, device)
        self.o_bias = _bias(h, config.o_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.gate_up_proj = _weight(2 * inter, h, dtype, device)
        self.gate_up_bias = _bias(2 * inter, config.mlp_bias, dtype, device)
        self.down_proj = _weight(h, inter, dtype, device)
        self.down_bias = _bias(h, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attention: Attention, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output is their sum, which the next norm
        forms. ``residual`` is None for the first layer (``x`` is then the embedding)."""
        tokens = x.shape[0]
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        h, residual = self.input_layernorm.add_norm(x, residual, fused)
        qkv = F.linear(h, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
        if not fused:
            q, k = rotary(positions, q, k)
            o = attention(self.index, q, k, v)
        elif getattr(attention, "applies_rope", False):
            # The attention rotates q and k as it appends K/V: k is read and written once.
            o = attention(self.index, q, k, v, positions, rotary.cos_sin)
        else:
            rotary.rotate_(positions, q, k)
            o = attention(self.index, q, k, v)
        h = self._row_parallel(o.view(tokens, hq * d), self.o_proj, self.o_bias)
        h, residual = self.post_attention_layernorm.add_norm(h, residual, fused)
        gate_up = F.linear(h, self.gate_up_proj, self.gate_up_bias)
        if fused:
            h = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self._row_parallel(h, self.down_proj, self.down_bias), residual

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` where every rank holds a slice of ``x``'s features and
        the matching columns of ``weight``: the partial products summed across ranks, the
        bias added once."""
        if self.tp.size == 1:
            return F.linear(x, weight, bias)
        out = self.tp.all_reduce(F.linear(x, weight))
        return out if bias is None else out + bias


class LlamaForCausalLM(nn.Module):
    """The decoder with weights in ``dtype`` on ``device`` (uninitialised until loaded).

    ``max_positions`` bounds the RoPE table (the engine passes its context length).
    ``fused`` runs the elementwise work through the fused kernels; None (the default)
    chooses them where Triton runs (CUDA, or the interpreter) and the op-by-op modules
    on a plain CPU, where the kernels' PyTorch path would only add float32 round trips.
    Both give the same numbers (the kernels reproduce the modules' roundings); the
    attribute may be switched later.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None, fused: bool | None = None, tp: TensorParallel = _WHOLE):
        super().__init__()
        device = torch.device(device)
        tp.check(config)
        self.config = config
        self.tp = tp
        # The heads this process attends over (all of them without tensor parallelism).
        self.num_qo_heads, self.num_kv_heads = config.num_qo_heads // tp.size, config.num_kv_heads // tp.size
        self.dtype = dtype
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected a bool or None, got {type(fused).__name__}")
        self.fused = use_triton(device) if fused is None else fused
        h, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = _weight(vocab, h, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype=dtype, device=device, tp=tp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None if config.tie_word_embeddings else _weight(vocab, h, dtype, device)
        self.rotary = RotaryEmbedding(config, max_positions or config.context_length, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        logits_index: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of the tokens ``logits_index`` (all if None).

        ``input_ids``, ``positions``: int64 ``[num_tokens]``; ``attention`` is called once
        per layer (see :data:`Attention`). ``out``: a ``[rows, vocab]`` buffer to write the
        logits into instead, in its own dtype (the model's: the head's product written in
        place; float32: the cast is that one write); returns ``out``.
        """
        x = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attention, self.fused)
        if logits_index is not None:
            x = x.index_select(0, logits_index)
            residual = None if residual is None else residual.index_select(0, logits_index)
        x, _ = self.norm.add_norm(x, residual, self.fused)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if out is not None and out.dtype == x.dtype:
            return torch.mm(x, head.t(), out=out)
        if out is not None:
            return out.copy_(F.linear(x, head))
        return F.linear(x, head).float()

    # ---- weights ---------------------------------------------------------------------

    def _slots(self) -> dict[str, tuple[torch.Tensor, int, int, tuple[slice, slice]]]:
        """Hugging Face tensor name -> (our tensor, first row, rows, the part of the
        checkpoint tensor it takes: rows and columns; all of it without tensor parallelism)."""
        c, tp = self.config, self.tp
        d = c.head_dim
        q_rows, kv_rows, inter = (c.num_qo_heads // tp.size * d, c.num_kv_heads // tp.size * d,
                                  c.intermediate_size // tp.size)
        whole = (slice(None), slice(None))
        own_rows = lambda n: (tp.part(n), slice(None))  # noqa: E731 - column-parallel: this rank's rows
        own_cols = (slice(None), tp.part(c.num_qo_heads * d))  # row-parallel o_proj: this rank's columns
        slots = {"model.embed_tokens.weight": (self.embed_tokens, 0, c.vocab_size, whole),
                 "model.norm.weight": (self.norm.weight, 0, c.hidden_size, whole)}
        if self.lm_head is not None:
            slots["lm_head.weight"] = (self.lm_head, 0, c.vocab_size, whole)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, c.hidden_size, whole)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, c.hidden_size,
                                                            whole)
            for suffix, tensor in (("weight", layer.qkv_proj), ("bias", layer.qkv_bias)):
                if tensor is not None:
                    slots[p + f"self_attn.q_proj.{suffix}"] = (tensor, 0, q_rows, own_rows(c.num_qo_heads * d))
                    slots[p + f"self_attn.k_proj.{suffix}"] = (tensor, q_rows, kv_rows, own_rows(c.num_kv_heads * d))
                    slots[p + f"self_attn.v_proj.{suffix}"] = (tensor, q_rows + kv_rows, kv_rows,
                                                               own_rows(c.num_kv_heads * d))
            if layer.o_proj is not None:
                slots[p + "self_attn.o_proj.weight"] = (layer.o_proj, 0, c.hidden_size, own_cols)
            if layer.o_bias is not None:
                slots[p + "self_attn.o_proj.bias"] = (layer.o_bias, 0, c.hidden_size, whole)
            for suffix, tensor in (("weight", layer.gate_up_proj), ("bias", layer.gate_up_bias)):
                if tensor is not None:
                    slots[p + f"mlp.gate_proj.{suffix}"] = (tensor, 0, inter, own_rows(c.intermediate_size))
                    slots[p + f"mlp.up_proj.{suffix}"] = (tensor, inter, inter, own_rows(c.intermediate_size))
            slots[p + "mlp.down_proj.weight"] = (layer.down_proj, 0, c.hidden_size,
                                                 (slice(None), tp.part(c.intermediate_size)))
            if layer.down_bias is not None:
                slots[p + "mlp.down_proj.bias"] = (layer.down_bias, 0, c.hidden_size, whole)
        return slots

    @torch.no_grad()
    def load_checkpoint(self, model_dir: str | os.PathLike) -> None:
        """Copy every tensor of the checkpoint into its slot (cast to the model dtype).

        Raises :class:`ModelLoadError` naming the tensor and file on a shape mismatch, and
        listing the tensors the checkpoint lacks. Tensors the model does not use (rotary
        buffers, ...) are ignored.
        """
        slots = self._slots()
        missing = set(slots)
        for name, tensor, file in iter_checkpoint_tensors(model_dir, self.device):
            if name not in slots:
                continue
            dest, start, rows, (part_rows, part_cols) = slots[name]
            full = (rows * self.tp.size if part_rows != slice(None) else rows,
                    *(d * self.tp.size if part_cols != slice(None) else d for d in dest.shape[1:]))
            if tuple(tensor.shape) != full:
                raise ModelLoadError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(full)}")
            part = tensor[part_rows] if tensor.dim() == 1 else tensor[part_rows, part_cols]
            dest[start:start + rows].copy_(part)
            missing.discard(name)
        if missing:
            shown = ", ".join(sorted(missing)[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"model_dir: the checkpoint lacks {len(missing)} tensors the model needs: {shown}{more}")

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (normal with ``std``; norms one, biases zero), for benchmarks."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)

    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads (all but the embedding table, unless tied)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.lm_head is not None:
            total -= self.embed_tokens.numel() * self.embed_tokens.element_size()
        return total
