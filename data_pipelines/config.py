"""Data configuration: sources and their mixture, packing budget, shuffling, workers, tokenizer, images."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from configs.config import ValidatedOnInit, check
from data_pipelines.default_dataset import PARTS
from data_pipelines.reader import ShardError, resolve_shards
from vision.image_processor import ImageProcessorConfig

DEFAULT_DIR = "data/default"


@dataclass
class SourceConfig(ValidatedOnInit):
    """One source of shards. `path`: a folder of shards, a glob, a brace pattern or one .tar
    file, or a URL webdataset understands (`pipe:CMD`,
    `http(s)://host/shard-{000..009}.tar`, `file:PATH`; SCHEMA.md)."""

    path: str
    weight: float = 1.0
    # not "auto": other kinds are skipped
    kind: Literal["auto", "pair", "interleaved", "text"] = "auto"
    name: str = ""
    # img2dataset shards without a .txt member: the field of their metadata JSON that holds
    # the caption
    caption_field: str = "caption"

    def validate(self) -> None:
        check(bool(self.path), "source path must not be empty")
        check(self.weight > 0, f"source {self.path}: weight must be > 0, got {self.weight}")

        try:  # a typo in a path stops here, before any model is built or run directory made
            resolve_shards(self.path)
        except ShardError as e:
            check(False, f"source {self.path}: {e}")

    @property
    def label(self) -> str:
        return self.name or self.path


@dataclass
class DataConfig(ValidatedOnInit):
    # empty: the embedded default dataset's train split (built into default_dir when missing)
    sources: list[SourceConfig] = field(default_factory=list)
    default_dir: str = DEFAULT_DIR
    split: str = "train"  # which split of the default dataset when `sources` is empty
    # which parts of the default dataset to mix (vqa, caption, interleaved, text); empty: all of
    # the split's
    default_parts: list[str] = field(default_factory=list)
    row_tokens: int = 512  # T: tokens per packed row (text + image tokens)
    rows_per_batch: int = 4  # B
    shuffle_buffer: int = 512  # samples per source held for shuffling (0: stream order)
    pack_buffer: int = 64  # tokenized samples the packer chooses from when filling a row
    seed: int = 0
    # DataLoader worker processes per rank that decode the rank's micro-batches (0: in the main
    # process); may change on resume: the data does not depend on it
    num_workers: int = 0
    # no longer read: the data is one global order of micro-batches whatever the number of ranks
    # (docs/data.md); accepted so that configs written before still load
    rank_split: Literal["samples", "rows"] = "samples"
    prefetch_factor: int = 2
    # micro-batches sent to the GPU ahead of the step that uses them (pinned memory, a side stream;
    # 0: each when it is used); the CPU has nothing to overlap and ignores it
    prefetch_to_device: int = 2
    # None: loop forever (training); N: stop after N passes over every source
    epochs: int | None = None
    # "byte"; "default": the BPE tokenizer built with the embedded default dataset
    # (default_dir/tokenizer); or a tokenizer directory / tokenizer.json
    tokenizer: str = "byte"
    # how images are patchified (validated when it is made); a training config with a vision section
    # sets it to vision.processor, so only configs without one state it here
    processor: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)
    # where the loader keeps the index of shards whose folder cannot be written (docs/data.md);
    # "": ~/.cache/vlm/loader-index ($XDG_CACHE_HOME/vlm/loader-index)
    index_cache: str = ""
    loss_on: Literal["all", "assistant"] = "all"  # "assistant": chat samples train on answers only
    long_text: Literal["truncate", "split"] = "truncate"  # text-only documents longer than a row

    @property
    def tokenizer_path(self) -> str:
        """What `load_tokenizer` takes: "byte", or the directory / file the `tokenizer` setting names."""
        return (
            str(Path(self.default_dir) / "tokenizer")
            if self.tokenizer == "default"
            else self.tokenizer
        )

    def validate(self) -> None:
        check(self.row_tokens >= 8, f"row_tokens must be >= 8, got {self.row_tokens}")
        check(self.rows_per_batch >= 1, f"rows_per_batch must be >= 1, got {self.rows_per_batch}")
        check(self.shuffle_buffer >= 0, f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        check(self.pack_buffer >= 1, f"pack_buffer must be >= 1, got {self.pack_buffer}")
        check(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}")
        check(
            self.prefetch_factor >= 1, f"prefetch_factor must be >= 1, got {self.prefetch_factor}"
        )
        check(
            self.prefetch_to_device >= 0,
            f"prefetch_to_device must be >= 0, got {self.prefetch_to_device}",
        )
        check(
            self.epochs is None or self.epochs >= 1,
            f"epochs must be >= 1 or null, got {self.epochs}",
        )
        check(bool(self.tokenizer), "tokenizer must be 'byte', 'default' or a path")
        # built with the default dataset: there only when that dataset is used or built
        if self.tokenizer == "default":
            check(
                not self.sources or Path(self.tokenizer_path).exists(),
                "tokenizer 'default' is the default dataset's tokenizer "
                f"({self.tokenizer_path}), which does not exist; with sources "
                "set, give a tokenizer directory or tokenizer.json, or 'byte'",
            )
        elif self.tokenizer != "byte":
            check(
                Path(self.tokenizer).exists(),
                f"tokenizer {self.tokenizer!r} does not exist; allowed: "
                "'byte', 'default' or a tokenizer directory / tokenizer.json",
            )
        for p in self.default_parts:
            check(p in PARTS, f"default_parts: unknown part {p!r}; allowed: {', '.join(PARTS)}")
        check(
            not (self.default_parts and self.sources),
            "default_parts selects parts of the default dataset; it cannot be combined with sources",
        )
        names = [s.label for s in self.sources]
        check(len(set(names)) == len(names), f"source names/paths must be unique, got {names}")
