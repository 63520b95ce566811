"""The recipes `vlm experiment` knows, by name (each module has one `recipe()`)."""

from __future__ import annotations

import eval.experiments.compression_allocation as compression_allocation
import eval.experiments.ct_conversion as ct_conversion
import eval.experiments.dynamic_vs_fixed as dynamic_vs_fixed
import eval.experiments.flip_noise as flip_noise
import eval.experiments.global_parser as global_parser
import eval.experiments.image_compression as image_compression
import eval.experiments.joint_decoding as joint_decoding
import eval.experiments.nope_middle as nope_middle
import eval.experiments.router as router

RECIPES = {
    "compression-allocation": compression_allocation.recipe,
    "dynamic-vs-fixed": dynamic_vs_fixed.recipe,
    "router": router.recipe,
    "flip-noise": flip_noise.recipe,
    "global-parser": global_parser.recipe,
    "joint-decoding": joint_decoding.recipe,
    "ct-conversion": ct_conversion.recipe,
    "image-compression": image_compression.recipe,
    "nope-middle": nope_middle.recipe,
}
