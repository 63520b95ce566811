"""What an export's files other than its weights must agree with its config.json: the generation
settings, the image processor's settings and the tokenizer (vlm.model.hf checks the first two
before transformers loads an export, vlm.generate the tokenizer it reads); the weights' own checks
are vlm.model.weights_check's. `config`: the export's ConceptMoEConfig (vlm.model.hf).

A wrong file is a WeightsError naming it and what disagrees: transformers would otherwise replace a
file it cannot read by defaults, or read prompts with another model's ids, silently.
"""

from __future__ import annotations

from pathlib import Path

from vlm.model.weights_check import WeightsError, read_json_object


def _ids(value) -> list | None:
    """A generation setting's token ids as a list (None: unset); ValueError for anything else."""
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{value!r} is not a token id or a list of them")
    return ids


def check_generation_config(path: Path, config) -> None:
    """generation_config.json, when there, must be an object whose eos / pad / bos are token ids of
    the model: transformers replaces a file it cannot read by defaults silently (a garbage file
    made `generate` stop at id 2, a letter of this vocabulary)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return
    info = read_json_object(f, "generation config")
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        try:
            ids = _ids(info.get(key))
        except ValueError as e:
            raise WeightsError(f"{f}: {key} {e}") from None
        bad = [i for i in ids or [] if i >= config.vocab_size]
        if bad:
            raise WeightsError(
                f"{f}: {key} {bad[0]} is not an id of the model's {config.vocab_size}-token "
                "vocabulary"
            )


def check_processor_config(path: Path, config) -> None:
    """processor_config.json, when there, must give the image processor the settings the model's
    vision section trained with: another patch size or merge cuts images into patches the model
    cannot read (transformers' generate then fails deep inside the vision tower); other mean / std
    or patch limits feed it pixels it never saw."""
    f = Path(path) / "processor_config.json"
    if not f.is_file():
        return
    info = read_json_object(f, "processor config")
    proc = info.get("image_processor", {})
    if config.vision is None or proc in ({}, None):
        return
    if not isinstance(proc, dict):
        raise WeightsError(f"{f}: image_processor is {type(proc).__name__}, not an object")
    want = (config.vision or {}).get("processor") or {}
    for key in sorted(set(proc) & set(want)):
        a, b = proc[key], want[key]
        same = (
            all(abs(float(x) - float(y)) <= 1e-6 for x, y in zip(a, b)) and len(a) == len(b)
            if isinstance(a, list) and isinstance(b, list)
            else a == b
        )
        if not same:
            raise WeightsError(
                f"{f}: image_processor.{key} is {a!r}, the model's config.json says "
                f"vision.processor.{key}: {b!r} (what it was trained with); the two must agree"
            )


def check_export_tokenizer(path: Path, config, tok) -> None:
    """The tokenizer read from an export must be the model's: every id inside its vocabulary and
    the special ids the config records (eos, pad, bos, the image placeholder) the same. A
    tokenizer swapped for another model's makes the model read its prompts with ids it was not
    trained on: empty answers, a score of 0, and exit 0."""
    checks = [("vocab size", tok.vocab_size, config.vocab_size)]
    # a pretrained model's own tokenizer: its config states the eos that ends an answer, which
    # need not be the tokenizer's
    if getattr(tok, "kind", None) != "source":
        checks += [
            (name, getattr(tok, attr, None), getattr(config, key, None))
            for name, attr, key in (
                ("eos id", "eos_id", "eos_token_id"),
                ("pad id", "pad_id", "pad_token_id"),
                ("bos id", "bos_id", "bos_token_id"),
            )
        ]
    if config.image_pad_id >= 0:
        checks.append(
            ("image placeholder id", getattr(tok, "image_pad_id", None), config.image_pad_id)
        )
    for name, theirs, ours in checks:
        if ours is None or theirs is None:
            continue
        wrong = theirs > ours if name == "vocab size" else theirs != ours
        if wrong:
            raise WeightsError(
                f"{path}: the tokenizer's {name} is {theirs}, the model's config.json says "
                f"{ours}: the tokenizer files are not this model's (swapped for another's?)"
            )
