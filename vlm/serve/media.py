"""How `vlm serve` takes images: inline `data:` URLs only, bounded in pixels before decoding, and
shrunk to the model's patch grid at once with the decode buffers handed back to the operating system.

vLLM's own media connector fetches `http(s)://` URLs (following redirects) and reads `file://` paths
under `--allowed-local-media-path`: through the server, any service the machine reaches would be
reachable. `DataOnlyConnector`, registered under `vlm.serve.CONNECTOR` by the plugin (`vlm.serve.register`)
and chosen by `vlm serve` (`VLLM_MEDIA_CONNECTOR`: `vlm.serve.cli.server_env`), refuses every other URL scheme
with a 400 before anything is fetched or opened. A data URL's image is decoded as `vlm chat` decodes
an attached one (`Conversation._load`): its size read from the header and checked against the
export's `max_pixels` first, then decoded by the model's processor and resized to its patch grid,
so that the server never holds a request's full decoded size past its loading (7000 x 7000 RGB is
147 MB), and glibc's freed pages go back at once (`release_freed_memory`).

Only imported inside vLLM's processes (it imports vllm).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import os

from PIL import Image, UnidentifiedImageError
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.media.base import MediaWithBytes
from vllm.multimodal.media.connector import global_thread_pool
from vllm.multimodal.media.image import ImageMediaIO

from vlm.chat_cli import TRIM_PIXELS, release_freed_memory
from vlm.serve.names import EXPORT_ENV


def refusal(url: str) -> str | None:
    """Why `url` is not taken (one line), or None for a `data:` URL."""
    if url[:5].lower() == "data:":
        return None
    scheme = url.partition(":")[0] if ":" in url[:16] else ""
    what = f"a {scheme}: URL" if scheme else "not a URL with a scheme"
    return (
        f"image URL refused ({what}): this server takes images only inline, as "
        "data:image/...;base64,... URLs; it fetches and opens nothing else"
    )


@functools.lru_cache(maxsize=4)
def _processor(final_dir: str):
    """The export's image processor (what `vlm chat` decodes and resizes with), or None for a
    model without a vision tower."""
    from vlm.model.hf import ConceptMoEConfig

    _, vc = ConceptMoEConfig.from_pretrained(final_dir).build_configs()
    return vc.build_processor() if vc is not None else None


def load_image(data: bytes, processor) -> Image.Image:
    """The image in `data` as the model will see it: its pixel count checked from the header
    (nothing decoded before), then decoded (JPEGs at a reduced scale) and resized to the patch grid
    the processor chooses for it, the processor's own resize, which on the result is then a no-op.
    A bad image is a VLLMValidationError (a 400 naming the problem)."""
    from vision.image_processor import ImageError, choose_grid

    cfg = processor.cfg
    try:
        with Image.open(io.BytesIO(data)) as header:
            w, h = header.size
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as e:
        raise VLLMValidationError(f"image: not an image that can be read ({e})") from None
    if w * h > cfg.max_pixels:
        raise VLLMValidationError(
            f"image: {w}x{h} = {w * h} pixels, over the limit of {cfg.max_pixels} "
            "(the model's max_pixels)"
        )
    try:
        img = processor.load(data, source="image", for_patches=True)
    except ImageError as e:
        raise VLLMValidationError(str(e)) from None
    rows, cols = choose_grid(img.height, img.width, cfg)
    small = img.resize((cols * cfg.patch_size, rows * cfg.patch_size), Image.Resampling.BICUBIC)
    del img
    if w * h >= TRIM_PIXELS:
        release_freed_memory()
    return small


class DataOnlyConnector(MediaConnector):
    """vLLM's media connector, restricted to `data:` URLs (see the module's docstring)."""

    def load_from_url(self, url, media_io, *, fetch_timeout=None):
        if (why := refusal(url)) is not None:
            raise VLLMValidationError(why, parameter="image_url")
        return self._load_data_url(url, media_io)

    async def load_from_url_async(self, url, media_io, *, fetch_timeout=None):
        if (why := refusal(url)) is not None:
            raise VLLMValidationError(why, parameter="image_url")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(global_thread_pool, self._load_data_url, url, media_io)

    def _load_data_url(self, url: str, media_io):
        final = os.environ.get(EXPORT_ENV)
        processor = _processor(final) if final and isinstance(media_io, ImageMediaIO) else None
        if processor is None:  # not an image, or no export named: vLLM's own decoding
            return super()._load_data_url(url, media_io)
        spec, sep, payload = url[5:].partition(",")
        if not sep or spec.rpartition(";")[2] != "base64":
            raise VLLMValidationError(
                "image: a data URL must be base64 (data:image/png;base64,...)",
                parameter="image_url",
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise VLLMValidationError(f"image: bad base64 ({e})", parameter="image_url") from None
        # the bytes travel with the image: vLLM's multimodal cache keys it by them
        return MediaWithBytes(load_image(data, processor), data)
