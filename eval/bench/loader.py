"""The training loader as the trainer runs it, on a run config and its data: tokens/s, images/s,
tokens per CPU-second, CPU time and bytes read per micro-batch, and the CPU cores one GPU needs at a
stated rate, per number of DataLoader workers; as rank R of M ranks.

    vlm bench loader --config configs/gpu.yaml                       # a generated LLaVA-style mix
    vlm bench loader --config mine.yaml                             # the config's own data.sources
    vlm bench loader --config mine.yaml --data /data/shards         # other shards, same settings
    vlm bench loader --config mine.yaml --tokens-per-s 60000        # cores per GPU at 60K tokens/s
    vlm bench loader --world-size 64 --rank 0                       # rank 0's loader of 64 ranks

The loader is built by the trainer's own path (vlm.train.loaders.build_loaders, rank R of M: 0 of
1 unless --rank / --world-size say otherwise) with `data.num_workers` set per candidate, so what is
measured is what a training run gets: the planner, the workers decoding the rank's micro-batches,
the batches as they reach the training loop (not their copy to a GPU). Each round builds a fresh
loader per worker count and times `batches` of the rank's own micro-batches after every worker has
delivered one (start-up, the index's first build and the shuffle buffer's first fill are not
timed): the same number at any M, each of which costs planning M micro-batches. CPU time is the
loader's: this process (the planning thread) and its workers. Bytes read are the loader's own count
(shard and index files: `PackedLoader.io`) and, as a check, the bytes every read() of this process
and its workers returned (/proc/PID/io rchar: page cache included). Tokens count non-padding
positions. Cores per GPU = the stated tokens/s / tokens per CPU-second: the cores a GPU training at
that rate keeps busy with its data.

Without --data and with a config that names no sources the data is a generated LLaVA-style mix
(eval.bench.llava_mix: chat about photo-like JPEGs of 336-768 px, 6 % text-only), written into a
temporary folder and deleted afterwards. The quick setting uses a smaller mix and shuffle buffer.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eval.bench import common

PART = "loader"


@dataclass
class Settings:
    config: str = "configs/gpu.yaml"
    # a user's shards (a folder, glob or URL) in place of the config's sources; None: the config's
    # own, or a generated LLaVA-style mix when it names none
    data: str | None = None
    workers: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    batches: int = 12  # micro-batches timed per round and worker count
    repeats: int = 3
    warmup: int = 0  # every round starts fresh processes; their start-up is excluded anyway
    tokens_per_s: float = 100_000.0  # the rate the cores per GPU are stated at
    # the loader measured is rank `rank` of `world_size` (data-parallel ranks)
    world_size: int = 1
    rank: int = 0
    mix_samples: int = 6000  # the generated mix: more than the gpu config's shuffle buffer holds
    mix_images: int = 300  # distinct pictures, cycled over the samples
    overrides: list[str] = field(default_factory=list)  # dotted config overrides, as `vlm train`'s
    label: str = ""  # what was measured, when it is not this checkout (a before/after pair)


SETTINGS = {
    "full": Settings(),
    "quick": Settings(
        workers=[0, 1],
        batches=3,
        repeats=2,
        mix_samples=600,
        mix_images=40,
        overrides=["data.shuffle_buffer=256"],
    ),
    "smoke": Settings(
        workers=[0, 1],
        batches=2,
        repeats=2,
        mix_samples=120,
        mix_images=8,
        overrides=[
            "data.shuffle_buffer=16",
            "data.row_tokens=1024",
            "data.rows_per_batch=2",
            "data.pack_buffer=16",
        ],
    ),
}


def _cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its live children (the DataLoader workers)."""
    total = time.process_time()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # it ended in between: its time is lost to both readings
                pass
    except ImportError:  # without psutil: /proc
        for pid in _children(os.getpid()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
    return total


def _rchar() -> int:
    """Bytes the read() calls of this process and its live children have returned (/proc rchar);
    0 where /proc is not there."""
    total = 0
    for pid in [os.getpid(), *_children(os.getpid())]:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("rchar:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(k) for k in kids]
    for k in list(out):
        out += _children(k)
    return out


def config_path(s: Settings) -> Path:
    """The config as given; the default one from this checkout when run elsewhere."""
    p = Path(s.config)
    if not p.exists() and s.config == Settings.config:
        return Path(__file__).resolve().parents[2] / s.config
    return p


def run_config(s: Settings, data: str | None, workers: int):
    """The run config as the trainer would load it, with this round's workers and data."""
    from vlm.train.config import load_train_config

    over = [*s.overrides, f"data.num_workers={workers}", "logging.eval_every=0"]
    if data is not None:
        over.append(f"data.sources=[{{path: '{data}'}}]")
    return load_train_config(config_path(s), over)


IO_KEYS = ("shard_bytes", "index_bytes", "samples_decoded", "index_entries")


def reader(s: Settings, data: str | None, workers: int, counts: list):
    """A self-timed pass over `s.batches` of the rank's own micro-batches; appends (tokens, images,
    image tokens, slots, cpu seconds, {what the loader read}, rchar bytes) to `counts`."""
    from configs.batch import IMAGE
    from data_pipelines.tokenizer import load_tokenizer
    from vlm.train.loaders import build_loaders

    cfg = run_config(s, data, workers)
    tok = load_tokenizer(cfg.data.tokenizer_path)

    def read() -> float:
        loader, _ = build_loaders(cfg, tok, s.rank, s.world_size)
        it = iter(loader)
        for _ in range(max(workers, 1)):  # every worker has delivered once
            next(it)
        tokens = images = image_tokens = slots = 0
        io0, rchar0 = loader.io, _rchar()
        cpu0, t0 = _cpu_seconds(), time.perf_counter()
        for _, batch in zip(range(s.batches), it):
            tokens += int(batch.valid.sum())
            slots += batch.valid.numel()
            image_tokens += int((batch.modality == IMAGE).sum())
            images += 0 if batch.image_grids is None else int(batch.image_grids.shape[0])
        elapsed, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        rchar, io = _rchar() - rchar0, loader.io
        read_io = {k: io.get(k, 0) - io0.get(k, 0) for k in IO_KEYS}
        del it
        counts.append((tokens, images, image_tokens, slots, cpu, read_io, rchar))
        return elapsed

    return read


def _data(s: Settings, tmp: Path) -> tuple[str | None, str]:
    """(the shards to read, None for the config's own; what they are, for the JSON)."""
    if s.data is not None:
        return s.data, s.data
    if run_config(s, None, 0).data.sources:
        return None, f"the sources of {s.config}"
    from eval.bench.llava_mix import write_llava_mix

    folder = write_llava_mix(tmp / "llava_mix", s.mix_samples, s.mix_images)
    return str(folder), (
        f"generated LLaVA-style mix: {s.mix_samples} chat samples, photo-like JPEGs of 336-768 px "
        f"({s.mix_images} distinct), 6 % text-only"
    )


def run(s: Settings, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="vlm-bench-loader-") as tmp:
        t0 = time.perf_counter()
        data, described = _data(s, Path(tmp))
        build_s = time.perf_counter() - t0
        counts = {f"workers={w}": [] for w in s.workers}
        fns = {name: reader(s, data, w, counts[name]) for name, w in zip(counts, s.workers)}
        secs = common.measure(fns, s.repeats, s.warmup)
        cfg = run_config(s, data, 0)
    timed = {n: c[-s.repeats :] for n, c in counts.items()}  # the warm-up passes come first
    per_round = {
        "tokens/s": lambda c, t: c[0] / t,
        "images/s": lambda c, t: c[1] / t,
        "tokens per CPU-second": lambda c, t: c[0] / c[4],
        "images per CPU-second": lambda c, t: c[1] / c[4],
        "cores per GPU": lambda c, t: s.tokens_per_s * c[4] / c[0],
        "CPU-seconds per micro-batch": lambda c, t: c[4] / s.batches,
        "MB read per micro-batch": lambda c, t: (
            (c[5]["shard_bytes"] + c[5]["index_bytes"]) / s.batches / 1e6
        ),
        "MB read() per micro-batch": lambda c, t: c[6] / s.batches / 1e6,
    }
    units = {
        "tokens/s": "tok/s",
        "images/s": "img/s",
        "tokens per CPU-second": "tok/cpu-s",
        "images per CPU-second": "img/cpu-s",
        "cores per GPU": "cores",
        "CPU-seconds per micro-batch": "cpu-s",
        "MB read per micro-batch": "MB",
        "MB read() per micro-batch": "MB",
    }
    extra = {}
    for n, c in timed.items():
        tokens, images, image_tokens, slots = (sum(x[i] for x in c) for i in range(4))
        mbs = max(len(c) * s.batches, 1)
        extra[n] = {
            "packing_efficiency": round(tokens / max(slots, 1), 4),
            "image_token_share": round(image_tokens / max(tokens, 1), 4),
            "tokens_per_micro_batch": round(tokens / mbs),
            # planning's work (entries it took from the index) and decoding's (samples read whole)
            **{
                f"{k}_per_micro_batch": round(sum(x[5][k] for x in c) / mbs, 1)
                for k in ("index_entries", "samples_decoded")
            },
        }
    setting = {
        "row_tokens": cfg.data.row_tokens,
        "rows": cfg.data.rows_per_batch,
        "world_size": s.world_size,
        "rank": s.rank,
    }
    out = []
    for metric, fn in per_round.items():
        values = {n: [fn(c, t) for c, t in zip(timed[n], secs[n])] for n in secs}
        out += common.rows(values, next(iter(secs)), setting, metric, units[metric], extra)
    med = {(r["candidate"], r["metric"]): r["median"] for r in out}
    log(
        f"  loader, rank {s.rank} of {s.world_size}, per own micro-batch: "
        + ", ".join(
            f"{n} {med[(n, 'CPU-seconds per micro-batch')]:.3f} CPU-s, "
            f"{med[(n, 'MB read per micro-batch')]:.2f} MB read"
            for n in timed
        )
    )
    return common.result(
        PART,
        asdict(s),
        out,
        dataset_build_seconds=round(build_s, 2),
        dataset=described,
        notes=[
            "tokens count non-padding positions; CPU time is this process's and its workers'",
            f"cores per GPU: cores the loader keeps busy at {s.tokens_per_s:,.0f} tokens/s",
            (
                f"rank {s.rank} of {s.world_size}: per micro-batch = per micro-batch of this "
                f"rank's own; each costs planning {s.world_size} micro-batch(es)"
            ),
            (
                "MB read: shard and index files, as the loader counts them; MB read(): every "
                "read() of the process and its workers (/proc rchar, page cache included)"
            ),
        ],
    )


def plot(res: dict, path) -> None:
    # Candidates are worker counts: one point each, against the worker count.
    rows = [
        {
            **r,
            "setting": {**r["setting"], "workers": int(r["candidate"].split("=")[1])},
            "candidate": r["metric"],
        }
        for r in res["rows"]
        if r["metric"] in ("tokens per CPU-second", "tokens/s")
    ]
    common.plot(
        {**res, "rows": rows},
        path,
        x="workers",
        panels=("metric",),
        y="median",
        ylabel="tokens",
        logx=False,
        title="the training loader vs DataLoader workers (0 = in process)",
    )
