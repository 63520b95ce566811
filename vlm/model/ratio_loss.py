"""The ratio loss (ConceptMoE eq. 4) over the batch, and its per-document form (beyond the paper).

Legend: S documents.

F (the boundary fraction) carries no gradient; gradients reach p only through G (the mean p)."""

from __future__ import annotations

import math

import torch


def ratio_loss(F_: torch.Tensor, G: torch.Tensor, R: float) -> torch.Tensor:
    """Eq. 4: L_aux = R/(R-1) ((R-1) F G + (1-F)(1-G)); equals 1 at F = G = 1/R. F carries no gradient."""
    return R / (R - 1) * ((R - 1) * F_ * G + (1 - F_) * (1 - G))


def document_ratio_target(F_: torch.Tensor, R: float, slack: float) -> torch.Tensor:
    """A document's own target ratio (beyond the paper): its realized ratio 1/F clamped
    into [R/s, R*s].

    Inside the band eq. 4 at R_d = 1/F is 1 with zero gradient in G, so the document is free;
    outside, the document is pulled towards the nearest edge. F = 0 (no boundary) reads as an
    infinite ratio."""
    return torch.where(F_ > 0, 1 / F_.clamp_min(1e-12), torch.full_like(F_, math.inf)).clamp(
        R / slack, R * slack
    )


def document_ratio_loss(
    n_S: torch.Tensor,
    b_S: torch.Tensor,
    psum_S: torch.Tensor,
    N: torch.Tensor,
    R: float,
    slack: float,
) -> torch.Tensor:
    """Sum over documents d of (n_d / N) * eq. 4(F_d, G_d, R_d), with F_d, G_d a document's own
    boundary fraction and mean p and R_d its `document_ratio_target`. Weighted by tokens over the
    group's global count N, so the gradient on one token's p has the scale of the batch loss's, and
    micro-batch shares sum to the whole."""
    has = n_S > 0
    n = n_S.clamp_min(1)
    F_, G = b_S / n, psum_S / n
    R_d = document_ratio_target(F_, R, slack)
    per_doc = ratio_loss(F_, G, R_d)
    return torch.where(has, per_doc * n_S / N.clamp_min(1), torch.zeros_like(per_doc)).sum()
