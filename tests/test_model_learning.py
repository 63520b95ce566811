"""A few hundred CPU steps: the realized compression reaches the target ratio while the LM loss falls."""

import argparse
import collections
import json
import pydoc

import torch

from configs.batch import PackedBatch
from vlm.model.conceptmoe import ConceptMoELM
from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig
from vlm.model.stats import lm_loss, summarize
from vlm.train.loss_config import LossConfig
from vlm.train.losses import training_loss


def corpus_bytes() -> bytes:
    # Real English prose shipped with Python itself: no downloads, no fixtures.
    text = "\n".join(pydoc.getdoc(m) for m in (argparse, collections, json, pydoc, torch.nn.Module))
    return text.encode("utf-8")


def batches(data: bytes, rows: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(data), dtype=torch.long)
    while True:
        starts = torch.randint(0, len(ids) - 2 * T, (rows,), generator=g)
        out = []
        for s in starts.tolist():  # two documents per row, split at a random point
            cut = int(torch.randint(T // 4, 3 * T // 4, (1,), generator=g))
            out.append(
                PackedBatch.from_documents(
                    [ids[s : s + cut].tolist(), ids[s + T : s + 2 * T - cut].tolist()]
                )
            )
        yield PackedBatch.stack(out)


def test_compression_reaches_target_while_lm_loss_falls():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=64),
        chunk=ChunkConfig(target_ratio=2.0, merge="last"),  # with loss.ratio 0.1
    )
    m = ConceptMoELM(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    stream = batches(corpus_bytes(), rows=8, T=96, seed=0)
    lm, ratio = [], []
    for step in range(300):
        batch = next(stream)
        out = m(batch)
        opt.zero_grad()
        training_loss(out, batch, m.cfg, LossConfig(ratio=0.1)).backward()
        opt.step()
        lm.append(lm_loss(out, batch).item())
        ratio.append(summarize(out, batch)["compression/ratio"])
    first, last = sum(lm[:20]) / 20, sum(lm[-20:]) / 20
    realized = sum(ratio[-50:]) / 50
    print(json.dumps({"lm_first": first, "lm_last": last, "ratio_last50": realized}))
    assert last < first - 1.0, (first, last)
    assert abs(realized - 2.0) / 2.0 < 0.10, realized
