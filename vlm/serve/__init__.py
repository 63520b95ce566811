"""Serving through vLLM (docs/serving.md): the model plugin, its multimodal processor, `vlm serve`.

`register` is the `vllm.general_plugins` entry point: vLLM runs it in each of its processes
before it reads a model (the API server's too, which loads the images through the connector it
registers). vLLM lives in its own venv (`make serve-venv`); nothing else in the
project imports this package.
"""

from __future__ import annotations

from vlm.serve.names import ARCH, BASELINE_ARCH, CONNECTOR, EXPORT_ENV

__all__ = ["ARCH", "BASELINE_ARCH", "CONNECTOR", "EXPORT_ENV", "register"]


def register() -> None:
    from vllm import ModelRegistry
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    import vlm.model.hf  # noqa: F401 - registers the config, tokenizer and processor (transformers)
    from vlm.serve.media import DataOnlyConnector

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR)(DataOnlyConnector)
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "vlm.serve.model:ConceptMoEForVllm")
        ModelRegistry.register_model(BASELINE_ARCH, "vlm.serve.model:MoEBaselineForVllm")
