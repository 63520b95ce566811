"""The outer loop of `vlm train`: steps, logging, eval pictures, checkpoints, faults, export, summary."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from data_pipelines.schema import REASONS
from vlm.train.dashboard import Dashboard
from vlm.train.distributed import all_reduce_sum, barrier
from vlm.train.global_parser import install
from vlm.train.metrics import MetricsFile, StepAccumulator, load_imbalance, read_metrics, step_record
from vlm.train.param_groups import folded_logit_scale
from vlm.train.render import image_concept_picture, text_with_boundaries
from vlm.train.report import summary_lines, write_report
from vlm.train.step import prepare
from vlm.train.trainer import Trainer, config_targets

EVAL_KEYS = ("lm_loss", "loss/text_only", "loss/image_text", "compression/ratio", "compression/text",
             "compression/image", "boundary_p/all", "boundary_p/text", "boundary_p/image")


def current_lr(tr: Trainer) -> float:
    """The peak-rate-relative LR of this step (the base `optim.lr` times the schedule's multiplier)."""
    return tr.cfg.optim.lr * tr.scheduler.lr_lambdas[0](tr.scheduler.last_epoch)


def skipped_sample_counters(tr: Trainer) -> dict[str, int]:
    """Data-loader skip counters summed over ranks (a collective: every rank calls it)."""
    counters = tr.loader.counters if tr.loader is not None else {}
    vec = torch.tensor([float(counters.get(r, 0)) for r in REASONS], dtype=torch.float64)
    vec = all_reduce_sum(vec.to(tr.dist.device)).cpu()
    return {f"skipped/{r}": int(v) for r, v in zip(REASONS, vec.tolist())}


@torch.no_grad()
def evaluate(tr: Trainer, fallback_batch):
    """Held-out loss and compression (eval mode: p >= 0.5 boundaries), and the first batch's chunking.

    Without held-out data only the chunking of `fallback_batch` (the current training batch) is returned."""
    engine = tr.engine
    if not tr.eval_batches:
        engine.eval()
        install(engine.module, None)
        try:
            b = prepare(fallback_batch, tr.dist.device, tr.float_dtype)
            return {}, (b, engine(b).extras.get("boundary"))
        finally:
            engine.train()
            install(engine.module, tr.parser)
    engine.eval()
    install(engine.module, None)   # eval statistics stay local: no collective inside the forward
    acc = StepAccumulator(tr.dist.device)
    first = None
    try:
        for b in tr.eval_batches:
            b = prepare(b, tr.dist.device, tr.float_dtype)
            out = engine(b)
            acc.add(out, b)
            if first is None:
                first = (b, out.extras.get("boundary"))
    finally:
        engine.train()
        install(engine.module, tr.parser)
    vec, _ = acc.reduce(all_reduce_sum)
    rec = step_record(0, vec, acc.ratio_loss, 0.0, 0.0, 1.0)
    return {f"val/{k}": rec[k] for k in EVAL_KEYS}, first


def pictures(tr: Trainer, batch, boundary) -> tuple:
    if batch is None or boundary is None:
        return None, None
    proc = tr.cfg.data.processor
    from vision.image_processor import ImageProcessor

    img = image_concept_picture(batch, boundary, proc.patch_size, proc.merge, ImageProcessor(proc).denormalize)
    txt = text_with_boundaries(batch, boundary, lambda ids: tr.tokenizer.decode(ids, skip_special=False))
    return img, txt


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    return [n for n, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def export_final(tr: Trainer) -> Path | None:
    """RUN_DIR/final via the transformers export, written to a temp dir and renamed into place; None (nothing
    written) when a weight is not finite: a final/ must always be usable."""
    from vlm.model.hf import save_pretrained

    final, tmp = tr.run_dir / "final", tr.run_dir / ".tmp-final"
    module = tr.engine.module
    ctx = contextlib.nullcontext()
    if tr.engine.zero_optimization_stage() == 3:
        import deepspeed
        ctx = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    with ctx:
        bad = nonfinite_tensors(module)
        if bad:
            tr.log(f"not exporting final/: non-finite values in {len(bad)} tensors ({', '.join(bad[:3])}"
                   f"{', ...' if len(bad) > 3 else ''}); the last finite checkpoint is in {tr.ckpt_root}")
            return None
        if tr.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            with folded_logit_scale(module, tr.logit_scale):
                save_pretrained(module, tmp, tokenizer=tr.tokenizer)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    barrier()
    return final


def run_vqa(tr: Trainer, final: Path) -> dict | None:
    """The built-in VQA check on the default dataset's held-out split (rank 0), when eval.vqa is installed."""
    cfg = tr.cfg
    if not cfg.train.vqa_eval or not tr.is_main:
        return None
    if cfg.data.sources:
        tr.log("VQA eval skipped: it runs on the embedded default dataset and this run uses its own sources")
        return None
    if tr.engine.module.vision is None:
        return None   # a text-only model
    try:
        from eval.vqa import format_report, run_vqa_eval
        from vlm.generate import load_eval_model
    except ImportError as e:
        tr.log(f"VQA eval skipped: eval.vqa is not available ({e})")
        return None
    # ---- VQA call site: exact-match accuracy on the held-out split vs the majority-answer baseline.
    data = Path(cfg.data.default_dir)
    res = run_vqa_eval(load_eval_model(final), str(data / "test" / "vqa-*.tar"),
                       train_shards=str(data / "train" / "vqa-*.tar"), limit=cfg.train.vqa_max_samples,
                       progress=cfg.logging.progress,
                       compression_shards=[str(data / "test" / "vqa-*.tar"), str(data / "test" / "caption-*.tar")])
    res["split"] = "test"
    (tr.run_dir / "vqa.json").write_text(json.dumps(res, indent=2))
    tr.log(format_report(res))
    return res


def _progress(tr: Trainer):
    if not (tr.is_main and tr.cfg.logging.progress):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=tr.cfg.train.max_steps, initial=tr.step, desc="train", unit="step", dynamic_ncols=True)


def _postfix(rec: dict) -> dict:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    return {"loss": f(rec.get("loss"), 3), "R_text": f(rec.get("compression/text")),
            "R_img": f(rec.get("compression/image")), "tok/s": f(rec.get("tokens_per_s"), 0)}


def log_step(tr: Trainer, res, lr: float, dt: float, window, metrics, dash) -> dict:
    """The step's metrics line (+ eval at eval steps) to metrics.jsonl and TensorBoard. Collective calls
    (counters, eval) happen on every rank; writing on rank 0."""
    cfg, lg, step = tr.cfg, tr.cfg.logging, tr.step
    if res.applied:
        rec = step_record(step, res.vec, res.ratio_loss, cfg.model.chunk.ratio_loss_weight, lr, dt)
        rec.update(load_imbalance(res.loads))
        rec.update(tr.probe.read())
        grad_norm = tr.engine.get_global_grad_norm()
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
    else:
        rec = {"step": step, "skipped": True, "lr": lr, "step_time_s": dt}
    rec["nonfinite_steps"] = tr.nonfinite_total
    last = step == cfg.train.max_steps
    eval_due = bool(lg.eval_every) and (step % lg.eval_every == 0 or last)
    log_due = step % lg.log_every == 0 or last or eval_due or not res.applied
    if log_due:
        rec.update(skipped_sample_counters(tr))
    img = txt = None
    if eval_due:
        val, first = evaluate(tr, window[-1])
        rec.update(val)
        if tr.is_main and first is not None:
            img, txt = pictures(tr, *first)
    if tr.is_main and log_due:
        metrics.write(rec)
        if dash is not None:
            dash.scalars(rec)
            if eval_due:
                dash.pictures(step, img, txt)
            if lg.histogram_every and step % lg.histogram_every == 0 and res.applied:
                dash.histograms(step, res.extras, res.loads)
    return rec


def run(tr: Trainer) -> int:
    """Train to train.max_steps (or the end of the data); returns the process exit code."""
    cfg, main = tr.cfg, tr.is_main
    tr.build_data()
    if tr.resume_from is not None:
        tr.restore(tr.resume_from)
        tr.log(f"resumed from {tr.resume_from} at step {tr.step}")
    tr.write_run_files()
    resume_step = tr.step if tr.resume_from is not None else None
    metrics = MetricsFile(tr.run_dir / "metrics.jsonl", resume_step) if main else None
    targets = config_targets(cfg)
    dash = Dashboard(tr.run_dir / "tb", resume_step, targets) if main and cfg.logging.tensorboard else None
    tr.log(f"model: {tr.n_params:,} parameters ({tr.n_trainable:,} trainable); {tr.dist.world_size} rank(s) on "
           f"{tr.dist.device}; ZeRO {cfg.deepspeed.zero_stage}{', bf16' if cfg.deepspeed.bf16 else ''}")
    for line in tr.groups_desc:
        tr.log(f"  group {line}")
    bar = _progress(tr)
    it = iter(tr.loader)
    tr.t_start = time.time()
    rc, last_saved, last_rec = 0, tr.step if tr.resume_from is not None else -1, None
    K = cfg.optim.grad_accum
    while tr.step < cfg.train.max_steps:
        t0 = time.perf_counter()   # throughput counts data loading too
        try:
            window = [next(it) for _ in range(K)]
        except StopIteration:
            tr.log(f"data exhausted after {tr.step} steps (data.epochs={cfg.data.epochs})")
            break
        lr = current_lr(tr)
        tr.probe.values.clear()
        res = tr.train_step(window)
        tr.after_step(res)
        dt = time.perf_counter() - t0
        rec = log_step(tr, res, lr, dt, window, metrics, dash)
        step = tr.step
        last_rec = rec if res.applied else last_rec
        if bar is not None:
            bar.update(1)
            if last_rec is not None:
                bar.set_postfix(_postfix(last_rec), refresh=False)
        if tr.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
            path = tr.save()
            last_saved = step
            tr.log(f"stopping: {tr.nonfinite_in_row} non-finite steps in a row (step {step}); nothing was applied "
                   f"for them. Checkpoint: {path}. Lower optim.lr (resume with --resume --accept-optim-change "
                   f"optim.lr=...), check the data, or raise train.max_nonfinite_in_row.")
            rc = 1
            break
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
            tr.save()
            last_saved = step
    if bar is not None:
        bar.close()
    if rc == 0 and last_saved != tr.step:
        tr.save()
    if dash is not None:
        dash.close()
    if metrics is not None:
        metrics.close()
    return finish(tr, rc)


def finish(tr: Trainer, rc: int) -> int:
    """Export final/, report.png, VQA, summary (rank 0 prints)."""
    wall = tr.wall_before + (time.time() - tr.t_start)
    counters = tr.loader.counters if tr.loader is not None else {}
    vqa = None
    if rc == 0:
        final = export_final(tr)
        if final is None:
            rc = 1
        else:
            vqa = run_vqa(tr, final)
        barrier()
    if not tr.is_main:
        return rc
    records = read_metrics(tr.run_dir / "metrics.jsonl")
    targets = config_targets(tr.cfg)
    write_report(records, tr.run_dir / "report.png", targets, title=f"{tr.run_dir.name}: stage {tr.cfg.train.stage}")
    lines = summary_lines(records, targets, vqa, tr.run_dir, wall, tr.nonfinite_total, counters)
    (tr.run_dir / "summary.json").write_text(json.dumps(
        {"steps": tr.step, "wall_s": wall, "vqa": vqa, "nonfinite_steps": tr.nonfinite_total,
         "last": records[-1] if records else None, "exit_code": rc}, indent=2, default=str))
    tr.log("\n".join(["", "=" * 72, "summary", "=" * 72] + lines))
    return rc
