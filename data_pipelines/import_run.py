"""Running an import: rows -> worker processes (decode and check) -> shards, resumable,
with a summary. Its parts: the state file (`import_state`), the shards (`import_shards`), the
summary and the errors it ends with (`import_summary`).

- **Workers.** Rows are cut into chunks and converted (`import_rows.convert_chunk`: images read,
  decoded and checked) in `workers` spawned processes; at most a few chunks per worker are in
  flight, so a 1 GB input is never held in memory, and results are written in row order (the output
  does not depend on `workers`).
- **Resumable and idempotent.** Shards are written into `OUT/.PREFIX.partial/` and moved into OUT
  when full; after each, `OUT/PREFIX.import.json` records the input's fingerprint (file names,
  sizes, modification times, the options), a digest of the size and modification time of every
  file the rows made it read (images, sidecar captions: `inputs`), the next row and the counts so
  far (the state before it is kept as `OUT/.PREFIX.import.prev.json`). The same command again
  resumes at the last full shard (a crash at 90 % redoes at most one shard); once complete it does
  nothing and reports the same summary, after checking that the files it read are unchanged.
  Another input, other options, or files changed since (a caption edited, an image replaced) into
  the same OUT/PREFIX are refused unless `overwrite`.
- **Damage.** A state file that no import wrote (cut short, not an object) is replaced by the one
  before it, with a warning; a shard the state lists that is gone makes the import start again
  from the start (with a warning) instead of reporting samples that are not there.
- **One writer.** The import holds OUT's lock (configs.folder_lock) while it runs: a second import
  into the same OUT is refused in one line naming the first.
- **Stopping.** SIGINT, SIGTERM and SIGHUP keep the complete shards and say in one line at which row
  the same command resumes (exit 128 + the signal); the worker processes end with the import
  however it ends (kill -9 included: `import_rows.init_worker`).
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
import signal
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable

from configs.folder_lock import FolderBusy, lock_folder
from data_pipelines.import_out import WriteFailed, check_out, os_reason, writing
from data_pipelines.import_rows import convert_chunk, init_worker
from data_pipelines.import_shards import ImportShards, remove_shards, shard_index
from data_pipelines.import_sources import ImporterError
from data_pipelines.import_state import (
    STATE_VERSION,
    fold_inputs,
    missing_shard,
    prev_state_path,
    read_state,
    save_state,
    state_path,
)
from data_pipelines.import_summary import (
    DEFAULT_MAX_SKIP_SHARE,
    MAX_EXAMPLES,
    ImportFailed,
    ImportInterrupted,
    ImportWriteFailed,
    finalise,
)
from data_pipelines.progress import Progress
from data_pipelines.schema import Sample

CHUNK_ROWS = 32


class _Stopped(KeyboardInterrupt):
    """SIGTERM / SIGHUP, raised where the import is, as Ctrl-C raises KeyboardInterrupt."""


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


def _on_signals(caught: dict):
    """SIGTERM / SIGHUP raise `_Stopped` where the import is (main thread only), as Ctrl-C does;
    what it replaced, to put back. A second signal while the import winds down is ignored: the
    winding down is short, and cutting it would leave the shard being moved half listed."""

    def handle(signum, frame) -> None:
        if caught:
            return
        caught["signum"] = signum
        raise _Stopped()

    if threading.current_thread() is not threading.main_thread():
        return {}
    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    return {sig: signal.signal(sig, handle) for sig in sigs}


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
    inputs: Callable[[Any], list] | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Convert `items` with `convert(index, item, settings)` (a module-level function: it
    runs in workers) and write the samples into shards in `out`; returns the summary (see
    the module docstring). `inputs(item)`: the files an item makes the import read, as
    `import_rows.file_stat`s (called in this process; their digest is the state's `inputs`).
    `warn(line)`: where warnings go (default: stderr)."""
    if not 0 <= max_skip_share <= 1:
        raise ImporterError(f"max skip share must be in [0, 1], got {max_skip_share}")
    if max_count < 1 or max_bytes < 1 or workers < 0:
        raise ImporterError(
            "--max-count and --max-bytes must be >= 1 and --workers "
            f">= 0, got {max_count}, {max_bytes}, {workers}"
        )
    if "." in prefix or "/" in prefix or not prefix:
        raise ImporterError(f"shard prefix {prefix!r} must be non-empty and hold no '.' or '/'")
    out = Path(out)
    check_out(out)
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        lock = lock_folder(out, f"vlm data {desc}", say=warn)  # makes OUT
    except FolderBusy as e:
        raise ImporterError(str(e)) from None
    except OSError as e:
        raise ImporterError(f"--out {out}: cannot create it ({os_reason(e)})") from None
    try:
        key = {
            "source": os.path.realpath(source) if os.path.exists(source) else source,
            "fingerprint": fingerprint,
            "prefix": prefix,
            "max_count": max_count,
            "max_bytes": max_bytes,
            **(extra or {}),
        }
        key = json.loads(json.dumps(key, default=str))
        job = _Job(items, convert, settings, out, source, fmt, key, prefix, unit, inputs, warn)
        done = job.resume_point(overwrite)
        if done is not None:
            return finalise(dict(done, already_imported=True), max_skip_share)
        return job.run(max_count, max_bytes, workers, progress, total, desc, max_skip_share)
    finally:
        lock.release()


def _forget(out: Path, prefix: str) -> None:
    """Drop an import's shards and state (--overwrite, or a start over)."""
    remove_shards(out, prefix, 0)
    state_path(out, prefix).unlink(missing_ok=True)
    prev_state_path(out, prefix).unlink(missing_ok=True)


class _Job:
    """One run of an import into OUT/PREFIX: where it starts (`resume_point`), then `run`."""

    def __init__(self, items, convert, settings, out, source, fmt, key, prefix, unit, inputs, warn):
        self.convert, self.settings, self.out, self.source = convert, settings, out, source
        self.fmt, self.key, self.prefix, self.unit = fmt, key, prefix, unit
        self.inputs, self.warn = inputs, warn
        self.it = enumerate(items)
        self.state: dict | None = None
        self.digest = ""

    def resume_point(self, overwrite: bool) -> dict | None:
        """Sets `self.state` (None: from the start) and positions the rows after what was
        imported; the earlier summary when a complete import of the same input is there."""
        out, prefix = self.out, self.prefix
        if overwrite:
            _forget(out, prefix)
            return None
        state = read_state(out, prefix, self.warn)
        if state is None:
            if any(shard_index(p.name, prefix) is not None for p in out.glob(f"{prefix}-*.tar")):
                raise ImporterError(
                    f"{out} already holds {prefix}-*.tar from shards not written by an import; "
                    "use --overwrite, or another --out or --prefix"
                )
            _forget(out, prefix)
            return None
        if state.get("version") != STATE_VERSION or state.get("key") != self.key:
            raise ImporterError(
                f"{out} already holds {prefix}-*.tar from an import of another input or with "
                "other options; use --overwrite, or another --out or --prefix"
            )
        lost = missing_shard(out, state["shards"])
        if lost is not None:
            self.warn(
                f"warning: {out / lost}, listed by the import state, is missing: importing "
                f"{self.source} again from the start"
            )
            _forget(out, prefix)
            return None
        complete = bool(state.get("complete"))
        upto = None if complete else state["next_row"]
        recorded = state.get("inputs")
        if isinstance(recorded, str) and (recorded or not complete):
            # the files the rows made the import read, unchanged since (a complete import: every
            # row; a resume: the rows imported so far)
            for _, item in islice(self.it, upto):
                self.digest = fold_inputs(self.digest, self.inputs(item) if self.inputs else [])
            if self.digest != recorded:
                when = "since the import" if complete else "since the import began"
                raise ImporterError(
                    f"{out} holds {prefix}-*.tar imported from {self.source}, but files it read "
                    f"changed {when} (the size or modification time of an image"
                    f"{' or caption' if self.unit == 'image' else ''}); --overwrite imports it "
                    "again"
                )
        elif not complete:
            for _ in islice(self.it, upto):  # rows before the last full shard were imported
                pass
        if complete:
            return state["summary"]
        self.state = state
        return None

    def run(self, max_count, max_bytes, workers, progress, total, desc, max_skip_share) -> dict:
        out, prefix, source, state = self.out, self.prefix, self.source, self.state
        start_row = int(state["next_row"]) if state else 0
        skipped: Counter = Counter(state["skipped"]) if state else Counter()
        examples: list[dict] = list(state["examples"]) if state else []
        written = int(state["written"]) if state else 0
        names: list[str] = list(state["shards"]) if state else []
        start_shard = int(state["next_shard"]) if state else 0
        remove_shards(out, prefix, start_shard)
        t0 = time.time()
        rows = start_row
        digest = [self.digest]
        summary: dict[str, Any] = {
            "status": "ok",
            "source": source,
            "format": self.fmt,
            "unit": self.unit,
            "out": str(out),
            "prefix": prefix,
        }
        sp = state_path(out, prefix)

        def snapshot(next_row: int, complete: bool = False) -> dict:
            # called when a shard is full, before the row that opens the next one is counted: the
            # counts then are those of the rows before `next_row`
            return {
                "version": STATE_VERSION,
                "key": self.key,
                "next_row": next_row,
                "next_shard": shards.index,
                "written": written,
                "skipped": dict(skipped),
                "examples": list(examples),
                "shards": names + shards.names,
                "inputs": digest[0],
                "complete": complete,
            }

        # the next shard of the last state saved: shards from it on are not recorded
        saved = [start_shard]

        def save(next_row: int) -> None:
            state = snapshot(next_row)
            with writing(sp):
                save_state(out, prefix, state)
            saved[0] = state["next_shard"]

        shards = ImportShards(out, prefix, max_count, max_bytes, start_shard, save)
        source_error = write_error = None
        interrupted = broken = False
        caught: dict = {}
        handlers = _on_signals(caught)
        pool = None
        try:
            # before any thread (the progress bar's) starts: workers are forked where that exists
            if workers > 0:
                pool = ProcessPoolExecutor(
                    workers,
                    mp_context=_mp_context(),
                    initializer=init_worker,
                    initargs=(self.convert, self.settings, os.getpid()),
                )
                # the workers start now (a fork pool starts all of them at its first task)
                pool.submit(int).result()
            bar = Progress(total, desc, progress, unit=self.unit)
            if start_row:
                bar.update(start_row)
            try:
                in_flight: deque = deque()
                exhausted = False
                while True:
                    while not exhausted and len(in_flight) < max(2, 3 * workers):
                        try:
                            chunk = list(islice(self.it, CHUNK_ROWS))
                        except ImporterError as e:  # the source broke part way: keep what came
                            source_error, chunk, exhausted = str(e), [], True
                        if not chunk:
                            exhausted = True
                            break
                        files = [self.inputs(item) if self.inputs else [] for _, item in chunk]
                        work = pool.submit(convert_chunk, chunk) if pool else chunk
                        in_flight.append((work, files))
                    if not in_flight:
                        break
                    head, files = in_flight.popleft()
                    done = (
                        head.result() if pool else convert_chunk(head, self.convert, self.settings)
                    )
                    for (i, res), read in zip(done, files):
                        rows = i + 1
                        bar.update()
                        if isinstance(res, Sample):
                            shards.write(res, i)
                            written += 1
                        else:
                            reason, detail, rid = res
                            skipped[reason] += 1
                            if len(examples) < MAX_EXAMPLES:
                                examples.append(
                                    {"row": i, "id": rid, "reason": reason, "detail": detail}
                                )
                        digest[0] = fold_inputs(digest[0], read)
                shards.finish(next_row=rows)
            finally:
                bar.close()
        except KeyboardInterrupt:
            interrupted = True
        except BrokenProcessPool:
            broken = True
        except WriteFailed as e:
            write_error = e
        finally:
            if pool is not None:
                if interrupted or broken:  # at once: a worker is not left finishing its chunk
                    _kill_workers(pool)
                pool.shutdown(wait=not (interrupted or broken), cancel_futures=True)
            shards.discard()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
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
            _failed_write(write_error, summary, out, prefix, saved[0], source)
        if interrupted or broken:
            state_now = _state_or_start(out, prefix)
            summary["status"] = "interrupted"
            signum = caught.get("signum", signal.SIGINT)
            what = (
                (
                    "interrupted"
                    if signum == signal.SIGINT
                    else f"stopped by {signal.Signals(signum).name}"
                )
                if interrupted
                else "stopped: a worker process died (out of memory?)"
            )
            message = (
                f"import of {source} {what} after {rows} rows; "
                f"{state_now['written']} samples in complete shards are kept; run "
                f"the same command again to resume at row {state_now['next_row']}"
            )
            if interrupted:
                raise ImportInterrupted(message, summary, signum)
            raise ImportFailed(message, summary)
        if source_error is None:
            final = snapshot(rows, complete=True)
            final["summary"] = {k: v for k, v in summary.items() if k not in ("already_imported",)}
            try:
                with writing(sp):
                    save_state(out, prefix, final)
            except WriteFailed as e:
                # every shard is in place: the same command finds them and writes this again
                _failed_write(e, summary, out, prefix, saved[0], source)
        else:
            summary["status"] = "source_error"
            summary["error"] = source_error
        return finalise(summary, max_skip_share)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's workers at once. A worker killed while sending a result leaves half a message
    in the result pipe; the pool's manager thread then waits for the rest forever, and so would
    the interpreter's exit, which joins that thread. Once the workers are dead this process holds
    the pipe's last write end: closing it ends that wait (the manager sees a broken pool)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(timeout=10)
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None and not any(proc.is_alive() for proc in procs):
        writer.close()


def _state_or_start(out: Path, prefix: str) -> dict:
    """The state the same command resumes from, for the line that says so."""
    try:
        state = read_state(out, prefix, lambda line: None)
    except ImporterError:
        state = None
    return state or {"next_row": 0, "written": 0}


def _failed_write(
    e: WriteFailed, summary: dict, out: Path, prefix: str, saved_shard: int, source: str
) -> None:
    """A write failed (the partial shard is already dropped): drop the full shards no state records
    (best effort: the same command drops them too) and raise ImportWriteFailed, saying where the
    same command resumes."""
    try:
        remove_shards(out, prefix, saved_shard)
    except OSError:
        pass
    state = _state_or_start(out, prefix)
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
