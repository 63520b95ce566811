"""Fast guards for the bugs no test caught (issue 52, "Bugs no test catches"): eight bugs a reviewer
planted that passed every test that runs here. Each test below fails on its bug, with a message that
names it, in seconds (docs/reliability.md, "Planted bugs: the fast guards"):

1. every parameter group given the first group's settings after a universal-checkpoint load
   (vlm/train/reshard.py `mend_optimizer`);
2. an expert-parallel checkpoint resumed on another number of ranks at the same degree
   (vlm/train/expert_parallel.py `check_resume`);
3. the serving state's pages rounded down (vlm/serve/layout.py `plan_state`);
4. the loader state's totals missing what was read after the last micro-batch
   (data_pipelines/plan.py `Planner.take_pending`);
5. the JPEG draft size with rows and columns swapped (vision/image_processor.py `pixels_into`);
6. an older run's global batch read without the ranks that wrote it (vlm/train/run_config.py
   `saved_global_batch`);
7. the CUDA feed not waiting for its copy (vlm/train/device_feed.py `DeviceFeed`, with stand-ins
   for CUDA's streams and events);
8. a corrupt later image in a multi-image sample leaving the earlier images' patches behind
   (data_pipelines/materialise.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tarfile
from collections import Counter

import pytest
import torch
from PIL import Image


# ======================================== 1. each group's own settings after a universal load
def _groups_and_optimizer():
    """Three named parameter groups with settings of their own, as build_param_groups makes them
    (the first, the embeddings', without weight decay), and an AdamW that took one step."""
    from vlm.train.config import OptimConfig
    from vlm.train.engine import build_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    settings = {
        "embeddings": dict(weight_decay=0.0, lr=1e-3, initial_lr=1e-3, betas=(0.9, 0.95)),
        "decay": dict(weight_decay=0.1, lr=2e-3, initial_lr=2e-3, betas=(0.8, 0.99)),
        "no_decay": dict(weight_decay=0.0, lr=3e-3, initial_lr=3e-3, betas=(0.7, 0.9), eps=1e-6),
    }
    groups = [
        {"name": "embeddings", "params": params[:1], **settings["embeddings"]},
        {"name": "decay", "params": params[1:3], **settings["decay"]},
        {"name": "no_decay", "params": params[3:], **settings["no_decay"]},
    ]
    opt = build_optimizer(groups, OptimConfig(), skip_nonfinite=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, params


def _universal_folder(tmp_path, opt, tag: str = "ds"):
    """The converted optimizer state's top level as DeepSpeed's ds_to_universal writes it
    (`zero/optimizer_state.pt`: the torch optimizer's param_groups), in reversed order: the groups
    are matched by name, not by position."""
    saved = [dict(g, params=list(range(len(g["params"])))) for g in opt.param_groups]
    root = tmp_path / "universal"
    (root / tag / "zero").mkdir(parents=True)
    torch.save({"param_groups": saved[::-1]}, root / tag / "zero" / "optimizer_state.pt")
    return root


def _as_deepspeeds_zero3_loader_leaves_it(opt) -> torch.Tensor:
    """What DeepSpeed's ZeRO-3 universal loader does to the optimizer: every group takes the first
    group's settings, every parameter's state the same step-count tensor. Returns that tensor."""
    from vlm.train.engine import OPTIM_SETTINGS

    first = opt.param_groups[0]
    for g in opt.param_groups[1:]:
        g.update({k: first[k] for k in OPTIM_SETTINGS if k in first})
    shared = torch.tensor(1.0)
    for state in opt.state.values():
        state["step"] = shared
    return shared


def test_a_universal_load_gives_every_parameter_group_its_own_settings(tmp_path):
    from vlm.train.engine import OPTIM_SETTINGS
    from vlm.train.reshard import mend_optimizer

    opt, _ = _groups_and_optimizer()
    want = {g["name"]: {k: g[k] for k in OPTIM_SETTINGS if k in g} for g in opt.param_groups}
    root = _universal_folder(tmp_path, opt)
    _as_deepspeeds_zero3_loader_leaves_it(opt)
    mend_optimizer(opt, root, "ds")
    for g in opt.param_groups:
        got = {k: g[k] for k in OPTIM_SETTINGS if k in g}
        assert got == want[g["name"]], (
            f"after a universal-checkpoint load parameter group {g['name']!r} has {got}, its own "
            f"settings are {want[g['name']]}: every group given the first group's settings "
            "(vlm/train/reshard.py mend_optimizer)"
        )


def test_a_universal_load_refuses_a_checkpoint_without_a_group_of_this_run(tmp_path):
    from vlm.train.engine import CheckpointRefused
    from vlm.train.reshard import mend_optimizer

    opt, _ = _groups_and_optimizer()
    root = _universal_folder(tmp_path, opt)
    opt.param_groups[1]["name"] = "vision"
    with pytest.raises(CheckpointRefused, match="no parameter group 'vision'"):
        mend_optimizer(opt, root, "ds")


# ======================================== 2. an expert-parallel checkpoint on other ranks
def _expert_checkpoint(tmp_path, degree: int, ranks: int):
    from vlm.train.expert_parallel import SHARD_FILE

    ckpt = tmp_path / f"ep{degree}_on{ranks}"
    ckpt.mkdir()
    for r in range(ranks):
        state = {
            "expert_parallel": degree,
            "expert_rank": r % degree,
            "world_size": ranks,
            "tensors": {"moe.w_up": torch.zeros(1)},
        }
        torch.save(state, ckpt / SHARD_FILE.format(r))
    return ckpt


@pytest.mark.parametrize("degree, written, now", [(2, 4, 2), (2, 2, 4), (2, 4, 8)])
def test_an_expert_checkpoint_moves_between_rank_counts_only_where_it_regroups(
    tmp_path, degree, written, now
):
    """Its expert shards and their Adam moments regroup on load on the plain fp32 path (ZeRO 0:
    one torch state dict per expert rank, vlm.train.expert_regroup); a run of another form (here
    fp16, which never regroups) is refused at the same degree on another number of ranks, naming
    both."""
    from configs.config import ConfigError
    from vlm.train.expert_parallel import check_resume

    ckpt = _expert_checkpoint(tmp_path, degree, written)
    check_resume(ckpt, degree, written, "fp16")  # the ranks that wrote it: resumes
    check_resume(ckpt, degree, now, "zero0")  # regrouped on load
    try:
        check_resume(ckpt, degree, now, "fp16")
    except ConfigError as e:
        msg = str(e)
    else:
        pytest.fail(
            f"a checkpoint of parallel.expert={degree} written by {written} ranks was accepted for "
            f"a bf16 stage-0 resume on {now} ranks at the same degree: check_resume compares the expert "
            "degree only, not the ranks that wrote the checkpoint (vlm/train/expert_parallel.py)"
        )
    assert f"parallel.expert={degree} on {written} ranks" in msg and "\n" not in msg, msg
    assert f"on {now} rank(s)" in msg, msg


@pytest.mark.parametrize("written", ["zero12", "zero12-bf16", "zero3", "zero0-bf16", "fp16"])
def test_an_expert_checkpoint_moves_only_between_runs_of_its_optimizer_form(tmp_path, written):
    """ZeRO 1-2 partitions, fp32 or bf16 (stage_1_and_2's file: per group a flat fp32 partition and
    each parameter's fragment in it, its DeepSpeed config beside), ZeRO-3 partitions and the
    stage-0 bf16 optimizer's fp32 copies regroup on load (vlm.train.expert_regroup,
    vlm.train.expert_regroup_zero3) for a run of the same form at another degree; fp16, or a run
    of another form, is refused in one line naming both forms."""
    from configs.config import ConfigError
    from vlm.train.expert_parallel import FORMS, REGROUPS, check_resume, written_form

    ckpt = _expert_checkpoint(tmp_path, 2, 2)
    (ckpt / "ds").mkdir()
    if written == "zero0-bf16":  # stage 0: the optimizer state in the expert ranks' files
        sd = {"optimizer": {"fp32_groups": [], "optimizer_state_dict": {}}}
        torch.save(sd, ckpt / "ds" / "expp_rank_0_mp_rank_00_optim_states.pt")
    else:
        stage = 3 if written == "zero3" else 2
        ds_config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": "bf16" in written}}
        if written == "fp16":
            ds_config["fp16"] = {"enabled": True}
        name = ("bf16_" if "bf16" in written else "") + "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": {}, "ds_config": ds_config}, ckpt / "ds" / name)
    form = written.replace("zero12-bf16", "zero12")
    assert written_form(ckpt) == form, f"{written}'s files read as {written_form(ckpt)}"
    regroups = {form} & set(REGROUPS)
    for now in regroups:
        check_resume(ckpt, 1, 1, now)  # regrouped on load
    for now in sorted(set(FORMS) - regroups):
        with pytest.raises(ConfigError) as e:
            check_resume(ckpt, 1, 1, now)
        msg = str(e.value)
        assert "parallel.expert=2 on 2 ranks" in msg and "\n" not in msg, msg
        assert f"this run: {FORMS[now]}; the checkpoint: {FORMS[form]}" in msg, msg


def test_a_checkpoint_without_expert_shards_resumes_on_any_number_of_ranks(tmp_path):
    from configs.config import ConfigError
    from vlm.train.expert_parallel import check_resume

    plain = tmp_path / "plain"
    plain.mkdir()
    for ranks in (1, 2, 4):
        check_resume(plain, 1, ranks, "fp16")
    check_resume(plain, 2, 2, "zero0")  # its experts are whole: regrouped into shards on load
    with pytest.raises(ConfigError, match="parallel.expert=1"):
        check_resume(plain, 2, 2, "fp16")


# ======================================== 3. the serving state: whole pages, rounded up
def _serve_model():
    from vlm.model.config import ChunkConfig, ModelConfig, MoEConfig

    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=2,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        chunk=ChunkConfig(),
    )


@pytest.mark.parametrize("block", [1, 2, 16, 32, 128])
def test_the_serving_state_holds_the_capacity_asked_for_in_whole_pages(block):
    """Every capacity from 1 to 600 concepts per pass: the plan holds at least that many (a request
    that reaches the capacity asked for drops no concept), in layers of whole token pages, each
    holding as many entries as fit beside the chunk state, and no more layers than it takes (but
    for vLLM's grouping)."""
    from vlm.serve.layout import (
        CHUNK,
        KV,
        MIN_ENTRIES,
        plan_state,
        state_bytes,
        token_page_bytes,
    )

    mc = _serve_model()
    dtype = torch.float32
    page = token_page_bytes(mc, block, dtype)
    token_layers = mc.encoder_layers + mc.decoder_layers
    entry = len(KV) * mc.c_kv_heads * mc.head_dim * 4
    chunk = CHUNK.rows * mc.hidden_size * 4
    for capacity in range(1, 601):
        plan = plan_state(mc, capacity, dtype, page, token_layers)
        assert plan.capacity >= capacity, (
            f"the serving state's pages rounded down: plan_state(capacity={capacity}, block "
            f"{block}) holds {plan.capacity} concepts per pass ({plan.per_pass} layers of "
            f"{plan.entries}); {capacity - plan.capacity} concepts a pass would be dropped "
            "(vlm/serve/layout.py)"
        )
        one_layer = state_bytes(mc, plan, dtype) // plan.layers
        pages = math.ceil(one_layer / page)
        assert plan.entries >= MIN_ENTRIES and chunk + MIN_ENTRIES * entry <= pages * page, (
            f"capacity {capacity}, block {block}: a state layer of {plan.entries} entries in "
            f"{pages} page(s) of {page} bytes: the page was rounded down below the chunk state "
            f"and {MIN_ENTRIES} entries (vlm/serve/layout.py)"
        )
        assert one_layer + entry > pages * page, (
            f"capacity {capacity}, block {block}: a state layer of {plan.entries} entries "
            f"({one_layer} bytes) leaves room for another in its {pages} page(s)"
        )
        fewest = math.ceil(capacity / plan.entries)
        assert fewest <= plan.per_pass <= fewest + token_layers, (capacity, block, plan)


# ======================================== 4. the loader state counts what was read at the end
def _text_then_bad_json(d, good: int, bad: int) -> None:
    """One shard: `good` text samples, then `bad` members that are not JSON (read only after the
    last micro-batch was planned, once the pool of samples waiting to be packed is empty)."""
    with tarfile.open(d / "mix-000000.tar", "w") as tf:
        members = [
            (f"g{i:03d}", json.dumps({"kind": "text", "text": f"good {i}"})) for i in range(good)
        ]
        members += [(f"z{i:03d}", "{bad") for i in range(bad)]
        for key, text in members:
            data = text.encode()
            ti = tarfile.TarInfo(f"{key}.json")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def test_the_loader_state_at_the_end_counts_the_samples_read_after_the_last_micro_batch(tmp_path):
    from data_pipelines.config import DataConfig, SourceConfig
    from data_pipelines.loader import build_loader
    from data_pipelines.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    _text_then_bad_json(tmp_path, good=4, bad=3)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path), name="mix")], row_tokens=64, rows_per_batch=1,
        shuffle_buffer=0, pack_buffer=2, epochs=1,
    )  # fmt: skip
    whole = build_loader(cfg, tok)
    assert len(list(whole)) >= 1
    assert whole.counters == {"bad_json": 3}, whole.counters  # the run's own count
    # a run that continues from the final state (a resume after the data ended) counts the state's
    # totals: they must hold what was read after the last micro-batch too
    resumed = build_loader(cfg, tok)
    resumed.load_state_dict(whole.state_dict())
    assert list(resumed) == []
    assert resumed.counters == whole.counters, (
        f"the loader state's totals after the data ended count {dict(resumed.counters)}, the run "
        f"counted {dict(whole.counters)}: what was read after the last micro-batch is missing "
        "from the state (data_pipelines/plan.py take_pending)"
    )
    assert resumed.stats["samples_read"] == whole.stats["samples_read"] == 7, (
        resumed.stats["samples_read"],
        whole.stats["samples_read"],
    )


# ======================================== 5. a JPEG decoded at a reduced scale that fits its grid
def _jpeg(w: int, h: int, orientation: int = 1) -> bytes:
    import numpy as np

    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 7) % 256, (y * 5) % 256, (x + y) % 256], -1).astype(np.uint8)
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


@contextlib.contextmanager
def _drafts():
    """Every JPEG draft request made inside: (the size asked for, the size decoded at)."""
    from PIL import JpegImagePlugin

    seen, real = [], JpegImagePlugin.JpegImageFile.draft

    def draft(self, mode, size):
        out = real(self, mode, size)
        seen.append((tuple(size), self.size))
        return out

    JpegImagePlugin.JpegImageFile.draft = draft
    try:
        yield seen
    finally:
        JpegImagePlugin.JpegImageFile.draft = real


@pytest.mark.parametrize(
    "w, h, orientation",
    [(1600, 200, 1), (200, 1600, 1), (1600, 200, 6), (200, 1600, 8), (800, 800, 1)],
    ids=["wide", "tall", "wide-stored-rotated", "tall-stored-rotated", "square"],
)
@pytest.mark.parametrize("path", ["loader", "prompt"])
def test_a_jpeg_is_drafted_to_the_smallest_scale_that_still_holds_its_grid(w, h, orientation, path):
    """libjpeg's draft decodes at 1/2, 1/4 or 1/8 scale: the decode must still cover the grid's pixel
    size on both sides (else the image is upscaled) and be the smallest such scale (else it decodes
    pixels it throws away). The grid is upright; the JPEG's pixels are as stored (EXIF 5-8:
    transposed). Only an image whose sides differ shows a swap of rows and columns. Both decodes
    that draft: the loader's (`pixels_into` a planned image) and a prompt's (`load(...,
    for_patches=True)`: vlm chat, vlm serve)."""
    import numpy as np

    from vision.image_processor import ImageProcessor, ImageProcessorConfig

    proc = ImageProcessor(ImageProcessorConfig(patch_size=14, max_patches=64))
    plan = proc.plan(_jpeg(w, h, orientation))
    rows, cols = plan.grid
    p = proc.cfg.patch_size
    # the grid's pixel size in the stored orientation
    need_w, need_h = (rows * p, cols * p) if orientation in (5, 6, 7, 8) else (cols * p, rows * p)
    out = np.empty((plan.num_patches, 3 * p * p), dtype=np.uint8)
    with _drafts() as seen:
        if path == "loader":
            proc.pixels_into(plan, out)
        else:
            proc.load(plan.data, for_patches=True)
    assert len(seen) == 1, seen
    asked, (dw, dh) = seen[0]
    what = (
        f"a {w}x{h} JPEG (EXIF orientation {orientation}) for a grid of {rows}x{cols} patches "
        f"({need_w}x{need_h} stored pixels) asked the draft for {asked[0]}x{asked[1]} and was "
        f"decoded at {dw}x{dh}"
    )
    swapped = "the JPEG draft size has rows and columns swapped (vision/image_processor.py " + (
        "pixels_into)" if path == "loader" else "load, for_patches)"
    )
    assert dw >= need_w and dh >= need_h, f"{what}: smaller than its grid, upscaled; {swapped}"
    smallest = (dw, dh) == (math.ceil(w / 8), math.ceil(h / 8))
    assert smallest or (dw + 1) // 2 < need_w or (dh + 1) // 2 < need_h, (
        f"{what}: a decode at half that size would still hold the grid; {swapped}"
    )


# ======================================== 6. an older run's global batch: over the ranks that wrote it
@pytest.mark.parametrize("written_by", [1, 2, 4])
def test_an_older_runs_global_batch_counts_the_ranks_that_wrote_it(written_by):
    from vlm.train.run_config import saved_global_batch

    older = {"data": {"rows_per_batch": 2}, "optim": {"grad_accum": 3}}  # no global_batch_rows
    got = saved_global_batch(older, written_by)
    assert got == 2 * 3 * written_by, (
        f"a config.yaml from before optim.global_batch_rows (2 rows x 3 micro-batches, written by "
        f"{written_by} ranks) read as a global batch of {got} rows, not {2 * 3 * written_by}: "
        "the ranks that wrote it left out (vlm/train/run_config.py saved_global_batch)"
    )
    stated = {"data": {"rows_per_batch": 2}, "optim": {"grad_accum": 3, "global_batch_rows": 12}}
    assert saved_global_batch(stated, written_by) == 12
    assert saved_global_batch({}, written_by) == written_by  # the defaults: 1 row x 1


def test_an_older_two_rank_run_resumes_on_one_with_its_global_batch(tmp_path):
    """Through the resume's reading of the run folder (config.yaml and the checkpoint's meta.json)
    and the accumulation it gives one rank."""
    import yaml

    from configs.config import from_dict
    from vlm.train.config import TrainConfig
    from vlm.train.run import saved_config
    from vlm.train.run_config import with_global_batch

    ckpt = tmp_path / "checkpoints" / "step_00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"world_size": 2}))
    older = {"data": {"rows_per_batch": 1}, "optim": {"grad_accum": 2}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older))
    saved = saved_config(tmp_path, ckpt, warn=lambda *_: None)
    assert saved["optim"]["global_batch_rows"] == 4, (
        f"an older run of 1 row x 2 micro-batches written by 2 ranks resumed with a global batch "
        f"of {saved['optim']['global_batch_rows']} rows, not 4: the ranks that wrote it left "
        "out (vlm/train/run.py saved_config, run_config.py saved_global_batch)"
    )
    cfg = from_dict(TrainConfig, {"data": {"rows_per_batch": 1}, "optim": {"grad_accum": 2}})
    one = with_global_batch(cfg, 1, saved["optim"]["global_batch_rows"])
    assert one.optim.grad_accum == 4, (
        f"a 2-rank run of 2 micro-batches each resumed on 1 rank accumulates "
        f"{one.optim.grad_accum} micro-batches a step, not 4"
    )


# ======================================== 7. the CUDA feed waits for its copy
class _FakeCuda:
    """Stand-ins for CUDA's streams and events (on CPU) that log what is asked of them: the step's
    stream is current unless `torch.cuda.stream(s)` made `s` current; an event records on the
    stream given, else on the current one."""

    class Stream:
        def __init__(self, cuda, name: str):
            self.cuda, self.name = cuda, name

        def wait_event(self, event) -> None:
            self.cuda.log.append(("wait", event, self))

        def __repr__(self) -> str:
            return f"the {self.name} stream"

    class Event:
        def __init__(self, cuda):
            self.cuda, self.recorded_on = cuda, None

        def record(self, stream=None) -> None:
            self.recorded_on = stream or self.cuda.current_stream()
            self.cuda.log.append(("record", self, self.recorded_on))

    def __init__(self):
        self.log: list = []
        self.step = self.Stream(self, "step's")
        self.side = self.Stream(self, "feed's side")
        self.active: list = []

    def current_stream(self, device=None):
        return self.active[-1] if self.active else self.step

    @contextlib.contextmanager
    def stream(self, s):
        self.active.append(s)
        try:
            yield
        finally:
            self.active.pop()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.side)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: self.Event(self))
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)


def test_the_cuda_feed_makes_the_step_wait_for_each_batchs_copy(monkeypatch):
    """CUDA's streams and events replaced by stand-ins that log what is asked of them (on CPU):
    each batch is copied on the side stream and an event recorded there after the copy, and the
    step's stream waits for that event before the batch is handed over; its tensors are marked as
    used on the step's stream (record_stream)."""
    from configs.batch import PackedBatch
    from vlm.train import device_feed

    cuda = _FakeCuda()
    cuda.install(monkeypatch)

    def copy(batch, device):
        assert cuda.current_stream() is cuda.side, "the copy is not made on the feed's side stream"
        cuda.log.append(("copy", int(batch.input_ids[0, 0])))
        return batch

    monkeypatch.setattr(device_feed, "_pinned_copy", copy)
    monkeypatch.setattr(device_feed, "prepare", lambda batch, device, dtype: batch)
    marked = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marked.append((t, s)))

    host = [PackedBatch.from_documents([[10 + i, 2, 3]]) for i in range(4)]
    got = []
    for batch in device_feed.DeviceFeed(iter(host), "cuda", depth=2):
        i = int(batch.input_ids[0, 0]) - 10
        after_copy = cuda.log[cuda.log.index(("copy", 10 + i)) :]
        events = [e for kind, e, _ in (x for x in after_copy if x[0] != "copy") if kind == "record"]
        assert events, f"no event recorded after batch {i}'s copy (vlm/train/device_feed.py)"
        event = events[0]
        assert event.recorded_on is cuda.side, (
            f"batch {i}'s copy event recorded on {event.recorded_on}, not on the side stream the "
            "copy ran on: waiting for it would not wait for the copy (vlm/train/device_feed.py)"
        )
        waited = [s for kind, e, s in (x for x in cuda.log if x[0] == "wait") if e is event]
        assert waited == [cuda.step], (
            f"batch {i} was handed to the step after {waited or 'no'} wait for its copy's event "
            "on the step's stream: the CUDA feed does not wait for its copy "
            "(current_stream().wait_event; vlm/train/device_feed.py)"
        )
        on_step = {id(t) for t, s in marked if s is cuda.step}
        assert {id(batch.input_ids), id(batch.doc_ids)} <= on_step, (
            f"batch {i}'s tensors not marked as used on the step's stream (record_stream): the "
            "allocator may reuse their memory while the step reads them"
        )
        got.append(i)
    assert got == [0, 1, 2, 3]


# ======================================== 8. a corrupt later image drops the whole sample's patches
def _png(w: int, h: int, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, "PNG")
    return buf.getvalue()


def test_a_sample_whose_second_image_is_corrupt_leaves_none_of_its_patches(tmp_path):
    """A two-image sample whose second PNG is cut short (its header reads, its pixels do not) between
    two good one-image samples: the sample is dropped and counted, and the batch's pixels are the
    good samples' images only, row for row with their patch coordinates."""
    from data_pipelines.config import DataConfig, SourceConfig
    from data_pipelines.loader import build_loader
    from data_pipelines.schema import Sample
    from data_pipelines.tokenizer import ByteTokenizer
    from data_pipelines.writer import ShardWriter
    from vision.image_processor import ImageProcessor, ImageProcessorConfig

    tok = ByteTokenizer()
    proc_cfg = ImageProcessorConfig(patch_size=14, max_patches=16)
    good_a, good_b = _png(56, 56, (200, 10, 10)), _png(84, 56, (10, 200, 10))
    first, cut = _png(56, 84, (10, 10, 200)), _png(60, 60, (1, 2, 3))[:-30]
    with ShardWriter(tmp_path, "m", max_count=10) as w:
        w.write(Sample("a", "pair", text="<image> red", images=[good_a]))
        w.write(Sample("two", "interleaved", text="<image> blue <image> cut", images=[first, cut]))
        w.write(Sample("b", "pair", text="<image> green", images=[good_b]))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path), name="m")], row_tokens=512, rows_per_batch=1,
        shuffle_buffer=0, pack_buffer=8, epochs=1, processor=proc_cfg,
    )  # fmt: skip
    loader = build_loader(cfg, tok)
    batches = list(loader)
    assert loader.counters == {"corrupt_image": 1}, loader.counters
    proc = ImageProcessor(proc_cfg)
    want = torch.cat([torch.from_numpy(proc.pixels(d)[0]) for d in (good_a, good_b)])
    pixels = torch.cat([b.pixel_patches for b in batches if b.pixel_patches is not None])
    coords = torch.cat([b.patch_coords for b in batches if b.patch_coords is not None])
    grids = torch.cat([b.image_grids for b in batches if b.image_grids is not None])
    assert pixels.shape[0] == coords.shape[0] == int(grids.prod(1).sum()), (
        f"the batch ends with {pixels.shape[0]} pixel rows for {coords.shape[0]} patch "
        f"coordinates ({grids.tolist()} grids): the corrupt sample's earlier image left its "
        "patches behind (data_pipelines/materialise.py)"
    )
    assert torch.equal(pixels, want), "the batch's pixels are not the good samples' images"
    seen = Counter(grids.prod(1).tolist())
    assert sum(seen.values()) == 2, grids.tolist()
