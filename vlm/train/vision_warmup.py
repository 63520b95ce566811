"""Vision warm-up before step 0: the encoder learns to name what its images show
from their captions.

Legend: D width, V vocabulary, N flat tokens or patches, I images, P patches.

CatLIP-style (Mehta et al., 2024): every caption becomes the set of its words, and the encoder is
trained to predict that set (multi-label binary cross-entropy) from its image. The image-level score
of a word is the MAX over the image's tokens of a linear read-out, not the mean: a word names one
object, which covers a few tokens, and a mean over all of them dilutes it below the background. On
the default data, 1500 steps with mean pooling left shape words at 73 % per-label accuracy (chance
51 %), max pooling reached 99.8 %.

Why a warm-up at all: inside the VLM the only signal the encoder gets is the LM loss on a few answer
tokens, which taught colour and counts but not shape in every run we made (see the README's "Images:
seeing and compression"). The read-out head is thrown away; the encoder keeps what it learnt.

Preemption: the warm-up can take minutes, so it checkpoints too (RUN_DIR/checkpoints/vision_warmup/:
encoder, read-out, optimiser, schedule and RNG states) every tenth of its steps, when it ends, and
when a SIGTERM / SIGINT asks the run to stop. The next start of the same run (with or without
--resume) continues it from there and draws the same images, so an interrupted warm-up ends where an
uninterrupted one would.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from configs.config import ConfigError, to_dict
from data_pipelines.loader import resolve_sources
from data_pipelines.samples import iter_samples
from data_pipelines.schema import IMAGE_TOKEN, Sample
from vision.image_processor import ImageError, ImageProcessor, ProcessedImage
from vlm.train.checkpoint import load_state_dir, rng_state, save_state_dir, set_rng_state
from vlm.train.schedule import build_scheduler

WORD = re.compile(r"[^\W\d_]{2,}")  # letters only, two or more; lower-cased
STATE_NAME = "vision_warmup"  # RUN_DIR/checkpoints/vision_warmup/


def caption_words(text: str) -> set[str]:
    """The words of a caption, as a set (placeholders removed)."""
    return set(WORD.findall(text.replace(IMAGE_TOKEN, " ").lower()))


def is_caption(sample: Sample) -> bool:
    """One image and plain text about it (chat samples are questions, not descriptions)."""
    if sample.turns is not None or len(sample.images) != 1:
        return False
    return WORD.search(sample.text.replace(IMAGE_TOKEN, " ")) is not None


@dataclass
class Captions:
    images: list[bytes]
    words: list[set[str]]
    names: list[str]  # where each came from, for messages


def collect_captions(patterns: list[str], limit: int) -> Captions:
    """Up to `limit` caption samples of these shards, in shard order (bad samples are skipped)."""
    out = Captions([], [], [])
    for sample in iter_samples(patterns):
        if len(out.images) >= limit:
            break
        if is_caption(sample):
            out.images.append(sample.images[0])
            out.words.append(caption_words(sample.text))
            out.names.append(f"{sample.source}:{sample.key}")
    return out


def word_vocabulary(words: list[set[str]], min_count: int) -> list[str]:
    """Words in at least `min_count` captions (CatLIP's vocabulary filter), sorted."""
    counts = Counter(w for ws in words for w in ws)
    return sorted(w for w, c in counts.items() if c >= min_count)


def max_pool_per_image(x_ND: torch.Tensor, tokens_per_image: list[int]) -> torch.Tensor:
    """[N, D] packed tokens of several images -> [I, D] element-wise max over each image's tokens."""
    image_id_N = torch.repeat_interleave(
        torch.arange(len(tokens_per_image), device=x_ND.device),
        torch.tensor(tokens_per_image, device=x_ND.device),
    )
    out_ID = x_ND.new_full((len(tokens_per_image), x_ND.shape[1]), float("-inf"))
    return out_ID.scatter_reduce(0, image_id_N[:, None].expand_as(x_ND), x_ND, reduce="amax")


class WordReadout(nn.Module):
    """Per-token word scores, max-pooled per image (multiple-instance learning)."""

    def __init__(self, in_dim: int, vocab: int):
        super().__init__()
        self.fc = nn.Linear(in_dim, vocab)

    def forward(self, feats_ND: torch.Tensor, tokens_per_image: list[int]) -> torch.Tensor:
        return max_pool_per_image(self.fc(feats_ND), tokens_per_image)


def _process(processor: ImageProcessor, data: bytes, name: str) -> ProcessedImage | None:
    try:
        return processor(data, source=name)
    except ImageError:
        return None  # the loader skips and counts the same image; here it is simply not used


def _batch(images: list[ProcessedImage | None], words: list[set[str]], index: dict[str, int]):
    """Packed patches, coords, grids, tokens per image and the [I, V] word targets of the usable images."""
    kept = [i for i, p in enumerate(images) if p is not None]
    y_IV = torch.zeros(len(kept), len(index))
    for row, i in enumerate(kept):
        for w in words[i]:
            if w in index:
                y_IV[row, index[w]] = 1.0
    ps = [images[i] for i in kept]
    return (
        torch.cat([p.patches_PD for p in ps]),
        torch.cat([p.coords_P2 for p in ps]),
        torch.tensor([p.grid for p in ps]),
        [p.num_tokens for p in ps],
        y_IV,
    )


def run_vision_warmup(
    encoder: nn.Module,
    processor: ImageProcessor,
    cfg,
    data_cfg,
    *,
    seed: int,
    device: torch.device,
    run_dir: Path | None,
    log: Callable[[str], None],
    state_dir: Path | None = None,
    fingerprint: str = "",
    stop=None,
) -> dict:
    """Train `encoder` in place for cfg.steps steps on caption words; returns (and writes)
    what it learnt.

    cfg: VisionWarmupConfig; data_cfg: the run's DataConfig (its sources are read for captions;
    the default dataset's val split, when that is the data, gives the held-out captions).
    state_dir: where its checkpoint lives (None: no checkpoints); one written under another
    `fingerprint` (the settings that decide the warm-up) is not resumed. stop: a StopFlag; when it
    is raised the warm-up saves and returns {"stopped": True, "step": ..., "checkpoint": ...}
    after the step in flight."""
    t0 = time.time()
    train_patterns = [p for s in resolve_sources(data_cfg) for p in map(str, s.paths)]
    caps = collect_captions(train_patterns, cfg.max_captions)
    if len(caps.images) < cfg.images_per_step:
        raise ConfigError(
            f"vision_warmup needs at least vision_warmup.images_per_step={cfg.images_per_step} "
            "caption samples (one image, plain text) in the training data, found "
            f"{len(caps.images)}; set vision_warmup.steps: 0 or add captions"
        )
    held = Captions([], [], [])
    if not data_cfg.sources:  # the default dataset: its val split is the held-out set
        val_patterns = [
            p for s in resolve_sources(replace(data_cfg, split="val")) for p in map(str, s.paths)
        ]
        held = collect_captions(val_patterns, cfg.held_out)
    if not held.images:  # otherwise the last captions collected are held out
        k = min(cfg.held_out, len(caps.images) // 10)
        if k:
            held = Captions(caps.images[-k:], caps.words[-k:], caps.names[-k:])
            caps = Captions(caps.images[:-k], caps.words[:-k], caps.names[:-k])
    vocab = word_vocabulary(caps.words, cfg.min_word_count)
    if not vocab:
        raise ConfigError(
            f"vision_warmup: no word occurs in vision_warmup.min_word_count={cfg.min_word_count} "
            f"of the {len(caps.images)} captions found; lower it"
        )
    index = {w: j for j, w in enumerate(vocab)}
    readout = WordReadout(encoder.out_dim, len(vocab)).to(device)
    params = [p for p in encoder.parameters() if p.requires_grad] + list(readout.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, cfg.steps // 20)
    sched = build_scheduler(
        opt,
        schedule="cosine",
        warmup=warm,
        total=cfg.steps,
        lr=cfg.lr,
        min_lr=0.0,
        decay_fraction=0.0,
    )
    rng = random.Random(f"vision-warmup:{seed}")
    processed: dict[int, ProcessedImage | None] = {}
    was_training = encoder.training
    encoder.train()
    losses: list[float] = []
    every = max(1, cfg.steps // 10)
    start = 0
    saved = (
        load_state_dir(state_dir, STATE_NAME, warn=lambda m: log(f"warning: {m}"))
        if state_dir
        else None
    )
    if saved is not None and (
        saved.get("fingerprint") != fingerprint or saved.get("vocabulary") != vocab
    ):
        log(
            f"warning: {state_dir / STATE_NAME} was written by "
            "a warm-up with other settings; starting it over"
        )
        saved = None
    if saved is not None:
        encoder.load_state_dict(saved["encoder"])
        readout.load_state_dict(saved["readout"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        rng.setstate(saved["sampler"])
        set_rng_state(saved["rng"])
        start, losses = saved["step"], list(saved["losses"])
        log(f"vision warm-up: continuing from {state_dir / STATE_NAME} at step {start}/{cfg.steps}")

    def save(done: int) -> Path | None:
        if state_dir is None:
            return None
        return save_state_dir(
            state_dir,
            STATE_NAME,
            {
                "fingerprint": fingerprint,
                "vocabulary": vocab,
                "step": done,
                "losses": losses,
                "encoder": encoder.state_dict(),
                "readout": readout.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "sampler": rng.getstate(),
                "rng": rng_state(),
            },
        )

    for step in range(start, cfg.steps):
        pick = rng.sample(range(len(caps.images)), cfg.images_per_step)
        for i in pick:  # each image is decoded and patchified once, on first use
            if i not in processed:
                processed[i] = _process(processor, caps.images[i], caps.names[i])
        patches, coords, grids, tokens, y_IV = _batch(
            [processed[i] for i in pick], [caps.words[i] for i in pick], index
        )
        logits_IV = readout(
            encoder(patches.to(device), coords.to(device), grids.to(device)), tokens
        )
        loss = F.binary_cross_entropy_with_logits(logits_IV, y_IV.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        periodic = (step + 1) % every == 0 or step + 1 == cfg.steps
        if periodic:
            log(
                f"vision warm-up {step + 1}/{cfg.steps}: word loss "
                f"{sum(losses[-every:]) / len(losses[-every:]):.4f} ({time.time() - t0:.0f} s)"
            )
        if stop is not None and stop.requested:
            encoder.train(was_training)
            return {
                "stopped": True,
                "step": step + 1,
                "steps": cfg.steps,
                "checkpoint": save(step + 1),
            }
        # and at the end: a kill before the run's first checkpoint does not lose the warm-up
        if periodic:
            save(step + 1)
    encoder.train(was_training)
    result = {
        "steps": cfg.steps,
        "captions": len(caps.images),
        "vocabulary": vocab,
        "loss_first": losses[0],
        "loss_last": sum(losses[-every:]) / len(losses[-every:]),
    }
    if held.images:
        with torch.no_grad():
            accs, labels = [], []
            for i in range(0, len(held.images), 64):
                imgs = [
                    _process(processor, d, n)
                    for d, n in zip(held.images[i : i + 64], held.names[i : i + 64])
                ]
                patches, coords, grids, tokens, y_IV = _batch(imgs, held.words[i : i + 64], index)
                logits_IV = readout(
                    encoder(patches.to(device), coords.to(device), grids.to(device)), tokens
                )
                accs.append(((logits_IV.cpu() > 0).float() == y_IV).float())
                labels.append(y_IV)
            right_IV = torch.cat(accs)
            rate_V = torch.cat(labels).mean(0)
        result["held_out_captions"] = right_IV.shape[0]
        result["held_out_word_accuracy"] = {
            w: round(float(right_IV[:, j].mean()), 4) for j, w in enumerate(vocab)
        }
        # what always guessing a word's more common state scores: the accuracy to beat
        result["held_out_word_base_rate"] = {
            w: round(float(max(r, 1 - r)), 4) for w, r in zip(vocab, rate_V.tolist())
        }
        result["held_out_all_words_right"] = round(float(right_IV.all(1).float().mean()), 4)
        log(
            f"vision warm-up: {result['held_out_all_words_right']:.1%} of "
            f"{right_IV.shape[0]} held-out captions have every word right; per "
            f"word {min(result['held_out_word_accuracy'].values()):.1%} at worst"
        )
    result["seconds"] = round(time.time() - t0, 1)
    if run_dir is not None:
        (run_dir / "vision_warmup.json").write_text(json.dumps(result, indent=1))
    return result


def warmup_fingerprint(cfg) -> str:
    """The settings that decide what the vision warm-up computes (cfg: the run's TrainConfig,
    resolved): its checkpoint resumes only under them."""
    return json.dumps(
        {
            "vision": to_dict(cfg.vision),
            "warmup": to_dict(cfg.vision_warmup),
            "data": to_dict(cfg.data),
            "seed": cfg.train.seed,
        },
        sort_keys=True,
        default=str,
    )


def warm_up_vision(
    model: nn.Module,
    fresh: set[str],
    cfg,
    *,
    resuming: bool,
    device: torch.device,
    run_dir: Path,
    is_main: bool,
    log: Callable[[str], None],
    stop,
) -> None:
    """The run's vision step before the engine exists. A fresh tower in stage vl is warmed up on
    rank 0's captions (not when resuming: the checkpoint has the weights), and every rank starts
    from rank 0's result; with vision_warmup.freeze_after it is then frozen. A pretrained tower
    (vision.timm_checkpoint) is neither, and what its checkpoint gave is logged and written to
    RUN_DIR/vision_load_report.txt. cfg: the run's TrainConfig (resolved); stop: its StopFlag (a
    stop during the warm-up raises Preempted after the warm-up saved its state)."""
    from vlm.train import collectives
    from vlm.train.param_groups import freeze_prefixes
    from vlm.train.signals import Preempted
    from vlm.train.stages import pretrained_tower, vision_load_report

    warm_cfg, vl = cfg.vision_warmup, cfg.train.stage == "vl"
    if "vision" in fresh and warm_cfg.steps and vl and not resuming:
        ckpt_root = run_dir / "checkpoints"
        warm = run_vision_warmup(
            model.vision.encoder.to(device),
            cfg.vision.build_processor(),
            warm_cfg,
            cfg.data,
            seed=cfg.train.seed,
            device=device,
            run_dir=run_dir if is_main else None,
            log=log,
            state_dir=ckpt_root if is_main else None,
            fingerprint=warmup_fingerprint(cfg),
            stop=stop,
        )
        if warm.get("stopped"):
            name = signal.Signals(stop.signum or signal.SIGTERM).name
            raise Preempted(
                stop.code or 143,
                f"stopped by {name} in the vision warm-up at step "
                f"{warm['step']}/{warm['steps']}: its state is in {warm['checkpoint']}; "
                "the same command (--resume included) continues it",
            )
        collectives.weights_of_rank0(model.vision.encoder)
    if (
        warm_cfg.steps
        and warm_cfg.freeze_after
        and vl
        and cfg.vision is not None
        and not pretrained_tower(cfg)
    ):
        freeze_prefixes(model, ["vision.encoder"])
    report = vision_load_report(model)
    if report is not None:
        log(f"vision checkpoint {cfg.vision.timm_checkpoint}: {report}")
        if is_main:
            (run_dir / "vision_load_report.txt").write_text(report + "\n")
