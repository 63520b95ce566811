"""The run's data: the training stream and the held-out batches its evaluations read; the checks
that a run's data fits its rows and is not mostly skipped."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from configs.config import ConfigError
from data_pipelines.loader import build_loader
from data_pipelines.schema import REASONS
from vlm.train import collectives
from vlm.train.config import TrainConfig


def build_loaders(cfg: TrainConfig, tokenizer, rank: int, world_size: int):
    """(the training loader, the held-out batches): `logging.eval_batches` of
    `logging.eval_sources`, else of the default dataset's val split when that is the data, else none
    (the dashboards then read the training batch)."""
    lg, data = cfg.logging, cfg.data
    loader = build_loader(data, tokenizer, rank, world_size)
    val_cfg = None
    if lg.eval_every and lg.eval_sources:
        val_cfg = replace(data, sources=lg.eval_sources, num_workers=0, epochs=None)
    elif lg.eval_every and not data.sources:
        val_cfg = replace(data, split="val", num_workers=0, epochs=None)
    eval_batches = []
    if val_cfg is not None:
        eval_batches = list(
            itertools.islice(build_loader(val_cfg, tokenizer, rank, world_size), lg.eval_batches)
        )
    return loader, eval_batches


def image_frame_tokens(tokenizer) -> int:
    """Tokens a sample needs before its first image: <bos> (where the tokenizer has one) and, in a
    chat sample, the chat template's tokens ahead of a user turn's `<image>` (a system prompt, the
    role marker)."""
    from data_pipelines.schema import IMAGE_TOKEN

    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    try:
        segs = tokenizer.chat_segments(
            [{"role": "user", "content": IMAGE_TOKEN}, {"role": "assistant", "content": "a"}]
        )
        ids = head + [i for text, _ in segs for i in tokenizer.encode(text)]
        return max(len(head), ids.index(tokenizer.image_id))
    except Exception:  # noqa: BLE001 - a template that cannot render this: the plain frame (a caption sample)
        return len(head)


def check_row_fits(cfg: TrainConfig, tokenizer) -> None:
    """ConfigError unless a row of data.row_tokens can hold the largest image the processor makes
    (max_patches patches, merged merge x merge into one token) with what the loader puts around it:
    the tokens ahead of it in a chat turn, <image_start> and <image_end>, and one text token after
    it (data_pipelines.encode). A shorter row drops every sample with such an image (`too_long`) and
    trains a VLM on text alone."""
    if cfg.vision is None:
        return
    proc, rows = cfg.data.processor, cfg.data.row_tokens
    image = proc.max_patches // proc.merge**2
    before = image_frame_tokens(tokenizer)
    need = before + image + 2 + 1
    if rows < need:
        raise ConfigError(
            f"data.row_tokens={rows} cannot hold the largest image: "
            f"vision.processor.max_patches={proc.max_patches} with merge {proc.merge} "
            f"makes {image} image tokens, {need} with the {before} token(s) ahead of it in "
            "a chat turn, <image_start>, <image_end> and one text token after it; raise "
            f"data.row_tokens to at least {need} or lower vision.processor.max_patches"
        )


# Judged once this many samples were read (a share of a handful of samples says little: 1 of the
# first 9 is 11 %).
MIN_SAMPLES_JUDGED = 50


def skip_share_stop(
    skipped: dict[str, int], read: int, limit: float, source: str | None = None
) -> str | None:
    """The line that stops a run whose skipped share of the samples read so far (all ranks) is above
    `limit` (train.max_skip_share, the importers' --max-skip-share rule); None while it is not, or
    fewer than MIN_SAMPLES_JUDGED were read. `skipped`: counts by reason; `filtered_kind` (what a
    source's `kind` asks to leave out) is no loss and counts on neither side. `source`: the counts
    are that source's alone (named in the line); None: all the data's."""
    from data_pipelines.schema import FILTERED_KIND

    lost = {r: n for r, n in skipped.items() if n and r != FILTERED_KIND}
    total = sum(lost.values())
    seen = max(read - skipped.get(FILTERED_KIND, 0), total)
    if seen < MIN_SAMPLES_JUDGED or total <= limit * seen:
        return None
    of = "" if source is None else f" from source {source}"
    return (
        f"stopping: {total} of the {seen} samples read{of} were skipped "
        f"({100 * total / seen:.1f} %, more than train.max_skip_share={limit:g}): "
        f"{', '.join(f'{r}={n}' for r, n in sorted(lost.items()))}. Fix the data "
        "or the config (too_long: a longer data.row_tokens), then start again "
        "with --overwrite or a new --out; or raise train.max_skip_share"
    )


def skipped_samples(
    loader, sources: list[str], limit: float, device, counts: bool = True
) -> tuple[dict[str, int], str | None]:
    """The samples skipped so far, by reason (`skipped/REASON`, summed over ranks in one
    collective), and the line that stops the run when the skipped share passes `limit` over all the
    data or in one source (one kind of sample each in the default data): a source the run loses is
    not hidden by the others' volume. None while neither does. `counts`: whether this rank's
    counters count (ParallelLayout.counts_data: the ranks sharing a row read the same samples)."""
    by_source = loader.by_source()
    groups = [(None, (int(loader.stats.get("samples_read", 0)), loader.counters))]
    groups += [(label, by_source.get(label, (0, {}))) for label in sources]
    vec = torch.tensor(
        [
            float(v)
            for _, (read, skipped) in groups
            for v in [read] + [skipped.get(r, 0) for r in REASONS]
        ],
        dtype=torch.float64,
    )
    flat = collectives.data_counters(vec.to(device) * counts).cpu().tolist()
    n = len(REASONS) + 1
    counts = [
        (label, int(flat[i * n]), dict(zip(REASONS, map(int, flat[i * n + 1 : (i + 1) * n]))))
        for i, (label, _) in enumerate(groups)
    ]
    stop = next(
        (
            line
            for label, read, skipped in counts
            if (line := skip_share_stop(skipped, read, limit, label))
        ),
        None,
    )
    return {f"skipped/{r}": k for r, k in counts[0][2].items()}, stop
