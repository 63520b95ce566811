"""RUN_DIR/final: the transformers export of the trained model, only when every weight is finite.

It is written into RUN_DIR/.tmp-final and renamed into place only when every file is complete, so a
final/ that exists is always whole. A write that fails (a full disk) removes the partial folder and
raises WriteError: one line naming the file and the reason; an earlier final/ and the checkpoints
stay as they were.

Its files get the permissions the umask gives (configs.file_modes: safetensors writes 0600), and it
replaces a `final/` only when that is this run's (vlm.train.run_dir.export_refusal): one that another
writer made during the run is left as it is, and the export refused in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

import torch

from configs.file_modes import follow_umask
from vlm.model.hf import save_pretrained
from vlm.train import collectives
from vlm.train.expert_parallel import gathered_experts
from vlm.train.param_groups import folded_logit_scale
from vlm.train.run_dir import export_refusal, exported
from vlm.train.write_errors import DISK_ERRNOS, WriteError, describe_write_error


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    return [
        n
        for n, t in [*module.named_parameters(), *module.named_buffers()]
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


def _as_os_error(e: Exception, path: Path) -> OSError | None:
    """The OSError behind a failed export write: raised as such, or inside safetensors' "(os error 28)" text."""
    if isinstance(e, OSError):
        return e
    m = re.search(r"os error (\d+)", str(e))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return None


def export_final(
    engine, run_dir: Path, tokenizer, logit_scale: float, is_main: bool, log
) -> Path | None:
    """Collective. Written to a temp dir and renamed into place; None (nothing written) when a
    weight is not finite: a final/ must always be usable."""
    final, tmp = run_dir / "final", run_dir / ".tmp-final"
    why = collectives.decision_of_rank0(export_refusal(run_dir) if is_main else None)
    if why is not None:
        raise WriteError(
            f"not exporting {final}: {why}; the trained weights are in the last checkpoint in "
            f"{run_dir / 'checkpoints'}: move {final} away and run the same command to export them"
        )
    module = engine.module
    ctx = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    # experts split over ranks: every rank's shard, for the export of the whole model
    with ctx, gathered_experts(module):
        bad = nonfinite_tensors(module)
        if bad:
            log(
                f"not exporting final/: non-finite values in {len(bad)} tensors "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); the "
                f"last finite checkpoint is in {run_dir / 'checkpoints'}"
            )
            return None
        if is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            try:
                with folded_logit_scale(module, logit_scale):
                    save_pretrained(module, tmp, tokenizer=tokenizer)
                follow_umask(tmp)
            except Exception as e:  # safetensors raises its own error type for a failed write
                shutil.rmtree(tmp, ignore_errors=True)
                err = _as_os_error(e, tmp / "model.safetensors")
                if err is None or err.errno not in DISK_ERRNOS + (errno.ENOSPC,):
                    raise
                raise WriteError(
                    f"cannot export {final}: {describe_write_error(err, tmp)}; "
                    f"removed the partial {tmp.name}; the trained weights are "
                    f"in the last checkpoint in {run_dir / 'checkpoints'}"
                ) from None
            if final.exists():  # the old final/ goes only once the new one is complete
                old = run_dir / ".del-final"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            exported(run_dir)
    collectives.barrier()
    return final


def write_extras(final: Path, files: dict[str, "Path | str | None"]) -> None:
    """Files added to a complete final/ (the model card, the report picture): a path is copied, a
    string written. A failed write removes its partial file and raises WriteError; the model in
    final/ stays whole."""
    for name, content in files.items():
        if content is None:
            continue
        dest = final / name
        try:
            if isinstance(content, Path):
                shutil.copyfile(content, dest)
            else:
                dest.write_text(content)
        except OSError as e:
            dest.unlink(missing_ok=True)
            raise WriteError(
                f"cannot write {describe_write_error(e, dest)}; removed "
                f"the partial {name} (the model in {final} is complete)"
            ) from None
