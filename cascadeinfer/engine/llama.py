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
pool and runs the prefill / cascade kernels). The operations and their order follow
Hugging Face's implementation, so that both give the same numbers.

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

from cascadeinfer._checks import use_triton
from cascadeinfer.engine.model_loader import ModelConfig, ModelLoadError, iter_checkpoint_tensors
from cascadeinfer.kernels.fused import apply_rope, fused_add_rms_norm, rms_norm, silu_and_mul

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.index = index
        h, d = config.hidden_size, config.head_dim
        self.num_qo_heads, self.num_kv_heads, self.head_dim = config.num_qo_heads, config.num_kv_heads, d
        qkv_rows = (config.num_qo_heads + 2 * config.num_kv_heads) * d
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.qkv_proj = _weight(qkv_rows, h, dtype, device)
        self.qkv_bias = _bias(qkv_rows, config.qkv_bias, dtype, device)
        self.o_proj = _weight(h, config.num_qo_heads * d, dtype, device)
        self.o_bias = _bias(h, config.o_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.gate_up_proj = _weight(2 * config.intermediate_size, h, dtype, device)
        self.gate_up_bias = _bias(2 * config.intermediate_size, config.mlp_bias, dtype, device)
        self.down_proj = _weight(h, config.intermediate_size, dtype, device)
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
        if fused:
            rotary.rotate_(positions, q, k)
        else:
            q, k = rotary(positions, q, k)
        o = attention(self.index, q, k, v)
        h = F.linear(o.view(tokens, hq * d), self.o_proj, self.o_bias)
        h, residual = self.post_attention_layernorm.add_norm(h, residual, fused)
        gate_up = F.linear(h, self.gate_up_proj, self.gate_up_bias)
        if fused:
            h = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return F.linear(h, self.down_proj, self.down_bias), residual


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
                 max_positions: int | None = None, fused: bool | None = None):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected a bool or None, got {type(fused).__name__}")
        self.fused = use_triton(device) if fused is None else fused
        h, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = _weight(vocab, h, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype=dtype, device=device) for i in range(config.num_layers))
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
        per layer (see :data:`Attention`). ``out``: a float32 ``[rows, vocab]`` buffer to
        write the logits into (the cast from the model's dtype is that one write).
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
        if out is not None:
            return out.copy_(F.linear(x, head))
        return F.linear(x, head).float()

    # ---- weights ---------------------------------------------------------------------

    def _slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face tensor name -> (our tensor, first row, rows) that it fills."""
        c = self.config
        q_rows, kv_rows = c.num_qo_heads * c.head_dim, c.num_kv_heads * c.head_dim
        slots = {"model.embed_tokens.weight": (self.embed_tokens, 0, c.vocab_size),
                 "model.norm.weight": (self.norm.weight, 0, c.hidden_size)}
        if self.lm_head is not None:
            slots["lm_head.weight"] = (self.lm_head, 0, c.vocab_size)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, c.hidden_size)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, c.hidden_size)
            for suffix, tensor in (("weight", layer.qkv_proj), ("bias", layer.qkv_bias)):
                if tensor is not None:
                    slots[p + f"self_attn.q_proj.{suffix}"] = (tensor, 0, q_rows)
                    slots[p + f"self_attn.k_proj.{suffix}"] = (tensor, q_rows, kv_rows)
                    slots[p + f"self_attn.v_proj.{suffix}"] = (tensor, q_rows + kv_rows, kv_rows)
            for suffix, tensor in (("weight", layer.o_proj), ("bias", layer.o_bias)):
                if tensor is not None:
                    slots[p + f"self_attn.o_proj.{suffix}"] = (tensor, 0, c.hidden_size)
            for suffix, tensor in (("weight", layer.gate_up_proj), ("bias", layer.gate_up_bias)):
                if tensor is not None:
                    slots[p + f"mlp.gate_proj.{suffix}"] = (tensor, 0, c.intermediate_size)
                    slots[p + f"mlp.up_proj.{suffix}"] = (tensor, c.intermediate_size, c.intermediate_size)
            for suffix, tensor in (("weight", layer.down_proj), ("bias", layer.down_bias)):
                if tensor is not None:
                    slots[p + f"mlp.down_proj.{suffix}"] = (tensor, 0, c.hidden_size)
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
            dest, start, rows = slots[name]
            want = (rows, *dest.shape[1:])
            if tuple(tensor.shape) != want:
                raise ModelLoadError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
            dest[start:start + rows].copy_(tensor)
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
