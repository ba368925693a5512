"""The decode engine: a Llama-family model on the paged KV pool, shared prefixes decoded
by cascade attention.

    from cascadeinfer.engine import LLM, SamplingParams
    llm = LLM("path/to/hf-model-dir")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from cascadeinfer.engine.config import EngineConfig
from cascadeinfer.engine.beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from cascadeinfer.engine.llm import LLM, CompletionOutput, RequestOutput
from cascadeinfer.engine.model_loader import ModelConfig, ModelLoadError
from cascadeinfer.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "RequestOutput",
           "CompletionOutput", "ModelConfig", "ModelLoadError", "EngineConfig"]
