"""What a run's config says beyond training itself: its compression targets for the dashboards, and
which of its keys a resumed run may change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from configs.config import ConfigError, flatten
from vlm.model.config import resolve_targets
from vlm.train.config import TrainConfig, migrate_run_config

# Config keys a resumed run may change (everything else must match the checkpointed run).
RESUMABLE_CHANGES = (
    "train.max_steps",
    # derived: the global batch's micro-batches per rank on the ranks the run resumes on
    "optim.grad_accum",
    # the rows of one micro-batch, while the global batch stays (optim.global_batch_rows is
    # compared): the planner packs row after row and a step takes the next global batch of them
    # however they are cut into micro-batches, so the same samples train in the same steps
    # (what lets a default single-process run, one micro-batch per step, continue on more ranks)
    "data.rows_per_batch",
    "checkpoint.",
    "logging.",
    "train.vqa_eval",
    "train.vqa_max_samples",
    "train.threads",
    "train.max_skip_share",
    # how the data is loaded, not what it is: the loader's order depends on neither
    "data.num_workers",
    "data.prefetch_factor",
    "data.prefetch_to_device",
    "data.rank_split",
    # the checkpoint's own files say which expert degree it resumes on
    # (vlm.train.expert_parallel.check_resume); the capacity only changes what is dropped
    "parallel.",
)


def evolve(cfg: TrainConfig, **sections) -> TrainConfig:
    """A new TrainConfig with `sections` replaced (validated again); `cfg` stays as it is. The model
    keys its file stated (load_train_config's `model_stated`, not a field) come along."""
    out = replace(cfg, **sections)
    out.model_stated = getattr(cfg, "model_stated", None)
    return out


def config_targets(cfg: TrainConfig) -> dict[str, float]:
    """Compression targets for dashboards: the joint R, or one per modality."""
    ch = cfg.model.chunk
    if not ch.enabled:
        return {}
    targets = ch.modality_targets()
    if targets:
        return {f"ratio/{m}": r for m, r in targets.items()}
    return {"ratio": ch.target_ratio}


# With --accept-optim-change (the documented fix after non-finite steps: a lower optim.lr) these may
# change too; grad_accum may not (it changes how the data stream is cut into steps).
OPTIM_CHANGES = (
    "optim.lr",
    "optim.min_lr",
    "optim.weight_decay",
    "optim.betas",
    "optim.eps",
    "optim.clip",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.decay_fraction",
)


def _resolved(flat: dict) -> dict:
    """A flattened config with each per-modality target stated as null read as the target_ratio it
    follows (what the run trained with), so that a run written before nulls were allowed resumes
    under a config using them."""
    prefix = "model.chunk.modality_target_ratios."
    per = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    targets = resolve_targets(flat.get("model.chunk.target_ratio"), per) or {}
    return {**flat, **{prefix + m: r for m, r in targets.items()}}


def saved_global_batch(saved: dict, written_by: int) -> int:
    """The global batch (rows per optimizer step) of a checkpointed run's config.yaml; one written
    before it was stated: its rows per micro-batch x accumulation x the ranks that wrote it."""
    optim, data = saved.get("optim") or {}, saved.get("data") or {}
    if optim.get("global_batch_rows") is not None:
        return int(optim["global_batch_rows"])
    return int(data.get("rows_per_batch", 1)) * int(optim.get("grad_accum", 1)) * written_by


def with_global_batch(cfg: TrainConfig, world_size: int, saved: int | None) -> TrainConfig:
    """The config with its global batch stated (`optim.global_batch_rows`: this config's; else a
    resumed run's, `saved`; else rows x accumulation on these ranks) and the micro-batches per rank
    it takes on `world_size` ranks (`optim.grad_accum`). ConfigError where the ranks cannot split
    it into whole micro-batches."""
    o, rows = cfg.optim, cfg.data.rows_per_batch
    G = o.global_batch_rows if o.global_batch_rows is not None else saved
    G = rows * o.grad_accum * world_size if G is None else G
    if G % (rows * world_size):
        fits = [r for r in range(rows - 1, 0, -1) if G % (r * world_size) == 0]
        if saved is not None:  # a resume: the global batch is the checkpointed run's
            fix = (
                f"resume with data.rows_per_batch={fits[0]} (the same samples train in the same "
                "steps), or run on a number of ranks that divides it"
                if fits
                else f"run on a number of ranks that divides {G}"
            )
            raise ConfigError(
                f"cannot resume on {world_size} rank(s): the run's global batch, "
                f"optim.global_batch_rows={G}, is not a whole number of micro-batches of "
                f"data.rows_per_batch={rows} rows on each: {fix}"
            )
        raise ConfigError(
            f"optim.global_batch_rows={G} is not a whole number of micro-batches on {world_size} "
            f"rank(s): it must be a multiple of data.rows_per_batch x ranks = {rows} x "
            f"{world_size} = {rows * world_size}; change optim.global_batch_rows or "
            "data.rows_per_batch, or run on a number of ranks that divides it"
        )
    return evolve(cfg, optim=replace(o, global_batch_rows=G, grad_accum=G // (rows * world_size)))


def check_resume_config(
    saved: dict, now: dict, accept_optim_change: bool = False, say=None
) -> None:
    """ConfigError (one line) on a key a resume may not change; `say(line)` is told of a
    micro-batch size that changed (allowed: the global batch stays)."""
    a, b = _resolved(flatten(saved)), _resolved(flatten(now))
    rows = "data.rows_per_batch"
    if say is not None and a.get(rows) is not None and a.get(rows) != b.get(rows):
        say(
            f"note: {rows} was {a[rows]} in the checkpointed run, now {b[rows]}: the global "
            f"batch stays {b.get('optim.global_batch_rows')} rows, so the same samples train in "
            "the same steps, cut into other micro-batches (their boundary noise and expert "
            "capacity are drawn per micro-batch)"
        )
    allowed = RESUMABLE_CHANGES + (OPTIM_CHANGES if accept_optim_change else ())
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not key.startswith(allowed):
            hint = " (or --accept-optim-change)" if key.startswith(OPTIM_CHANGES) else ""
            if key == "optim.global_batch_rows":
                hint = (
                    "; the global batch cannot change on resume (it decides which samples each "
                    "step trains): on more ranks, resume with a smaller data.rows_per_batch"
                )
            raise ConfigError(
                f"cannot resume: {key} was {_said(saved, key, a)} in the checkpointed run, now "
                f"{_said(now, key, b)}; use a new --out directory or the same config{hint}"
            )


def _said(tree: dict, key: str, flat: dict) -> str:
    """A value as the config states it: the leaf, or the whole mapping at `key` (flattening writes an
    empty mapping as a leaf, a full one as its keys); 'absent' with the mapping it was looked up in."""
    if key in flat:
        return repr(flat[key])
    node, parent = tree, tree
    for part in key.split("."):
        parent, node = node, node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
    if node is not _ABSENT:
        return repr(node)
    where = key.rsplit(".", 1)[0]
    return f"absent ({where} = {parent!r})" if isinstance(parent, dict) else "absent"


_ABSENT = object()


def check_resume_steps(checkpoint_step: int, max_steps: int, ckpt) -> None:
    """A resumed run may raise train.max_steps, or keep it at the checkpoint's step (the run
    finishes: export, evaluation, summary), but not set it below the step the checkpoint reached:
    nothing would train, and config.yaml would say fewer steps than the weights had."""
    if max_steps < checkpoint_step:
        raise ConfigError(
            f"cannot resume: the checkpoint {ckpt} is at step {checkpoint_step}, past "
            f"train.max_steps={max_steps}; give train.max_steps >= {checkpoint_step}, or a new "
            "--out to train a shorter run"
        )


def saved_run_config(run_dir: Path, warn) -> dict | None:
    """RUN_DIR/config.yaml as the checkpointed run wrote it, for `check_resume_config`; None (with a
    warning, the resume goes on) when it is missing or damaged (cut short, not a mapping): the
    checkpoint itself is what the run resumes from, config.yaml only what it is compared with."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        why = f"not readable YAML ({type(e).__name__})"
    else:
        if isinstance(data, dict):
            return migrate_run_config(data)  # an older run's keys in today's form
        why = f"a {type(data).__name__}, not a mapping"
    warn(
        f"warning: {path} is damaged ({why}): this run's config cannot be compared with the "
        "checkpointed run's; resuming with this one (it is written again now)"
    )
    return None
