"""Serving through vLLM (docs/serving.md): the model plugin, its multimodal processor, `vlm serve`.

`register` is the `vllm.general_plugins` entry point: vLLM runs it in each of its processes
before it reads a model. vLLM lives in its own venv (`make serve-venv`); nothing else in the
project imports this package.
"""

from __future__ import annotations

# the architecture an export's config.json names, and the one `engine_kwargs` gives the MoE baseline
ARCH = "ConceptMoEForCausalLM"
BASELINE_ARCH = "ConceptMoEBaselineForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    import vlm.model.hf  # noqa: F401 - registers the config, tokenizer and processor (transformers)

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "vlm.serve.model:ConceptMoEForVllm")
        ModelRegistry.register_model(BASELINE_ARCH, "vlm.serve.model:MoEBaselineForVllm")
