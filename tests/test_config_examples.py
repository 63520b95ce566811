"""Every setting does what it says (issue 36 item 1).

The override examples the README, docs/ and `vlm train --help` give, applied to the default config,
change the value the code acts on (not only the config field): the chunk module's ratio-loss targets
and the dashboard's, the optimizer's learning rate, the boundary sampler's seed. A key that another
would silently shadow is refused in one line naming both. The allow-lists of keys a continued or
resumed run may change name real config fields.
"""

from __future__ import annotations

import re

import pytest
import torch

from configs.batch import IMAGE, TEXT
from configs.config import ConfigError, flatten, to_dict
from vlm.train.config import MAY_CHANGE_FROM_CHECKPOINT, TrainConfig, load_train_config
from vlm.train.losses import ratio_groups
from vlm.train.run_config import OPTIM_CHANGES, RESUMABLE_CHANGES, config_targets

DEFAULT = "configs/default.yaml"


def chunk_targets(cfg: TrainConfig) -> dict:
    """What the ratio loss trains the chunk module towards (vlm.train.losses): each ratio group's
    target, by modality."""
    doc = torch.zeros(1, 2, dtype=torch.long)
    modality = torch.tensor([[TEXT, IMAGE]])
    groups = ratio_groups(cfg.model.chunk, doc, modality)
    return {tuple(mask[0].tolist()): r for mask, r in groups}


def optimizer_lr(cfg: TrainConfig) -> float:
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.train.engine import build_optimizer
    from vlm.train.param_groups import build_param_groups

    model = ConceptMoELM(cfg.model)
    groups = build_param_groups(
        model, cfg.optim, cfg.params, cfg.model.hidden_size, cfg.model.c_hidden
    )
    opt = build_optimizer(groups, cfg.optim)
    return max(g["lr"] for g in opt.param_groups)


def boundary_noise_seed(cfg: TrainConfig) -> int:
    from vlm.train.step import boundary_seed

    return boundary_seed(cfg.train.seed, 0, 0)


# key -> what the code acts on (a function of the built config); every example key needs one
ACTS_ON = {
    "model.chunk.target_ratio": lambda cfg: (chunk_targets(cfg), config_targets(cfg)),
    "optim.lr": optimizer_lr,
    "train.seed": boundary_noise_seed,
}


def documented_overrides(ROOT) -> list[str]:
    """`key=value` overrides on the `vlm train` / `vlm chain` lines of README.md, docs/*.md and `vlm train --help`."""
    from vlm.train import cli

    texts = [(ROOT / "README.md").read_text()] + [
        p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))
    ]
    texts.append(open(cli.__file__).read())
    found = []
    for text in texts:
        for line in re.findall(
            r"(?:vlm (?:train|chain)|Overrides are dotted keys, e\.g\.)[^\n`\"]*", text
        ):
            found += re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+=[^\s`\"]+)", line)
    return sorted(set(found))


def test_every_documented_override_changes_what_the_code_acts_on(ROOT):
    examples = documented_overrides(ROOT)
    keys = {ov.split("=", 1)[0] for ov in examples}
    assert {"model.chunk.target_ratio", "optim.lr"} <= keys  # the README's own example is found
    assert keys <= ACTS_ON.keys(), (
        f"give these documented keys a probe of what they act on: {keys - ACTS_ON.keys()}"
    )
    base = load_train_config(DEFAULT)
    for ov in examples:
        key = ov.split("=", 1)[0]
        changed = load_train_config(DEFAULT, [ov])
        assert ACTS_ON[key](changed) != ACTS_ON[key](base), (
            f"{ov} is accepted but changes nothing the code uses"
        )


def test_target_ratio_moves_the_default_configs_per_modality_targets():
    """default.yaml gives each modality its own ratio loss following target_ratio, so the README's
    example acts on both modalities (it once did nothing: the per-modality targets were stated as
    numbers and won)."""
    cfg = load_train_config(DEFAULT, ["model.chunk.target_ratio=3"])
    assert sorted(chunk_targets(cfg).values()) == [3.0, 3.0]
    assert config_targets(cfg) == {"ratio/text": 3.0, "ratio/image": 3.0}
    own = load_train_config(
        DEFAULT, ["model.chunk.target_ratio=3", "model.chunk.modality_target_ratios.image=4"]
    )
    assert config_targets(own) == {"ratio/text": 3.0, "ratio/image": 4.0}


def test_a_shadowed_target_ratio_is_refused_naming_both():
    with pytest.raises(
        ConfigError,
        match=r"model\.chunk\.target_ratio=3 is shadowed by model\.chunk\.modality_target_ratios",
    ):
        load_train_config("configs/byte_level.yaml", ["model.chunk.target_ratio=3"])
    # a saved config.yaml states every key: a target_ratio equal to one of the modalities'
    # restates it
    saved = flatten(to_dict(load_train_config("configs/byte_level.yaml")))
    assert (
        saved["model.chunk.target_ratio"] == 2.0
        and saved["model.chunk.modality_target_ratios.image"] == 2.0
    )
    load_train_config("configs/byte_level.yaml", ["model.chunk.target_ratio=2"])


def test_a_run_written_with_numeric_targets_resumes_under_null_ones():
    from vlm.train.run_config import check_resume_config

    now = to_dict(load_train_config(DEFAULT))
    assert now["model"]["chunk"]["modality_target_ratios"] == {"text": None, "image": None}
    saved = to_dict(
        load_train_config(DEFAULT, ["model.chunk.modality_target_ratios={text: 2.0, image: 2.0}"])
    )
    check_resume_config(saved, now)
    moved = to_dict(load_train_config(DEFAULT, ["model.chunk.target_ratio=3"]))
    with pytest.raises(ConfigError, match="modality_target_ratios"):
        check_resume_config(saved, moved)


@pytest.mark.parametrize(
    "name, entries",
    [
        ("MAY_CHANGE_FROM_CHECKPOINT", MAY_CHANGE_FROM_CHECKPOINT),
        ("RESUMABLE_CHANGES", RESUMABLE_CHANGES),
        ("OPTIM_CHANGES", OPTIM_CHANGES),
    ],
)
def test_allow_list_entries_name_real_config_fields(name, entries):
    """The allow-lists are prefixes of dotted keys: each must still name a field (or a section, with
    a trailing dot), so a renamed field cannot leave a dead entry that lets nothing through."""
    from vlm.model.config import MoEConfig

    keys = set(flatten(to_dict(TrainConfig())))
    # model keys are written relative to the model section; concept_moe is null by default: its keys
    # are MoE's
    model_keys = {k[len("model.") :] for k in keys if k.startswith("model.")}
    model_keys |= {f"concept_moe.{k}" for k in flatten(to_dict(MoEConfig()))}
    pool = model_keys if name == "MAY_CHANGE_FROM_CHECKPOINT" else keys
    dead = [
        e for e in entries if not any(k == e or (e.endswith(".") and k.startswith(e)) for k in pool)
    ]
    assert dead == []
