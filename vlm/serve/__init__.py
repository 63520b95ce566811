"""Serving through vLLM (docs/serving.md): the model plugin, its multimodal processor, `vlm serve`.

`register` is the `vllm.general_plugins` entry point: vLLM runs it in each of its processes
before it reads a model (the API server's too, which loads the images through the connector it
registers). vLLM lives in its own venv (`make serve-venv`); nothing else in the
project imports this package.
"""

from __future__ import annotations

# the architecture an export's config.json names, and the one `engine_kwargs` gives the MoE baseline
ARCH = "ConceptMoEForCausalLM"
BASELINE_ARCH = "ConceptMoEBaselineForCausalLM"
# the media connector that takes `data:` images only (media.py), by its name in vLLM's registry
# (`VLLM_MEDIA_CONNECTOR`), and the variable naming the export whose image processor bounds them
CONNECTOR = "vlm-data-only"
EXPORT_ENV = "VLM_SERVE_EXPORT"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    import vlm.model.hf  # noqa: F401 - registers the config, tokenizer and processor (transformers)
    from vlm.serve.media import DataOnlyConnector

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR)(DataOnlyConnector)
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "vlm.serve.model:ConceptMoEForVllm")
        ModelRegistry.register_model(BASELINE_ARCH, "vlm.serve.model:MoEBaselineForVllm")
