"""ConceptMoE vision-language models: model, trainer, CLI.

Importing the package imports nothing heavy (the `vlm` command starts without torch or
transformers). To load an exported directory with transformers' Auto classes, import `vlm.model.hf`
first: it registers the model, its config, image processor and processor (`import vlm.model.hf`,
then `AutoModelForCausalLM.from_pretrained(dir)`).
"""
