"""The names the plugin's modules share (apart from the package, which imports media.py: no cycle)."""

# the architecture an export's config.json names, and the one `engine_kwargs` gives the MoE baseline
ARCH = "ConceptMoEForCausalLM"
BASELINE_ARCH = "ConceptMoEBaselineForCausalLM"
# the media connector that takes `data:` images only (media.py), by its name in vLLM's registry
# (`VLLM_MEDIA_CONNECTOR`), and the variable naming the export whose image processor bounds them
CONNECTOR = "vlm-data-only"
EXPORT_ENV = "VLM_SERVE_EXPORT"
