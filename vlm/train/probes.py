"""Activation probes for the dashboard: how large and how varied the vision tokens are next
to the text.

Legend: B rows, T tokens, D width, N flat tokens or patches.

A vision tower that collapses (every image token the same vector) or explodes (norms far above the
text embeddings) leaves the LLM blind while the losses still fall on text; these scalars show it
early. Values are from this rank's last training forward (diagnostics, not global means).
"""

from __future__ import annotations

import torch


class ActivationProbe:
    def __init__(self, module: torch.nn.Module):
        self.values: dict[str, torch.Tensor] = {}
        self.handles = []
        if getattr(module, "vision", None) is not None:
            self.handles.append(module.vision.register_forward_hook(self._vision))
        self.handles.append(module.lm.embed.register_forward_hook(self._embed))

    def _vision(self, mod, inputs, out_ND: torch.Tensor) -> None:
        if not mod.training:
            return
        with torch.no_grad():
            o = out_ND.detach().float()
            self.values["vision/token_norm"] = o.norm(dim=-1).mean()
            # spread across tokens relative to their size: 0 means every image token is the
            # same vector
            if o.shape[0] > 1:
                self.values["vision/token_spread"] = o.std(0).norm() / o.norm(
                    dim=-1
                ).mean().clamp_min(1e-12)

    def _embed(self, mod, inputs, out_BTD: torch.Tensor) -> None:
        if mod.training:
            with torch.no_grad():
                self.values["text/embed_norm"] = out_BTD.detach().float().norm(dim=-1).mean()

    def clear(self) -> None:
        """Forget the last step's values (a skipped step must not report them)."""
        self.values.clear()

    def read(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.values.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
