"""Reading a Llama-family checkpoint from a local Hugging Face directory.

A model directory holds ``config.json`` (plus ``generation_config.json`` optionally), the
weights as ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``) and optionally ``tokenizer.json``. Nothing is ever
downloaded. Every missing or malformed piece raises :class:`ModelLoadError` (a
``ValueError``) that names the file and the key.

:class:`ModelConfig` is the part of ``config.json`` the engine uses. Both spellings of the
RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4) and
``rope_parameters`` (transformers 5). Presets give the shapes of well-known models for
random-weight benchmarks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


# ModelConfig fields spelled differently in config.json: errors name the file's key.
_CONFIG_KEYS = {"num_layers": "num_hidden_layers", "num_qo_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads"}


class ModelLoadError(ValueError):
    """A model directory, config or weight file that the engine cannot use."""


def parse_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` etc. to a float dtype the kernels take."""
    if isinstance(name, torch.dtype):
        if name in (torch.float32, torch.float16, torch.bfloat16):
            return name
        raise ValueError(f"{what}: expected float32, float16 or bfloat16, got {name}")
    if not isinstance(name, str) or name.lower() not in _DTYPES:
        raise ValueError(f"{what}: expected one of float32, float16, bfloat16, got {name!r}")
    return _DTYPES[name.lower()]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: ``"linear"`` (positions / factor) or ``"llama3"`` (Llama 3.1)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ModelLoadError(
                f"config.json: rope scaling type {self.rope_type!r} is not supported "
                "(supported: default, linear, llama3)")
        if not self.factor > 0:
            raise ModelLoadError(f"config.json: rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ModelLoadError(
                "config.json: llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes and constants of a Llama-family decoder (Llama 2/3, Mistral, Qwen2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    torch_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"config.json: model_type {self.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_qo_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"config.json: {_CONFIG_KEYS.get(name, name)} must be a positive int, "
                                     f"got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ModelLoadError(f"config.json: rope_theta must be > 0, got {self.rope_theta}")

    @property
    def context_length(self) -> int:
        """Longest sequence the engine serves: the position limit, and the sliding window
        when one is active (within it, sliding-window attention is full attention)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_qo_heads + 2 * self.num_kv_heads) * d + self.num_qo_heads * d * h
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None, source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict (and ``generation_config.json``)."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type is None:
            archs = cfg.get("architectures") or []
            model_type = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

        def need(key: str):
            if key not in cfg:
                raise ModelLoadError(f"{source}: missing required key {key!r}")
            return cfg[key]

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (the SwiGLU MLP needs 'silu')")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        # Absent or null means "the default"; any other value, 0 included, is checked as given.
        head_dim = cfg.get("head_dim")
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            head_dim = hidden // heads
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads
        theta, scaling = _rope_settings(cfg, source)
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = _token_ids(cfg.get("eos_token_id"), source)
        if generation:
            eos = tuple(dict.fromkeys(eos + _token_ids(generation.get("eos_token_id"), "generation_config.json")))
        dtype_name = cfg.get("dtype", cfg.get("torch_dtype"))
        try:
            return cls(
                model_type=model_type,
                vocab_size=need("vocab_size"),
                hidden_size=hidden,
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_qo_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                sliding_window=sliding,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
                torch_dtype=parse_dtype(dtype_name, f"{source}: dtype") if dtype_name else None,
            )
        except ValueError as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{source}: {exc}") from None

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        path = _model_dir(model_dir)
        cfg = _read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.exists() else None
        return cls.from_dict(cfg, generation, source=str(path / "config.json"))


def _rope_settings(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:  # transformers 4 spelling
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object, got {type(params).__name__}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    try:
        return theta, RopeScaling(
            rope_type=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
        )
    except ModelLoadError as exc:
        raise ModelLoadError(str(exc).replace("config.json", source, 1)) from None


def _token_ids(value: object, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


# Shapes of well-known models, for benchmarks with random weights (no checkpoint needed).
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_qo_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128009), torch_dtype=torch.bfloat16),
    "llama3-70b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_qo_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128009), torch_dtype=torch.bfloat16),
    "llama2-7b": ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_qo_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=4096,
        bos_token_id=1, eos_token_ids=(2,), torch_dtype=torch.float16),
    "qwen2-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_qo_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768,
        qkv_bias=True, eos_token_ids=(151643,), torch_dtype=torch.bfloat16),
    "tiny": ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_qo_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name], **overrides)


# ---- files ------------------------------------------------------------------------


def _model_dir(model_dir: str | os.PathLike) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model_dir: {str(path)!r} is not a directory (models are read locally, never downloaded)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model_dir: {str(path)!r} has no config.json")
    return path


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: malformed JSON ({exc})") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror})") from None


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, else every
    ``*.safetensors`` in the directory (sorted)."""
    path = _model_dir(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: lists shard {f.name!r}, which is not in {str(path)!r}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"model_dir: no *.safetensors weights in {str(path)!r} (pytorch_model.bin is not supported)")
    return files


def iter_checkpoint_tensors(model_dir: str | os.PathLike, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield ``(name, tensor, file)`` for every tensor of every weight file, one at a time."""
    try:
        from safetensors import SafetensorError, safe_open  # noqa: PLC0415
    except ImportError:
        raise ModelLoadError("safetensors is not installed: pip install safetensors") from None
    for file in weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), file
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: malformed safetensors file ({exc})") from None


def load_tokenizer(model_dir: str | os.PathLike):
    """The checkpoint's ``tokenizers.Tokenizer`` from ``tokenizer.json``, or None without one."""
    path = _model_dir(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415
    except ImportError:
        raise ModelLoadError("tokenizer.json found but the tokenizers package is missing: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises its own exception type
        raise ModelLoadError(f"{path}: malformed tokenizer ({exc})") from None
