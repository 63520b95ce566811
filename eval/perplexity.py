"""`vlm eval ppl`: held-out LM loss and bits per byte of an exported model, per kind of sample.

Legend: B rows, T tokens.

    vlm eval ppl --ckpt RUN/final [--data SHARDS ...] [--max-batches N] [--out result.json]

Without --data: the default dataset's validation split. Samples are packed and scored as in training
(chat samples on their answers, captions and text on every token); bits per byte divide the
text-only samples' summed loss in bits by the UTF-8 bytes of the tokens they predict, so models with
different tokenizers compare on one scale.
"""

from __future__ import annotations

import json

import torch

from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from vlm.model.context import ForwardContext
from vlm.train.metrics import StepAccumulator, token_losses

KEYS = (
    "loss/lm",
    "loss/text_only",
    "bpb/text",
    "loss/image_text",
    "compression/text",
    "compression/image",
)


@torch.no_grad()
def perplexity(
    chat, shards: list[str] | None, data_dir: str, max_batches: int | None, row_tokens: int = 512
) -> dict:
    """`chat`: a ConceptMoEChat (model, tokenizer, processor)."""
    proc = chat.processor.cfg if chat.processor is not None else DataConfig().processor
    sources = [SourceConfig(path=str(p), name=f"s{i}") for i, p in enumerate(shards or [])]
    cfg = DataConfig(
        sources=sources,
        default_dir=data_dir,
        split="val",
        epochs=1,
        shuffle_buffer=0,
        row_tokens=row_tokens,
        rows_per_batch=4,
        loss_on="assistant",
        processor=proc,
    )
    acc = StepAccumulator(
        chat.device, torch.as_tensor(chat.tokenizer.bytes_per_id, device=chat.device)
    )
    n = 0
    for batch in build_loader(cfg, chat.tokenizer):
        if max_batches is not None and n >= max_batches:
            break
        batch = batch.to(chat.device)
        # no [B, T, V] logits: the loss makes them a tile of tokens at a time
        out = chat.model(batch, context=ForwardContext(logits=False))
        acc.add_output(out, batch, token_loss_BT=token_losses(out, batch))
        n += 1
    if not n:
        raise ValueError(
            f"no samples to score in {', '.join(shards) if shards else data_dir} (empty shards, "
            "or none could be read)"
        )
    rec = acc.record(0, lambda x: x).scalars
    return {"batches": n, **{k: rec.get(k) for k in KEYS}}


def run(args) -> int:
    """`vlm eval ppl` (its arguments are declared in eval/cli.py)."""
    from data_pipelines.reader import SHARD_SUFFIXES, ShardError, local_source, resolve_shards
    from eval.preflight import (
        DEFAULT_DATA,
        check_model_dir,
        check_out_file,
        default_data,
        fail,
        load_model,
    )

    prog = "vlm eval ppl"
    check_model_dir(args.ckpt, prog)
    # before the model loads and the batches are scored
    out = check_out_file(args.out, prog)
    for pattern in args.data or []:
        try:
            found = resolve_shards(pattern)
        except ShardError as e:
            fail(prog, f"--data {pattern}: {e}")
        not_shards = [
            p for p in found if local_source(str(p)) and not str(p).endswith(SHARD_SUFFIXES)
        ]
        if not_shards:
            fail(
                prog,
                f"--data {pattern}: {not_shards[0]} is not a webdataset shard "
                f"({', '.join(SHARD_SUFFIXES)}); import text or tables first (`vlm data "
                "import-table`)",
            )
    data_dir = args.default_dir or DEFAULT_DATA
    ready = None if args.data else default_data(args.default_dir, prog, args.build, "--default-dir")
    chat = load_model(args.ckpt, prog)
    if ready is not None:
        data_dir = str(ready())
    try:
        res = perplexity(chat, args.data, data_dir, args.max_batches, args.row_tokens)
    except (ShardError, ValueError) as e:  # shards that hold nothing the model can score
        fail(prog, str(e))
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    print(f"{args.ckpt}: {res['batches']} batches")
    print(f"  LM loss (all)        {fmt(res['loss/lm'])}")
    print(
        f"  text-only samples    {fmt(res['loss/text_only'])}   "
        f"({fmt(res['bpb/text'])} bits per byte)"
    )
    print(f"  image-text samples   {fmt(res['loss/image_text'])}")
    print(
        "  compression (tokens per concept): text "
        f"{fmt(res['compression/text'])}, image {fmt(res['compression/image'])}"
    )
    if out is not None:
        out.write_text(json.dumps(res, indent=1))
    return 0
