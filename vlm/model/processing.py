"""transformers processors for exported models: `AutoProcessor.from_pretrained(final)`
after `import vlm.model.hf`.

Legend: D width, P patches.

The standard multimodal calls work as for LLaVA or Qwen2-VL:

    text = proc.apply_chat_template(messages, add_generation_prompt=True)   # content lists, system role
    inputs = proc(images=[img], text=[text], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16)
    proc.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

The prompt the processor builds is token for token the one the trainer and `ConceptMoEChat` build
(`<bos>`, the chat template of data_pipelines/chat.py, each `<image>` expanded to its image's
tokens): tests/test_hf_processor.py checks it against `make_prompt_batch`.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from transformers import BatchFeature, ProcessorMixin
from transformers.image_processing_utils import BaseImageProcessor

from configs.config import from_dict, to_dict
from data_pipelines.schema import IMAGE_TOKEN
from vision.image_processor import ImageProcessor, ImageProcessorConfig

# data_pipelines/chat.py's template in Jinja, for messages whose content is a string or a list of
# {"type": "image"} / {"type": "text", "text": ...} parts. An image part is `<image>`, and text
# right after an image starts on a new line (the trained `<image>\nquestion`). System messages have
# no turn of their own in training: their text opens the next user turn, on its own line.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- set part_ns = namespace(text='', after_image=false) -%}"
    "{%- if message['content'] is string -%}"
    "{%- set part_ns.text = message['content'] -%}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    "{%- set part_ns.text = part_ns.text + '" + IMAGE_TOKEN + "' -%}"
    "{%- set part_ns.after_image = true -%}"
    "{%- elif part['type'] == 'text' -%}"
    "{%- set part_ns.text = part_ns.text + ('\\n' if part_ns.after_image else '') + part['text'] -%}"
    "{%- set part_ns.after_image = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + part_ns.text + '\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|>' + ns.system + part_ns.text + '<|end|>' }}"
    "{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' + part_ns.text + '<|end|>' }}"
    "{%- else -%}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


class ConceptMoEImageProcessor(BaseImageProcessor):
    """The project's NaViT image processor (vision/image_processor.py) behind transformers'
    interface: any number of images of any size -> packed patches, their grid coordinates and each
    image's grid."""

    model_input_names = ["pixel_patches", "patch_coords", "image_grids"]

    def __init__(self, **kwargs):
        names = {f.name for f in fields(ImageProcessorConfig)}
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        super().__init__(**kwargs)
        self.processor_config = from_dict(ImageProcessorConfig, mine)
        for k, v in to_dict(self.processor_config).items():
            setattr(self, k, v)  # so that save_pretrained writes them to preprocessor_config.json
        self._processor = ImageProcessor(self.processor_config)

    def tokens_per_image(self, grid: tuple[int, int]) -> int:
        m = self.processor_config.merge
        return (grid[0] // m) * (grid[1] // m)

    def preprocess(self, images, return_tensors=None, **kwargs) -> BatchFeature:
        flat = _flatten(images)
        done = [self._processor(im) for im in flat]
        data = {
            "pixel_patches": torch.cat([d.patches_PD for d in done]) if done else torch.zeros(0, 0),
            "patch_coords": torch.cat([d.coords_P2 for d in done])
            if done
            else torch.zeros(0, 2, dtype=torch.long),
            "image_grids": torch.tensor([d.grid for d in done], dtype=torch.long).reshape(-1, 2),
        }
        return BatchFeature(data=data, tensor_type=None)

    def to_dict(self):
        out = super().to_dict()
        out.pop("_processor", None)
        out.pop("processor_config", None)
        return out


def _flatten(images) -> list:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return [im for x in images for im in _flatten(x)]
    return [images]


class ConceptMoEProcessor(ProcessorMixin):
    """Image processor + tokenizer with the chat template; `__call__` expands every `<image>` of the
    text into `<image_start>` + one `<image_pad>` per image token + `<image_end>` and puts `<bos>`
    in front."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # a model continued from a pretrained source speaks the source's template (its tokenizer
        # carries it)
        chat_template = chat_template or getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __call__(
        self, images=None, text=None, return_tensors=None, padding=True, **kwargs
    ) -> BatchFeature:
        if text is None:
            raise ValueError(
                "ConceptMoEProcessor needs text (with one <image> "
                "per image, e.g. from apply_chat_template)"
            )
        texts = [text] if isinstance(text, str) else list(text)
        flat = _flatten(images)
        wanted = sum(t.count(IMAGE_TOKEN) for t in texts)
        if wanted != len(flat):
            raise ValueError(
                f"the text has {wanted} {IMAGE_TOKEN} placeholder(s) but {len(flat)} "
                "image(s) were given: one image per placeholder, in order"
            )
        vision = self.image_processor.preprocess(flat) if flat else None
        grids = vision["image_grids"].tolist() if vision is not None else []
        expanded, k = [], 0
        for t in texts:
            pieces = t.split(IMAGE_TOKEN)
            out = pieces[0]
            for piece in pieces[1:]:
                n = self.image_processor.tokens_per_image(grids[k])
                out += "<image_start>" + "<image_pad>" * n + "<image_end>" + piece
                k += 1
            # None for a source without one (Qwen): trained without it too
            bos = self.tokenizer.bos_token
            expanded.append(out if not bos or out.startswith(bos) else bos + out)
        enc = self.tokenizer(
            expanded,
            add_special_tokens=False,
            padding=padding,
            return_tensors=return_tensors,
            **kwargs,
        )
        data = dict(enc)
        if vision is not None:
            data.update(vision)
        return BatchFeature(data=data, tensor_type=return_tensors)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_patches", "patch_coords", "image_grids"]
