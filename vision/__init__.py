"""Vision side: image processor, packed NaViT encoder, projector, timm interop, the tower the LLM calls."""

from vision.image_processor import ImageError, ImageProcessor, ImageProcessorConfig, ProcessedImage

__all__ = ["ImageError", "ImageProcessor", "ImageProcessorConfig", "ProcessedImage"]
