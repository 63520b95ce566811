"""Entry-point payload for lmms-eval's model registry (group `lmms_eval.models`).

lmms-eval imports this while building its registry, so it imports nothing heavy; the class itself
is imported only when `--model conceptmoe` is used. pyproject.toml:

    [project.entry-points."lmms_eval.models"]
    conceptmoe = "eval.lmms_manifest:MANIFEST"
"""

from lmms_eval.models.registry_v2 import ModelManifest

MANIFEST = ModelManifest(
    model_id="conceptmoe", simple_class_path="eval.lmms_adapter.ConceptMoELMMS"
)
