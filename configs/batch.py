"""The packed batch: the one interface between data pipelines, the model and the trainer.

A batch is B rows of T positions. Each row packs several documents (and their images) back to back;
`doc_ids` tells them apart and no information may cross them anywhere in the model. Image positions
hold the tokenizer's image-pad id in `input_ids`; the model replaces them, in order (row 0 first,
left to right), by the projected vision tokens of the images listed in `image_grids`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

TEXT, IMAGE = 0, 1
MODALITIES = {"text": TEXT, "image": IMAGE}
IGNORE_INDEX = -100
# The kind of sample a document is, for per-kind statistics (compression is judged per kind:
# docs/design.md, "Compression is judged per document"). Not the shards' sample kinds
# (data_pipelines.schema.SAMPLE_KINDS: a chat turn and a caption are both "pair" there);
# data_pipelines.encode.stats_kind maps a sample to one of these.
KINDS = ("chat", "caption", "interleaved", "text")


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, T] long
    # [B, T] long, next-token targets already shifted; IGNORE_INDEX = no loss
    labels: torch.Tensor
    # [B, T] long, >= 0 per document within a row, -1 for padding
    doc_ids: torch.Tensor
    position_ids: torch.Tensor  # [B, T] long, position within the document
    modality: torch.Tensor  # [B, T] long, TEXT or IMAGE
    pixel_patches: torch.Tensor | None = None  # [P, 3*p*p] float, all images' patches concatenated
    # [P, 2] long, (row, col) of each patch in its image's grid
    patch_coords: torch.Tensor | None = None
    # [I, 2] long, (rows, cols) patch grid of each image, in order
    image_grids: torch.Tensor | None = None
    # Statistics only (the model never reads them): per position, its document's kind (index into
    # KINDS) and data source (index into the run's sources); -1 at padding or where unknown.
    kind: torch.Tensor | None = None  # [B, T] long
    source: torch.Tensor | None = None  # [B, T] long

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(
            **{
                f.name: (
                    None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                )
                for f in fields(self)
            }
        )

    @property
    def valid(self) -> torch.Tensor:
        return self.doc_ids >= 0

    @staticmethod
    def from_documents(
        docs: list[list[int]], pad_id: int = 0, row_len: int | None = None
    ) -> "PackedBatch":
        """Pack text documents (token lists) into ONE row; labels are the next token within each document."""
        ids, labels, doc, pos = [], [], [], []
        for d, toks in enumerate(docs):
            ids += toks
            labels += toks[1:] + [IGNORE_INDEX]
            doc += [d] * len(toks)
            pos += list(range(len(toks)))
        n = row_len or len(ids)
        pad = n - len(ids)
        if pad < 0:
            raise ValueError(f"documents hold {len(ids)} tokens, more than row_len={n}")
        t = lambda xs, fill: torch.tensor(xs + [fill] * pad, dtype=torch.long)[None]  # noqa: E731
        return PackedBatch(
            t(ids, pad_id),
            t(labels, IGNORE_INDEX),
            t(doc, -1),
            t(pos, 0),
            t([TEXT] * len(ids), TEXT),
        )

    @staticmethod
    def stack(rows: list["PackedBatch"]) -> "PackedBatch":
        """Concatenate single-or-multi-row batches of the same T along B (images concatenated in order)."""
        out = {}
        for f in fields(PackedBatch):
            vals = [getattr(r, f.name) for r in rows]
            vals = [v for v in vals if v is not None]
            out[f.name] = torch.cat(vals, 0) if vals else None
        return PackedBatch(**out)
