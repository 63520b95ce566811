"""ConceptMoE vision-language models: model, trainer, CLI.

Importing the package registers the model with transformers' Auto classes, so that exported
directories load with `AutoModelForCausalLM.from_pretrained`.
"""
from vlm.model import hf as _hf  # noqa: F401  (registration side effect)
