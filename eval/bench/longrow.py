"""Long-row training with sequence parallelism (vlm.model.sequence_parallel): one row of T tokens
split over the S ranks of the run, a training forward and backward of the LLM, timed, and the row's
peak memory on a rank.

    torchrun --nproc_per_node S -m eval.bench longrow [--quick]   # the row split over S ranks
    vlm bench longrow [--quick]                                   # one process: S = 1

Each round draws one packed row of T tokens (documents of 1/8 of the row, so several cross the
shards' boundaries) and runs the LLM of `config` (configs/default.yaml on a CPU, configs/gpu.yaml
on CUDA) in training mode, boundaries sampled as in training, the loss of the trainer
(vlm.train.losses: LM, ratio, balance) and its backward. Reported per T: seconds per forward +
backward (the slowest rank's) and the row's peak memory on the rank that holds the most: the most
the live tensors allocated during the forward and backward reached (the weights and optimizer
state, which do not grow with the row, are left out), counted per storage on a CPU
(vlm.plan.tracker.LiveBytes) and by CUDA's allocator on a GPU. A row whose S = 1 run does not fit
is reported as unavailable; the ratio to S = 1 is read off two runs' tables (the baseline here is
the row's own first length).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from eval.bench import common

PART = "longrow"


@dataclass
class Settings:
    tokens: list[int] = field(default_factory=lambda: [16384, 32768, 65536])
    config: str = ""  # "": configs/default.yaml on a CPU, configs/gpu.yaml on CUDA
    repeats: int = 3
    doc_fraction: float = 0.125  # each document is this share of the row


SETTINGS = {
    "full": Settings(),
    "quick": Settings(tokens=[16384], repeats=2),
    "smoke": Settings(tokens=[512], repeats=1),
}


def _group():
    """(shard or None, rank, ranks, device) under torchrun; one process: S = 1."""
    from vlm.model.sequence_parallel import SequenceShard
    from vlm.train.collectives import SequenceGroup

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None, 0, 1, dev
    from vlm.train.distributed import init_distributed, make_groups
    from vlm.train.layout import ParallelLayout

    info = init_distributed()
    layout = ParallelLayout(info.world_size, info.rank, sequence=info.world_size)
    group = make_groups(layout).sequence
    return (
        SequenceShard(SequenceGroup(group), info.rank, info.world_size),
        info.rank,
        info.world_size,
        info.device,
    )


def _row(T: int, doc_fraction: float, vocab: int, seed: int, dev):
    from configs.batch import PackedBatch
    from vlm.model.layers import positions_in_doc

    g = torch.Generator().manual_seed(seed)
    n = max(int(T * doc_fraction), 2)
    doc = (torch.arange(T) // n)[None]
    ids = torch.randint(0, vocab, (1, T), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    return PackedBatch(ids, labels, doc, positions_in_doc(doc), torch.zeros_like(ids)).to(dev)


def run(s: Settings, log=print) -> dict:
    from configs.config import from_dict, to_dict
    from vlm.model.conceptmoe import ConceptMoELM
    from vlm.model.config import ModelConfig
    from vlm.model.context import ForwardContext
    from vlm.plan.tracker import LiveBytes
    from vlm.train import collectives
    from vlm.train.config import load_train_config
    from vlm.train.losses import Loss
    from vlm.train.sequence_shard import local_batch

    shard, rank, world, dev = _group()
    from eval.bench.gpu.errors import ROOT

    # the shipped configs from the repository, wherever the bench runs from
    cfg_path = s.config or str(
        ROOT / "configs" / ("gpu.yaml" if dev.type == "cuda" else "default.yaml")
    )
    mcfg = from_dict(ModelConfig, to_dict(load_train_config(cfg_path).model))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = ConceptMoELM(mcfg).to(dev, dtype).train()
    model.shard_sequence(shard)
    loss_fn = Loss(mcfg, shard=shard)
    rows, unavailable = [], {}
    largest = collectives.all_reduce_max if world > 1 else (lambda t: t)
    for T in s.tokens:
        setting = {"config": cfg_path, "sequence_ranks": world, "tokens": T}
        secs, peaks = [], []
        try:
            for r in range(s.repeats):
                batch = _row(T, s.doc_fraction, mcfg.vocab_size, r, dev)
                ctx = ForwardContext(torch.tensor(r, device=dev), "off", logits=False)
                live = LiveBytes("cpu") if dev.type == "cpu" else None
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                with live if live is not None else contextlib.nullcontext():
                    out = model(batch, context=ctx)
                    loss = loss_fn(out, local_batch(batch, shard)).backprop
                    loss.backward()
                    del out, loss
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - base
                else:
                    peak = live.peak
                secs.append(time.perf_counter() - t0)
                peaks.append(float(peak))
                model.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as e:  # pragma: no cover - a GPU's limit
            unavailable[f"{T} tokens"] = str(e).splitlines()[0]
            break
        secs = largest(torch.tensor(secs, dtype=torch.float64)).tolist()
        peaks = largest(torch.tensor(peaks, dtype=torch.float64)).tolist()
        gb = [p / 2**30 for p in peaks]
        log(f"longrow: {T} tokens over {world} rank(s): {min(secs):.2f} s, peak {max(gb):.3f} GB")
        rows += common.rows(
            {f"S={world}": secs},
            f"S={world}",
            {**setting, "what": "seconds per fwd+bwd"},
            "time",
            "s",
        )
        rows += common.rows(
            {f"S={world}": gb},
            f"S={world}",
            {**setting, "what": "row's peak GB per rank"},
            "memory",
            "GB",
            {f"S={world}": {"mib_per_token": max(peaks) / 2**20 / T}},
        )
    res = common.result(PART, asdict(s), rows, unavailable=unavailable)
    res["rank"] = rank
    if world > 1:
        collectives.barrier()
    return res


def plot(res: dict, path) -> None:
    common.plot(
        res,
        path,
        x="tokens",
        panels=("what",),
        y="median",
        ylabel="median",
        title="long rows split over the sequence-parallel ranks",
    )
