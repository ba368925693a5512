"""cascadeinfer as a vLLM (V1, 0.32) attention backend: the thin vLLM-facing layer.

Everything that touches a device is in :mod:`cascadeinfer.integrations.vllm.step`; this
module only adapts vLLM's classes to it:

* :class:`CascadeAttentionBackend` declares what it takes: fp16/bf16/fp32 models with
  an unquantised cache ("auto"), any block size, decoder self-attention without sliding
  window, ALiBi, soft-cap or sinks, and vLLM's ``LBHNC`` cache layout (each layer
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, read in place).
* :class:`CascadeMetadataBuilder` plans each step once (:func:`plan_step`): it asks vLLM
  to put the decode requests first (``reorder_batch_threshold = 1``) and reads the block
  table, the sequence lengths and the query offsets on the host — free on a CPU, one
  small device-to-host copy per step of the block table on a GPU (vLLM keeps it on the
  device). CUDA graphs: ``NEVER``, honestly: the plan is host work of each step, so vLLM
  may capture the layers around attention (piecewise graphs) but not attention itself.
* :class:`CascadeAttentionImpl` writes the layer's new K/V and attends
  (:func:`run_step`), inside ``forward``.

``CASCADEINFER_VLLM_USE_CASCADE=1`` (or ``0``) forces the decode rows' cascade (or flat
decode) instead of the planner's choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from cascadeinfer.integrations.vllm.step import StepPlan, plan_step, run_step

BACKEND_NAME = "CASCADEINFER"


@dataclass
class CascadeMetadata:
    """One step's plan, shared by every layer of the step."""

    plan: StepPlan


class CascadeAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 96, 128, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[CascadeAttentionImpl]:
        return CascadeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CascadeMetadataBuilder]:
        return CascadeMetadataBuilder


class CascadeMetadataBuilder(AttentionMetadataBuilder[CascadeMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        model = vllm_config.model_config
        self.num_qo_heads = model.get_num_attention_heads(vllm_config.parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.block_size = kv_cache_spec.block_size
        self.dtype = kv_cache_spec.dtype
        self.use_cascade = _use_cascade()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CascadeMetadata:
        m = common_attn_metadata
        # Host copies: vLLM's own of the lengths (exact without speculative decoding) where it
        # keeps one; the block table is read from the device (one copy per step on a GPU).
        seq_lens = m.seq_lens_cpu_upper_bound if m.seq_lens_cpu_upper_bound is not None else m.seq_lens
        num_blocks = self.vllm_config.cache_config.num_gpu_blocks  # None: not checked
        plan = plan_step(m.block_table_tensor[:m.num_reqs], seq_lens[:m.num_reqs], m.query_start_loc_cpu[:m.num_reqs + 1],
                         m.slot_mapping, m.num_actual_tokens, block_size=self.block_size, num_blocks=num_blocks,
                         num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         dtype=self.dtype, device=self.device, use_cascade=self.use_cascade)
        return CascadeMetadata(plan)


def _use_cascade() -> bool | None:
    """``CASCADEINFER_VLLM_USE_CASCADE``: "1" forces the decode rows' cascade, "0" flat
    decode; unset (or empty), the planner chooses each step."""
    value = os.environ.get("CASCADEINFER_VLLM_USE_CASCADE", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"CASCADEINFER_VLLM_USE_CASCADE: expected 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


class CascadeAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = [name for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                                ("logits_soft_cap", logits_soft_cap or None), ("sinks", sinks))
                       if value is not None]
        if unsupported or attn_type != AttentionType.DECODER or kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"{BACKEND_NAME}: decoder self-attention with an unquantised cache only; this layer has "
                f"attn_type={attn_type}, kv_cache_dtype={kv_cache_dtype}, {', '.join(unsupported) or 'no extras'}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: CascadeMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME}: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs
            return output
        writes = self.kv_sharing_target_layer_name is None
        return run_step(attn_metadata.plan, query, key if writes else None, value if writes else None, kv_cache,
                        output, self.scale)
