"""The training config's `loss:` section: the weight of each term of the training loss
(vlm.train.losses.TERMS), and the move of the weights older model configs held into it.

The weights are the run's, not the model's: a run that continues a checkpoint (train.init_from,
stage ct, a chain's later stage) states its own, as it states its learning rate, and the stored
model's settings do not constrain them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from configs.config import ValidatedOnInit, check
from vlm.model.config import MOVED_LOSS_KEYS, pop_moved_loss_keys


@dataclass
class LossConfig(ValidatedOnInit):
    """Weights of the loss terms; the LM loss's is 1. A weight of 0 leaves its term out (it is not
    computed)."""

    # ConceptMoE eq. 4's lambda: the ratio loss (model.chunk.target_ratio); a model without a chunk
    # module has none
    ratio: float = 0.03
    # the per-document ratio loss outside the band model.chunk.document_slack sets, relative to the
    # batch term's (ratio): inside the band it is 0, so a large weight only sets how hard a document
    # outside it is pulled back against the LM loss's pressure
    document: float = 30.0
    # the Switch balance loss of every MoE layer (0 leaves balancing to the loss-free bias,
    # model.moe.loss_free_balancing, as Grove and DeepSeek-V3 do)
    balance: float = 0.01
    z: float = 0.0  # the router z-loss (ST-MoE) of every MoE layer
    # the concept model's MoE layers' own balance and z-loss weights; null: as balance / z
    concept_balance: float | None = None
    concept_z: float | None = None

    def validate(self) -> None:
        for name in ("ratio", "balance", "z", "concept_balance", "concept_z"):
            v = getattr(self, name)
            check(v is None or v >= 0, f"loss.{name} must be >= 0 (0: the term is off), got {v}")
        check(self.document > 0, f"loss.document must be > 0, got {self.document}")

    def router_weight(self, term: str, concept: bool) -> float:
        """The weight of router loss `term` ("balance", "z") in a token-level or concept-level MoE
        layer."""
        own = getattr(self, f"concept_{term}") if concept else None
        return getattr(self, term) if own is None else own


def move_loss_keys(data: dict, say=None) -> dict:
    """A training config mapping (a YAML chain with its overrides, a run's config.yaml) whose model
    section states loss weights the way older versions did (MOVED_LOSS_KEYS), with them moved to
    its `loss:` section, in place; a weight the loss section states itself wins. `say(line)` is told
    one line per key moved (None: quiet)."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data
    concept = model.get("concept_moe")
    moved = pop_moved_loss_keys(model)
    if not moved:
        return data
    if data.get("loss") is None:
        data["loss"] = {}
    loss = data["loss"]
    if not isinstance(loss, dict):
        return data  # a loss section that is not a mapping: from_dict says so in one line
    defaults = LossConfig()
    unstated = set()
    for term in ("balance", "z"):
        token_key, concept_key = MOVED_TOKEN_CONCEPT[term]
        token = moved.get(token_key, loss.get(term, getattr(defaults, term)))
        # a concept_moe section was a MoEConfig of its own: a weight it did not state was the
        # default's, not moe's (a null concept_moe: the concept layers were moe's)
        if isinstance(concept, dict) and concept_key not in moved and token_key in moved:
            moved[concept_key] = getattr(defaults, term)
            unstated.add(concept_key)
        if moved.get(concept_key, token) == token:  # the concept layers weighed as the others
            moved.pop(concept_key, None)
    for old, value in moved.items():
        new = MOVED_LOSS_KEYS[old].split(".", 1)[1]
        said = f"model.{old}" if old not in unstated else f"model.concept_moe's default {old[12:]}"
        if new in loss:
            line = (
                f"note: {said} is loss.{new} now; loss.{new}={loss[new]} states it, "
                f"{value} is not used"
            )
        else:
            loss[new] = value
            line = (
                f"note: {said} is loss.{new} now (the training config's loss section); "
                f"read as loss.{new}={value}"
            )
        if say is not None:
            say(line)
    return data


MOVED_TOKEN_CONCEPT = {
    term: (f"moe.{term}_loss_weight", f"concept_moe.{term}_loss_weight")
    for term in ("balance", "z")
}


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr)
