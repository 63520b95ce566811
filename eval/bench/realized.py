"""Prefill tokens/s with the boundaries a trained router really draws on real prompts, against the
MoE baseline.

Legend: B rows, T tokens.

The `model` part forces exactly T/R boundaries per row: the speed a user gets if the router
realizes the design ratio R on their inputs. This part reads the boundaries instead from a
checkpoint (`--ckpt RUN_DIR/final`): its router, in eval mode (p >= 0.5), on that checkpoint's own
held-out VQA prompts (with their images, as `vlm chat`, the demo and every VQA eval prefill them)
and captions of the default dataset. Each kind's documents are packed whole into rows of T tokens
with their realized boundaries, and the `model` part's FLOPs-matched reallocations (matched at the
design R) prefill those rows against the MoE baseline, next to the same rows with boundaries forced
at exactly T/R. The realized ratio per kind is reported with each row; a realized ratio below R
means the concept model sees more concepts than it was sized for, and the reallocation runs slower
than the baseline.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from configs.batch import PackedBatch
from eval.bench import common
from eval.bench.model import BASE, BASELINE, boundaries_at_ratio
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.reallocate import reallocate

PART = "realized"


@dataclass
class Settings:
    # RUN_DIR/final; without one the part reports itself unavailable
    ckpt: str | None = None
    data: str = "data/default"  # the checkpoint's default dataset (its held-out test split)
    documents: int = 96  # prompts (and captions) read per kind
    seq_lens: list[int] = field(default_factory=lambda: [1024, 4096])
    ratio: float = 2.0  # the design ratio the reallocations are matched at
    repeats: int = 5
    warmup: int = 1


SETTINGS = {
    "full": Settings(documents=256, seq_lens=[1024, 4096, 16384]),
    "quick": Settings(),
    "smoke": Settings(documents=8, seq_lens=[128], repeats=2),
}


@torch.no_grad()
def realized_documents(ckpt: str, data: str, n: int) -> dict[str, list[torch.Tensor]]:
    """{kind: one [L] bool boundary mask per document}: the checkpoint's router in eval mode on its
    held-out VQA prompts (prefilled as generation does: one prompt per row) and whole held-out
    captions (teacher forced)."""
    from PIL import Image

    from data_pipelines.chat import iter_vqa_samples
    from data_pipelines.config import DataConfig, SourceConfig
    from data_pipelines.loader import build_loader
    from vlm.generate import load_eval_model

    chat = load_eval_model(ckpt)
    test = Path(data) / "test"
    samples = list(iter_vqa_samples(str(test / "vqa-*.tar"), limit=n))
    if not samples:
        raise FileNotFoundError(
            f"no VQA samples in {test}/vqa-*.tar (the checkpoint's default dataset?)"
        )
    out: dict[str, list[torch.Tensor]] = {"vqa prompt": [], "caption": []}
    for i in range(0, len(samples), 16):
        chunk = samples[i : i + 16]
        batch = chat.prompt_batch(
            [s.prompt for s in chunk],
            [[Image.open(io.BytesIO(b)) for b in (s.images or [s.image])] for s in chunk],
        )
        b_BT = chat.model(batch).chunks.b_BT
        out["vqa prompt"] += [b_BT[r][batch.doc_ids[r] >= 0].cpu() for r in range(b_BT.shape[0])]
    cfg = DataConfig(
        sources=[SourceConfig(path=str(test / "caption-*.tar"), name="caption")],
        row_tokens=1024,
        rows_per_batch=4,
        epochs=1,
        shuffle_buffer=0,
        processor=chat.processor.cfg,
    )
    for batch in build_loader(cfg, chat.tokenizer):
        b_BT = chat.model(batch.to(chat.device)).chunks.b_BT.cpu()
        for r in range(b_BT.shape[0]):
            for d in batch.doc_ids[r].unique().tolist():
                if d >= 0 and len(out["caption"]) < n:
                    out["caption"].append(b_BT[r][batch.doc_ids[r] == d])
        if len(out["caption"]) >= n:
            break
    return out


def pack(masks: list[torch.Tensor], T: int, vocab: int) -> tuple[PackedBatch, torch.Tensor]:
    """Whole documents, in order and cycling through them, into one row of T tokens (the rest is
    padding): the batch and its boundary mask. A document longer than the row is cut to it."""
    lengths = [min(len(m), T) for m in masks]
    picked, used = [], 0
    while used + lengths[len(picked) % len(masks)] <= T:
        picked.append(len(picked) % len(masks))
        used += lengths[picked[-1]]
    if not picked:  # the first document alone is longer than the row
        picked, used = [0], T
    pad = T - used
    doc_T = torch.cat(
        [torch.full((lengths[k],), d) for d, k in enumerate(picked)] + [torch.full((pad,), -1)]
    )
    pos_T = torch.cat(
        [torch.arange(lengths[k]) for k in picked] + [torch.zeros(pad, dtype=torch.long)]
    )
    force_T = torch.cat(
        [masks[k][: lengths[k]] for k in picked] + [torch.zeros(pad, dtype=torch.bool)]
    )
    ids = torch.randint(0, vocab, (1, T))
    batch = PackedBatch(
        ids, torch.full_like(ids, -100), doc_T[None].long(), pos_T[None], torch.zeros_like(ids)
    )
    return batch, force_T[None]


def run(s: Settings, log=print) -> dict:
    if s.ckpt is None:
        return common.result(
            PART,
            asdict(s),
            [],
            unavailable={
                "learned boundaries": "no checkpoint given: `vlm bench "
                "realized --ckpt RUN_DIR/final` (a run on the default "
                "dataset; its held-out prompts are read from --data)"
            },
        )
    torch.manual_seed(0)
    docs = realized_documents(s.ckpt, s.data, s.documents)
    base = BASE.baseline()
    configs = {BASELINE: base, **reallocate(base, s.ratio)}
    models = {n: ConceptMoELM(c).eval() for n, c in configs.items()}
    out = []
    realized = {}
    for kind, masks in docs.items():
        if not masks:
            continue
        tokens = sum(len(m) for m in masks)
        realized[kind] = tokens / sum(int(m.sum()) for m in masks)
        for T in s.seq_lens:
            batch, learned = pack(masks, T, base.vocab_size)
            valid = batch.doc_ids >= 0
            forced = boundaries_at_ratio(1, T, s.ratio) & valid
            forced |= valid & (batch.position_ids == 0)  # every document starts a concept
            r_learned = float(valid.sum() / learned.sum())
            r_forced = float(valid.sum() / forced.sum())
            fns, extra = {}, {}
            for n, m in models.items():
                if not configs[n].chunk.enabled:
                    fns[n] = _prefill(m, batch, None)
                    extra[n] = {"realized_R": 1.0}
                    continue
                fns[f"{n} (learned)"] = _prefill(m, batch, learned)
                extra[f"{n} (learned)"] = {"realized_R": round(r_learned, 3)}
                fns[f"{n} (forced R={s.ratio:g})"] = _prefill(m, batch, forced)
                extra[f"{n} (forced R={s.ratio:g})"] = {"realized_R": round(r_forced, 3)}
            secs = common.measure(fns, s.repeats, s.warmup)
            rs = common.rows(
                common.per_second(secs, float(valid.sum())),
                BASELINE,
                {"kind": kind, "seq_len": T},
                "prefill tokens/s",
                "tok/s",
                extra,
            )
            out += rs
            log(
                f"  realized {kind} T={T} (R {r_learned:.2f}): "
                + ", ".join(f"{r['candidate']} x{r['ratio_vs_baseline']:.2f}" for r in rs)
            )
    notes = [
        f"boundaries from {s.ckpt} (eval mode, p >= 0.5) on its held-out "
        f"{', '.join(docs)}; realized ratio over all documents: "
        + ", ".join(f"{k} {v:.2f}" for k, v in realized.items()),
        (
            "the reallocations are matched to the baseline's FLOPs at R = "
            f"{s.ratio:g}; '(forced R=...)' rows are the same documents with "
            "exactly T/R boundaries (every document's first token among them)"
        ),
    ]
    return common.result(PART, asdict(s), out, notes=notes, realized_ratio=realized)


def _prefill(model: ConceptMoELM, batch: PackedBatch, force):
    def call():
        with torch.no_grad():
            model(batch, force=force)

    return call


def plot(res: dict, path) -> None:
    if not res["rows"]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "realized: no checkpoint given (--ckpt)", ha="center", va="center")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return
    common.plot(
        res,
        path,
        x="seq_len",
        panels=("kind",),
        ylabel="prefill tokens/s vs MoE baseline",
        title="learned vs forced boundaries (FLOPs matched at the design R)",
    )
