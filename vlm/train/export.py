"""RUN_DIR/final: the transformers export of the trained model, only when every weight is finite."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from vlm.model.hf import save_pretrained
from vlm.train.distributed import barrier
from vlm.train.param_groups import folded_logit_scale


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    return [n for n, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def export_final(engine, run_dir: Path, tokenizer, logit_scale: float, is_main: bool, log) -> Path | None:
    """Collective. Written to a temp dir and renamed into place; None (nothing written) when a weight is not
    finite: a final/ must always be usable."""
    final, tmp = run_dir / "final", run_dir / ".tmp-final"
    module = engine.module
    ctx = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed
        ctx = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    with ctx:
        bad = nonfinite_tensors(module)
        if bad:
            log(f"not exporting final/: non-finite values in {len(bad)} tensors ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}); the last finite checkpoint is in {run_dir / 'checkpoints'}")
            return None
        if is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            with folded_logit_scale(module, logit_scale):
                save_pretrained(module, tmp, tokenizer=tokenizer)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    barrier()
    return final
