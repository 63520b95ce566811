"""Running an import: rows -> worker processes (decode and check) -> shards, resumable,
with a summary.

- **Workers.** Rows are cut into chunks and converted (`import_rows.convert_chunk`: images read,
  decoded and checked) in `workers` spawned processes; at most a few chunks per worker are in
  flight, so a 1 GB input is never held in memory, and results are written in row order (the output
  does not depend on `workers`).
- **Resumable and idempotent.** Shards are written into `OUT/.PREFIX.partial/` and moved into OUT
  when full; after each, `OUT/PREFIX.import.json` records the input's fingerprint (file names,
  sizes, modification times, the options), the next row and the counts so far. The same command
  again resumes at the last full shard (a crash at 90 % redoes at most one shard); once complete it
  does nothing and reports the same summary. Another input or other options into the same OUT/PREFIX
  is refused unless `overwrite`.
- **Failing loudly.** Nothing written (no rows, or all skipped) raises `ImportFailed` whose one-line
  message names the first skipped rows and their reasons; skipping more than `max_skip_share` of the
  rows sets the summary's status to `too_many_skipped` (the CLI exits 1). A source that breaks part
  way (a JSON array cut short) keeps what was written and fails.
- **Failing writes.** OUT is checked before any work (`check_out`: a file in the way, a read-only
  folder). A write that fails later (a full disk) drops the shard being written and its temporary
  files and raises `ImportWriteFailed` naming the file; once there is room the same command resumes
  at the last full shard.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable

from data_pipelines.import_out import WriteFailed, check_out, os_reason, writing
from data_pipelines.import_rows import convert_chunk, init_worker
from data_pipelines.import_sources import ImporterError
from data_pipelines.progress import Progress
from data_pipelines.schema import Sample
from data_pipelines.writer import ShardWriter, read_manifest, update_manifest, write_atomic

STATE_VERSION = 1
MAX_EXAMPLES = 5
DEFAULT_MAX_SKIP_SHARE = 0.1
CHUNK_ROWS = 32


class ImportFailed(ImporterError):
    """An import that wrote nothing (or whose source broke part way); `summary` says what was read."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


class ImportInterrupted(ImportFailed):
    """Ctrl-C / SIGINT during an import: complete shards are kept; the same command resumes."""


class ImportWriteFailed(ImportFailed):
    """A write into OUT failed part way (a full disk): complete shards are kept; the same command resumes."""


def default_workers() -> int:
    return max(
        1,
        min(
            8,
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1,
        ),
    )


def _mp_context():
    """fork where the platform has it (as torch's DataLoader): a spawned worker would re-import the
    program's main module (the `vlm` CLI and everything it loads) before converting a row."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def state_path(out: Path, prefix: str) -> Path:
    return out / f"{prefix}.import.json"


def _shard_index(name: str, prefix: str) -> int | None:
    stem = (
        name[len(prefix) + 1 : -len(".tar")]
        if name.startswith(prefix + "-") and name.endswith(".tar")
        else ""
    )
    return int(stem) if stem.isdigit() else None


def _remove_shards(out: Path, prefix: str, first: int) -> None:
    """Delete PREFIX-NNNNNN.tar with NNNNNN >= first and their manifest entries."""
    gone = set()
    for p in out.glob(f"{prefix}-*.tar"):
        i = _shard_index(p.name, prefix)
        if i is not None and i >= first:
            p.unlink()
            gone.add(p.name)
    m = read_manifest(out)
    if m is None:
        return
    drop = {
        e.get("name")
        for e in m["shards"]
        if e.get("name") in gone
        or ((i := _shard_index(str(e.get("name")), prefix)) is not None and i >= first)
    }
    if drop:
        update_manifest(out, [], drop=drop)


class _Shards:
    """Shards of one import: full ones moved from the partial folder into OUT, each followed by a state save."""

    def __init__(
        self, out: Path, prefix: str, max_count: int, max_bytes: int, start: int, save: Callable
    ):
        self.out, self.prefix, self.max_count, self.max_bytes = out, prefix, max_count, max_bytes
        self.tmp = out / f".{prefix}.partial"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.index, self.save = start, save
        self.writer: ShardWriter | None = None
        self.count = self.bytes = 0
        self.names: list[str] = []

    def _path(self) -> Path:
        return self.tmp / f"{self.prefix}-{self.index:06d}.tar"

    def write(self, sample: Sample, row: int) -> None:
        if self.writer is not None and (
            self.count >= self.max_count or self.bytes >= self.max_bytes
        ):
            self.finish(next_row=row)
        with writing(self._path()):
            if self.writer is None:
                self.tmp.mkdir(parents=True, exist_ok=True)
                self.writer = ShardWriter(
                    self.tmp,
                    self.prefix,
                    max_count=sys.maxsize,
                    max_bytes=sys.maxsize,
                    start_index=self.index,
                )
                self.count = self.bytes = 0
            self.writer.write(sample)
        self.count += 1
        self.bytes += sum(len(d) for d in sample.images) + len(
            sample.all_text().encode("utf-8", "replace")
        )

    def finish(self, next_row: int) -> None:
        if self.writer is not None:
            with writing(self._path()):
                self.writer.close()
            entry = self.writer.entries[0]
            with writing(self.out / entry["name"]):
                os.replace(self.tmp / entry["name"], self.out / entry["name"])
            with writing(self.out / "manifest.json"):
                update_manifest(self.out, [entry])
            self.names.append(entry["name"])
            self.writer = None
            self.index += 1
        self.save(next_row)

    def discard(self) -> None:
        """Drop the shard being written (after an interruption): the same command rewrites it."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def _examples_line(examples: list[dict]) -> str:
    parts = []
    for e in examples:
        who = f"row {e['row']}" + (f" ({e['id']})" if e.get("id") else "")
        parts.append(f"{who}: {e['reason']}" + (f" ({e['detail']})" if e.get("detail") else ""))
    return "; ".join(parts)


def _counts(skipped: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))


def run_import(
    items: Iterable[Any],
    convert: Callable,
    settings: Any,
    *,
    out: str | os.PathLike,
    source: str,
    fmt: str,
    fingerprint: Any,
    prefix: str = "shard",
    max_count: int = 10_000,
    max_bytes: int = 1 << 30,
    workers: int = 0,
    progress: bool = False,
    total: int | None = None,
    unit: str = "row",
    desc: str = "import",
    max_skip_share: float = DEFAULT_MAX_SKIP_SHARE,
    overwrite: bool = False,
    extra: dict | None = None,
) -> dict[str, Any]:
    """Convert `items` with `convert(index, item, settings)` (a module-level function: it
    runs in workers) and write the samples into shards in `out`; returns the summary (see
    the module docstring)."""
    if not 0 <= max_skip_share <= 1:
        raise ImporterError(f"max skip share must be in [0, 1], got {max_skip_share}")
    if max_count < 1 or max_bytes < 1 or workers < 0:
        raise ImporterError(
            "--max-count and --max-bytes must be >= 1 and --workers "
            f">= 0, got {max_count}, {max_bytes}, {workers}"
        )
    out = Path(out)
    check_out(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ImporterError(f"--out {out}: cannot create it ({os_reason(e)})") from None
    if "." in prefix or "/" in prefix or not prefix:
        raise ImporterError(f"shard prefix {prefix!r} must be non-empty and hold no '.' or '/'")
    sp = state_path(out, prefix)
    key = {
        "source": os.path.realpath(source) if os.path.exists(source) else source,
        "fingerprint": fingerprint,
        "prefix": prefix,
        "max_count": max_count,
        "max_bytes": max_bytes,
        **(extra or {}),
    }
    key = json.loads(json.dumps(key, default=str))
    state = None
    if sp.is_file():
        try:
            state = json.loads(sp.read_text())
        except ValueError:
            state = None
    same = (
        isinstance(state, dict)
        and state.get("version") == STATE_VERSION
        and state.get("key") == key
    )
    if same and not overwrite and state.get("complete"):
        return _finalise(dict(state["summary"], already_imported=True), max_skip_share)
    if not same or overwrite:
        theirs = state is not None or any(
            _shard_index(p.name, prefix) is not None for p in out.glob(f"{prefix}-*.tar")
        )
        if theirs and not overwrite:
            what = (
                "an import of another input or with other options"
                if state
                else "shards not written by an import"
            )
            raise ImporterError(
                f"{out} already holds {prefix}-*.tar from {what}; "
                "use --overwrite, or another --out or --prefix"
            )
        _remove_shards(out, prefix, 0)
        sp.unlink(missing_ok=True)
        state = None
    start_row = int(state["next_row"]) if state else 0
    skipped: Counter = Counter(state["skipped"]) if state else Counter()
    examples: list[dict] = list(state["examples"]) if state else []
    written = int(state["written"]) if state else 0
    names: list[str] = list(state["shards"]) if state else []
    start_shard = int(state["next_shard"]) if state else 0
    _remove_shards(out, prefix, start_shard)
    t0 = time.time()
    rows = start_row
    summary: dict[str, Any] = {
        "status": "ok",
        "source": source,
        "format": fmt,
        "unit": unit,
        "out": str(out),
        "prefix": prefix,
    }

    def snapshot(next_row: int, complete: bool = False) -> dict:
        # called when a shard is full, before the row that opens the next one is counted: the counts
        # then are those of the rows before `next_row`
        return {
            "version": STATE_VERSION,
            "key": key,
            "next_row": next_row,
            "next_shard": shards.index,
            "written": written,
            "skipped": dict(skipped),
            "examples": list(examples),
            "shards": names + shards.names,
            "complete": complete,
        }

    # the next shard of the last state saved: shards from it on are not recorded
    saved = [start_shard]

    def save(next_row: int) -> None:
        state = snapshot(next_row)
        with writing(sp):
            write_atomic(sp, json.dumps(state))
        saved[0] = state["next_shard"]

    shards = _Shards(out, prefix, max_count, max_bytes, start_shard, save)
    source_error = write_error = None
    interrupted = broken = False
    pool = None
    # before any thread (the progress bar's) starts: workers are forked where that exists
    if workers > 0:
        pool = ProcessPoolExecutor(
            workers, mp_context=_mp_context(), initializer=init_worker, initargs=(convert, settings)
        )
        # the workers start now (a fork pool starts all of them at its first task)
        pool.submit(int).result()
    bar = Progress(total, desc, progress, unit=unit)
    if start_row:
        bar.update(start_row)
    try:
        it = enumerate(items)
        for _ in islice(it, start_row):  # resume: rows before the last full shard were imported
            pass
        in_flight: deque = deque()
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < max(2, 3 * workers):
                try:
                    chunk = list(islice(it, CHUNK_ROWS))
                except ImporterError as e:  # the source broke part way: keep what came before
                    source_error, chunk, exhausted = str(e), [], True
                if not chunk:
                    exhausted = True
                    break
                in_flight.append(pool.submit(convert_chunk, chunk) if pool else chunk)
            if not in_flight:
                break
            head = in_flight.popleft()
            for i, res in head.result() if pool else convert_chunk(head, convert, settings):
                rows = i + 1
                bar.update()
                if isinstance(res, Sample):
                    shards.write(res, i)
                    written += 1
                else:
                    reason, detail, rid = res
                    skipped[reason] += 1
                    if len(examples) < MAX_EXAMPLES:
                        examples.append({"row": i, "id": rid, "reason": reason, "detail": detail})
        shards.finish(next_row=rows)
    except KeyboardInterrupt:
        interrupted = True
    except BrokenProcessPool:
        broken = True
    except WriteFailed as e:
        write_error = e
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=not (interrupted or broken), cancel_futures=True)
    shards.discard()
    summary.update(
        {
            "rows": rows,
            "written": written,
            "skipped": dict(sorted(skipped.items())),
            "examples": examples,
            "shards": [str(out / n) for n in names + shards.names],
            "resumed_at_row": start_row or None,
            "workers": workers,
            "seconds": round(time.time() - t0, 3),
            "rows_per_s": round((rows - start_row) / max(time.time() - t0, 1e-9), 1),
        }
    )
    if write_error is not None:
        _failed_write(write_error, summary, out, prefix, saved[0], sp, source)
    if interrupted or broken:
        state_now = json.loads(sp.read_text()) if sp.is_file() else {"next_row": 0, "written": 0}
        summary["status"] = "interrupted"
        what = "interrupted" if interrupted else "stopped: a worker process died (out of memory?)"
        raise (ImportInterrupted if interrupted else ImportFailed)(
            f"import of {source} {what} after {rows} rows; "
            f"{state_now['written']} samples in complete shards are kept; run "
            f"the same command again to resume at row {state_now['next_row']}",
            summary,
        )
    if source_error is None:
        done = snapshot(rows, complete=True)
        done["summary"] = {k: v for k, v in summary.items() if k not in ("already_imported",)}
        try:
            with writing(sp):
                write_atomic(sp, json.dumps(done))
        except WriteFailed as e:
            # every shard is in place: the same command finds them and writes this again
            _failed_write(e, summary, out, prefix, saved[0], sp, source)
    else:
        summary["status"] = "source_error"
        summary["error"] = source_error
    return _finalise(summary, max_skip_share)


def _failed_write(
    e: WriteFailed, summary: dict, out: Path, prefix: str, saved_shard: int, sp: Path, source: str
) -> None:
    """A write failed (the partial shard is already dropped): drop the full shards no state records
    (best effort: the same command drops them too) and raise ImportWriteFailed, saying where the
    same command resumes."""
    try:
        _remove_shards(out, prefix, saved_shard)
    except OSError:
        pass
    state = json.loads(sp.read_text()) if sp.is_file() else {"next_row": 0, "written": 0}
    summary.update(
        status="write_error",
        shards=[str(out / n) for n in state.get("shards", [])],
        error=f"cannot write {e.path}: {os_reason(e.error)}",
    )
    raise ImportWriteFailed(
        f"import of {source} stopped: cannot write {e.path}: {os_reason(e.error)}; "
        f"{state['written']} samples in complete shards are kept; with room (or write "
        f"access) again, run the same command to resume at row {state['next_row']}",
        summary,
    )


def _finalise(summary: dict[str, Any], max_skip_share: float) -> dict[str, Any]:
    rows, written, skipped = summary["rows"], summary["written"], summary["skipped"]
    share = (rows - written) / rows if rows else 0.0
    summary["skip_share"] = round(share, 6)
    summary["max_skip_share"] = max_skip_share
    src = summary["source"]
    if summary.get("error"):
        kept = f"; {written} samples written before it are kept" if written else ""
        raise ImportFailed(f"{summary['error']}{kept}", summary)
    if rows == 0:
        summary["status"] = "nothing_written"
        raise ImportFailed(
            f"nothing imported: {src} holds no {summary.get('unit', 'row')}s", summary
        )
    if written == 0:
        summary["status"] = "nothing_written"
        raise ImportFailed(
            f"nothing imported from {src}: all {rows} {summary.get('unit', 'row')}s "
            f"skipped ({_counts(skipped)}); first: {_examples_line(summary['examples'])}",
            summary,
        )
    summary["status"] = "too_many_skipped" if share > max_skip_share else "ok"
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The human-readable report of an import."""
    lines = []
    if summary.get("already_imported"):
        lines.append(
            f"already imported into {summary['out']} (same input and options): nothing to do"
        )
    elif summary.get("resumed_at_row"):
        lines.append(f"resumed at row {summary['resumed_at_row']}")
    lines.append(
        f"wrote {summary['written']} samples into {len(summary['shards'])} shard(s) from "
        f"{summary['rows']} rows ({summary['format']}, {summary.get('rows_per_s', 0):.0f} rows/s)"
    )
    if summary["skipped"]:
        lines.append(
            f"skipped {summary['rows'] - summary['written']} ({100 * summary['skip_share']:.1f} "
            f"%): {_counts(summary['skipped'])}; first: {_examples_line(summary['examples'])}"
        )
    if summary.get("columns"):
        lines.append(
            "columns: " + ", ".join(f"{k}={v}" for k, v in summary["columns"].items() if v)
        )
    if summary["status"] == "too_many_skipped":
        lines.append(
            f"warning: {100 * summary['skip_share']:.1f} % of the rows were skipped, more "
            f"than the allowed {100 * summary['max_skip_share']:.1f} % (--max-skip-share)"
        )
    return lines
