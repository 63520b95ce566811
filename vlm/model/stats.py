"""Per-modality chunking statistics and the loss split by sample kind (text-only vs image-text)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from configs.batch import IGNORE_INDEX, IMAGE, MODALITIES


def sample_has_image(doc_BT: torch.Tensor, modality_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: does the document this position belongs to contain any image token?"""
    B, T = doc_BT.shape
    key = (torch.arange(B, device=doc_BT.device)[:, None] * (T + 1) + doc_BT.clamp_min(0)).flatten()
    has = torch.zeros(B * (T + 1), dtype=torch.long, device=doc_BT.device)
    has.scatter_reduce_(0, key, (modality_BT == IMAGE).long().flatten(), reduce="amax")
    return has[key].view(B, T).bool() & (doc_BT >= 0)


def lm_losses(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, doc_BT, modality_BT):
    """Mean next-token loss, plus the same split into image-text and text-only samples (the paper's mmloss/textloss)."""
    labelled = labels_BT != IGNORE_INDEX
    tok_loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten().clamp_min(0),
                               reduction="none").view_as(labels_BT) * labelled
    n = labelled.sum()
    lm = tok_loss.sum() / n.clamp_min(1)
    mm = sample_has_image(doc_BT, modality_BT)
    split = {}
    for name, sel in (("loss/image_text", labelled & mm), ("loss/text_only", labelled & ~mm)):
        split[name] = (tok_loss.detach() * sel).sum() / sel.sum().clamp_min(1), sel.sum()
    return lm, split


def chunk_stats(p_BT, b_BT, doc_BT, modality_BT) -> dict[str, torch.Tensor]:
    """Tokens, boundaries, realized ratio N/M and mean p, overall and per modality (as 0-d tensors)."""
    valid = doc_BT >= 0
    out = {}
    groups = {"all": valid, **{m: valid & (modality_BT == i) for m, i in MODALITIES.items()}}
    for name, sel in groups.items():
        n = sel.sum()
        nb = (b_BT & sel).sum()
        suffix = "ratio" if name == "all" else name
        out[f"compression/{suffix}"] = n.float() / nb.clamp_min(1).float() if name == "all" else \
            torch.where(nb > 0, n.float() / nb.clamp_min(1).float(), torch.zeros((), device=n.device))
        out[f"tokens/{name}"] = n.float()
        out[f"boundaries/{name}"] = nb.float()
        out[f"boundary_p/{name}"] = (p_BT.detach().float() * sel).sum() / n.clamp_min(1)
    return out


def p_histograms(p_BT, valid_BT, modality_BT, bins: int = 10) -> dict[str, torch.Tensor]:
    """Counts of boundary probabilities in `bins` equal bins over [0, 1], per modality ("p_hist/text", ...)."""
    out = {}
    for name, i in MODALITIES.items():
        sel = p_BT[valid_BT & (modality_BT == i)].float()
        out[f"p_hist/{name}"] = torch.histc(sel, bins=bins, min=0.0, max=1.0)
    return out
