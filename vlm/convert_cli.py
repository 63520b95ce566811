"""`vlm convert SRC --out DIR`: turn a pretrained MoE into a ConceptMoE for continual training.

The model code is imported when the command runs, not when `vlm` registers it (as
for `vlm train`).

DIR is checked before the source is read: it may not be SRC, inside it or around it (the export
would overwrite the model it reads), and a DIR that holds anything (another model) is replaced only
with `--overwrite`, whole: the converted model is written into `DIR/.convert-partial/` and moved in
once complete, after the folder's old files were removed, so no file of the old model (its README,
its processor config) is left beside the new one and a failed write leaves the old model as it was.
One `vlm convert` writes into DIR at a time (DIR's lock, configs.folder_lock), and none into a
folder inside one another process writes (`--out RUN/final` while RUN trains is refused). Its files
get the permissions the umask gives (configs.file_modes: safetensors writes its file 0600)."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from configs.config import ConfigError
from configs.file_modes import follow_umask
from configs.folder_lock import folder_problem, is_lock_file, lock_folder
from vlm.model.config import ConvertConfig

PARTIAL = ".convert-partial"


def _loop(text: str) -> tuple[int, int, int]:
    try:
        s, e, t = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--loop {text!r}: expected START:END:TIMES, e.g. 4:12:1"
        ) from None
    return s, e, t


def add_convert_command(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a pretrained MoE (ours, Qwen3-MoE, Mixtral) into a ConceptMoE"
    )
    p.add_argument("source", help="local checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output directory (transformers format)")
    d = ConvertConfig  # its defaults are the options' defaults
    p.add_argument("--encoder-layers", type=int, default=d.encoder_layers)
    p.add_argument("--decoder-layers", type=int, default=d.decoder_layers)
    p.add_argument(
        "--joint-layers",
        type=int,
        default=d.joint_decoding_layers,
        help="decoder layers with joint decoding (-1 = all)",
    )
    p.add_argument("--ratio", type=float, default=d.target_ratio, help="target compression ratio R")
    p.add_argument(
        "--concept-top-k",
        type=int,
        default=d.concept_top_k,
        help="strategy 1: activated experts in the concept model",
    )
    p.add_argument(
        "--loop", type=_loop, default=d.loop, help="strategy 2: START:END:TIMES concept-layer loops"
    )
    p.add_argument(
        "--grove-groups",
        type=int,
        default=d.grove_groups,
        help="Grove upcycling: adjugate experts per MoE "
        "layer (0: none); the source's logits are kept",
    )
    p.add_argument(
        "--grove-hidden",
        type=int,
        default=d.grove_hidden,
        help="intermediate size of an adjugate expert",
    )
    p.add_argument(
        "--grove-lambda",
        type=float,
        default=d.grove_lambda,
        help="adjugate scale, at most groups/experts",
    )
    p.add_argument(
        "--decoder-mode",
        choices=("joint", "cross_attention"),
        default=d.decoder_mode,
        help="how decoder layers read concepts: ConceptMoE joint decoding or DLCM cross-attention",
    )
    p.add_argument(
        "--tol", type=float, default=0.02, help="allowed per-token FLOPs mismatch vs the source"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="after writing, print the largest logit difference between the written model (every "
        "boundary forced on) and the source on random token ids; exit 1 above --check-tol",
    )
    p.add_argument(
        "--check-tol", type=float, default=1e-3, help="largest logit difference --check accepts"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out holds (another model), all of it; without it a folder that "
        "holds anything is refused",
    )
    p.set_defaults(func=run_convert)


def check_out(src: Path, out: Path, overwrite: bool) -> None:
    """ConfigError (one line) unless the converted model may be written into `out`, before the
    source is read."""
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents or o in s.parents:
        where = "is" if o == s else "is inside" if s in o.parents else "holds"
        raise ConfigError(
            f"--out {out} {where} the source folder {src}: writing there would overwrite the "
            "model being converted; give another folder"
        )
    problem = folder_problem(out)
    if problem is not None:
        raise ConfigError(f"--out {out}: {problem}")
    held = sorted(p.name for p in out.iterdir() if not is_lock_file(p.name)) if out.is_dir() else []
    held = [n for n in held if n != PARTIAL]
    if held and not overwrite:
        listed = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise ConfigError(
            f"--out {out} already holds {'a model' if 'config.json' in held else 'files'} "
            f"({listed}); converting would replace its weights and leave the rest beside the new "
            "model: give a new or empty folder, or --overwrite to replace all of it"
        )


def _move_in(partial: Path, out: Path) -> None:
    """The complete conversion in `partial` becomes `out`'s content: everything else in `out`
    (an overwritten model's files) is removed first."""
    for p in out.iterdir():
        if p == partial or is_lock_file(p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for p in partial.iterdir():
        os.replace(p, out / p.name)
    partial.rmdir()


def run_convert(args) -> int:
    src, final = Path(args.source), Path(args.out)
    check_out(src, final, args.overwrite)
    with lock_folder(final, "vlm convert"):
        partial = final / PARTIAL
        shutil.rmtree(partial, ignore_errors=True)  # a conversion killed part way left it
        try:
            rc = _convert(args, partial)
            follow_umask(partial)
            _move_in(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    print(f"wrote {final}")
    if args.check:
        diff = max_logit_difference(src, final)
        print(
            f"check: largest logit difference vs the source, every boundary on: {diff:.3g} "
            f"({'ok' if diff <= args.check_tol else 'FAILED'}, tolerance {args.check_tol:g})"
        )
        if diff > args.check_tol:
            return 1
    return rc


def _convert(args, out: Path) -> int:
    """The conversion, written into `out` (the partial folder)."""
    from vlm.model.convert import TOKENIZER_FILES, convert, source_token_ids
    from vlm.model.flops import count_params, flops_per_token
    from vlm.model.hf import save_pretrained
    from vlm.model.weights_check import write_checksums

    opt = ConvertConfig(
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        joint_decoding_layers=args.joint_layers,
        target_ratio=args.ratio,
        concept_top_k=args.concept_top_k,
        loop=args.loop,
        grove_groups=args.grove_groups,
        grove_hidden=args.grove_hidden,
        # validated: a bad option stops
        grove_lambda=args.grove_lambda,
        decoder_mode=args.decoder_mode,
    )
    model, base = convert(args.source, opt)
    cfg = model.model_cfg
    f_base, f_new = flops_per_token(base)["total"], flops_per_token(cfg, args.ratio)["total"]
    p_base, p_new = count_params(base)["total"], count_params(cfg)["total"]
    print(f"source: {p_base / 1e6:.2f}M params, {f_base / 1e6:.2f} MFLOPs/token")
    print(
        f"converted (R={args.ratio}): {p_new / 1e6:.2f}M params ({p_new / p_base:.4f}x), "
        f"{f_new / 1e6:.2f} MFLOPs/token ({f_new / f_base:.4f}x)"
    )
    if abs(f_new / f_base - 1) > args.tol:
        print(
            "warning: per-token FLOPs differ from the source by "
            f"{100 * abs(f_new / f_base - 1):.1f}% (> {100 * args.tol:.0f}%); "
            "adjust --concept-top-k / --loop (see `vlm flops`)"
        )
    src = Path(args.source)
    save_pretrained(model, out)
    ids = source_token_ids(src)
    # generate from the converted folder stops on the source's eos, as the source's own does
    if ids:
        from vlm.model.hf import ConceptMoEConfig, read_config

        config = read_config(out, ConceptMoEConfig)
        for key, v in ids.items():
            setattr(config, key, v)
        config.save_pretrained(str(out))
        from transformers import GenerationConfig

        gen = GenerationConfig.from_model_config(config)
        # every id the source stops at
        gen.eos_token_id = _source_stop_ids(src) or gen.eos_token_id
        gen.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    write_checksums(out, tokenizer=True)  # the tokenizer files as copied
    return 0


def _source_stop_ids(src: Path) -> list[int] | None:
    """The source's generation_config.json eos ids when it lists several (a chat model's end of
    turn and its eos, as an export of this project states them): the converted model stops at
    all of them."""

    from vlm.model.weights_check import read_json_object

    f = src / "generation_config.json"
    ids = read_json_object(f, "generation config").get("eos_token_id") if f.is_file() else None
    if isinstance(ids, list) and len(ids) > 1 and all(isinstance(i, int) for i in ids):
        return [int(i) for i in ids]
    return None


def max_logit_difference(source: Path, converted: Path, tokens: int = 48, seed: int = 0) -> float:
    """max |logit| difference between `converted` (read back from disk, every boundary
    forced on) and `source` over the source's vocabulary, on one document of random token
    ids (float32, CPU)."""
    import json

    import torch

    from configs.batch import PackedBatch
    from vlm.model.hf import MODEL_TYPE, load_vlm

    new = load_vlm(converted).eval()
    if json.loads((source / "config.json").read_text()).get("model_type") == MODEL_TYPE:
        old = load_vlm(source).eval()
        ref = lambda ids: old(PackedBatch.from_documents([ids.tolist()])).logits  # noqa: E731
        vocab = old.model_cfg.vocab_size
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
        ref = lambda ids: hf(input_ids=ids[None]).logits  # noqa: E731
        vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = new(PackedBatch.from_documents([ids.tolist()]), force="all").logits[..., :vocab]
        want = ref(ids)
    return float((got - want).abs().max())


__all__ = ["add_convert_command", "run_convert", "ConfigError"]
