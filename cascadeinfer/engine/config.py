"""The engine's settings, validated once when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascadeinfer.layouts.paged_cache import check_kv_layout


def _positive(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs a model.

    Attributes:
        device: where weights, the KV pool and the kernels live.
        dtype: weights, activations and the KV cache (float16 / bfloat16 / float32).
        max_model_len: longest sequence (prompt + output) served.
        page_size: tokens per KV page.
        num_pages: KV pool size in pages; None sizes it from ``gpu_memory_utilization`` of
            the free GPU memory (on CPU: enough for a few sequences of ``max_model_len``).
        gpu_memory_utilization: fraction of the free GPU memory (after the weights) the
            pool and the activations may take.
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens per step (prefill chunks + decode tokens).
        enable_prefix_caching: share full pages of equal prefixes across requests.
        use_cascade: decode attention: True forces the cascade, False flat paged decode,
            None lets the planner's cost model choose every step.
        cascade_levels: levels of the decode cascade (>= 2: shared prefix levels, then the
            per-request suffix; 1 is flat decode).
        enforce_eager: never capture CUDA graphs.
        decode_graph_path: run pure decode steps through the fixed-size buffers of the
            captured-graph path (with the host a step ahead): None does so where graphs are
            captured; True also where they are not (a CPU, ``enforce_eager``: the same path
            run eagerly, for tests); False never.
        max_graph_batch: largest decode batch run through a captured CUDA graph.
        kv_layout: "NHD" or "HND" pages.
        seed: engine seed; requests without a seed derive theirs from it.
        check_metadata: let every kernel validate its index tensors (host syncs; tests).
        record_steps: keep per-step statistics (``LLM.step_stats``) for benchmarks.
        preemption_mode: what happens to a sequence preempted for lack of pages:
            "recompute" (its K/V computed again on re-admission), "swap" (its pages copied
            to host memory and back), or "auto": swap where the copies are estimated
            cheaper than the recompute (:class:`~cascadeinfer.engine.swap.SwapPolicy`).
            With ``tensor_parallel_size > 1`` only "recompute" ("auto" recomputes).
        swap_space: GiB of (pinned, on a GPU) host memory for swapped pages, allocated on
            the first swap; when it is full a victim is recomputed instead.
        tensor_parallel_size: processes (one device each) the model's heads and MLP are
            split over (:mod:`cascadeinfer.engine.parallel`); 1 runs in this process alone.
    """

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    use_cascade: bool | None = None
    cascade_levels: int = 2
    enforce_eager: bool = False
    decode_graph_path: bool | None = None
    max_graph_batch: int = 256
    kv_layout: str = "NHD"
    seed: int = 0
    check_metadata: bool = False
    record_steps: bool = False
    tensor_parallel_size: int = 1
    preemption_mode: str = "auto"
    swap_space: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise TypeError(f"device: expected a torch.device, got {type(self.device).__name__}")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype}")
        for name in ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens",
                     "cascade_levels", "max_graph_batch", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        _positive("num_pages", self.num_pages, allow_none=True)
        if not isinstance(self.gpu_memory_utilization, float) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a float in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "check_metadata", "record_steps"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.decode_graph_path not in (None, True, False):
            raise TypeError(f"decode_graph_path: expected None, True or False, got {self.decode_graph_path!r}")
        if self.use_cascade not in (None, True, False):
            raise TypeError(f"use_cascade: expected None, True or False, got {self.use_cascade!r}")
        check_kv_layout(self.kv_layout)
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode: expected 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.tensor_parallel_size > 1:
            raise ValueError("preemption_mode: 'swap' needs tensor_parallel_size 1 (the workers' pools are not "
                             "swapped); use 'recompute' or 'auto'")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space: expected a non-negative number of GiB, got {self.swap_space!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {self.seed!r}")

    @property
    def use_graphs(self) -> bool:
        """CUDA graphs for pure decode steps: on CUDA, unless eager."""
        return self.device.type == "cuda" and not self.enforce_eager
