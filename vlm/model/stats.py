"""Per-modality chunking statistics and the loss split by sample kind (text-only vs image-text).

Legend: B rows, T tokens, D width, N tokens of every row.

The LM loss is computed from a model output's final hidden states and output layer in tiles of
tokens (vlm.model.tiled_loss), never from `[B, T, V]` logits.
"""

from __future__ import annotations

import torch

from configs.batch import IGNORE_INDEX, IMAGE, MODALITIES
from vlm.model.moe import mean_adjugate_per_token


def sample_has_image(doc_BT: torch.Tensor, modality_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: does the document this position belongs to contain any image token?"""
    B, T = doc_BT.shape
    key = (torch.arange(B, device=doc_BT.device)[:, None] * (T + 1) + doc_BT.clamp_min(0)).flatten()
    has = torch.zeros(B * (T + 1), dtype=torch.long, device=doc_BT.device)
    has.scatter_reduce_(0, key, (modality_BT == IMAGE).long().flatten(), reduce="amax")
    return has[key].view(B, T).bool() & (doc_BT >= 0)


def lm_labels(batch) -> torch.Tensor:
    """[B, T] the targets of the LM loss: the batch's labels, with every image token left out
    (images are never predicted, whatever the data says)."""
    return batch.labels.masked_fill(batch.modality == IMAGE, IGNORE_INDEX)


def lm_token_losses(out, labels_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] fp32: the next-token loss at each labelled position (0 elsewhere), with its gradient,
    from the output's final hidden states and output layer, a tile of tokens at a time
    (vlm.model.tiled_loss: no [T, V] logits)."""
    labelled = labels_BT != IGNORE_INDEX
    loss_N = out.head(
        out.final_BTD.flatten(0, 1), labels_BT.flatten().clamp_min(0), out.tile_tokens
    )
    return loss_N.view_as(labels_BT) * labelled


def lm_losses(out, labels_BT: torch.Tensor, doc_BT, modality_BT):
    """Mean next-token loss of a model's output (`lm_token_losses`), the same split into image-text
    and text-only samples (the paper's mmloss/textloss), and the detached per-position loss [B, T]
    (0 where unlabelled) for statistics by kind and source."""
    labelled = labels_BT != IGNORE_INDEX
    tok_loss = lm_token_losses(out, labels_BT)
    n = labelled.sum()
    lm = tok_loss.sum() / n.clamp_min(1)
    mm = sample_has_image(doc_BT, modality_BT)
    split = {}
    for name, sel in (("loss/image_text", labelled & mm), ("loss/text_only", labelled & ~mm)):
        split[name] = (tok_loss.detach() * sel).sum() / sel.sum().clamp_min(1), sel.sum()
    return lm, split, tok_loss.detach()


def lm_loss(out, batch) -> torch.Tensor:
    """0-d: the mean next-token loss of a model's output on `batch` (with its gradient)."""
    return lm_losses(out, lm_labels(batch), batch.doc_ids, batch.modality)[0]


def chunk_stats(p_BT, b_BT, doc_BT, modality_BT) -> dict[str, torch.Tensor]:
    """Tokens, boundaries, realized ratio N/M and mean p, overall and per modality (as 0-d tensors)."""
    valid = doc_BT >= 0
    out = {}
    groups = {"all": valid, **{m: valid & (modality_BT == i) for m, i in MODALITIES.items()}}
    for name, sel in groups.items():
        n = sel.sum()
        nb = (b_BT & sel).sum()
        suffix = "ratio" if name == "all" else name
        out[f"compression/{suffix}"] = (
            n.float() / nb.clamp_min(1).float()
            if name == "all"
            else torch.where(
                nb > 0, n.float() / nb.clamp_min(1).float(), torch.zeros((), device=n.device)
            )
        )
        out[f"tokens/{name}"] = n.float()
        out[f"boundaries/{name}"] = nb.float()
        out[f"boundary_p/{name}"] = (p_BT.detach().float() * sel).sum() / n.clamp_min(1)
    return out


def summarize(out, batch) -> dict[str, float]:
    """The scalar statistics of one forward as Python floats, in one host transfer: the LM loss
    (`loss/lm`) and its split by sample kind (a kind absent from the batch is absent here), and
    tokens / boundaries / realized ratio / mean p overall and per modality (eval mode gives the
    realized compression at p >= 0.5)."""
    valid = batch.doc_ids >= 0
    b_BT = out.chunks.b_BT if out.chunks is not None else valid
    p_BT = out.chunks.p_BT if out.chunks is not None else valid.float()
    tensors = chunk_stats(p_BT, b_BT, batch.doc_ids, batch.modality)
    lm, split, _ = lm_losses(out, lm_labels(batch), batch.doc_ids, batch.modality)
    for name, (val, n) in split.items():
        tensors[name], tensors[name + "#n"] = val, n.float()
    tensors["loss/lm"] = lm.detach()
    stats = dict(zip(tensors, torch.stack([t.float() for t in tensors.values()]).tolist()))
    for name in split:
        if stats.pop(name + "#n") == 0:
            stats.pop(name)
    if out.moe_passes:
        stats["moe/adjugate_per_token"] = float(mean_adjugate_per_token(list(out.moe.values())))
    if out.chunks is not None:
        stats["chunk/overflow"] = float(out.chunks.overflow)
    return stats
