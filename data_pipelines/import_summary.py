"""What an import ends with (data_pipelines.import_run): its summary's verdict (too many rows
skipped, nothing written) and the one-line errors it raises, and the report the CLI prints.
"""

from __future__ import annotations

import signal
from typing import Any

from data_pipelines.import_sources import ImporterError

MAX_EXAMPLES = 5
DEFAULT_MAX_SKIP_SHARE = 0.1


class ImportFailed(ImporterError):
    """An import that wrote nothing (or whose source broke part way); `summary` says what was read."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


class ImportInterrupted(ImportFailed):
    """Ctrl-C / SIGINT, SIGTERM or SIGHUP during an import: complete shards are kept; the same
    command resumes. `signum`: the signal (the CLI exits 128 + it)."""

    def __init__(self, message: str, summary: dict[str, Any], signum: int = signal.SIGINT):
        super().__init__(message, summary)
        self.signum = signum


class ImportWriteFailed(ImportFailed):
    """A write into OUT failed part way (a full disk): complete shards are kept; the same command resumes."""


def examples_line(examples: list[dict]) -> str:
    parts = []
    for e in examples:
        who = f"row {e['row']}" + (f" ({e['id']})" if e.get("id") else "")
        parts.append(f"{who}: {e['reason']}" + (f" ({e['detail']})" if e.get("detail") else ""))
    return "; ".join(parts)


def skip_counts(skipped: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))


def finalise(summary: dict[str, Any], max_skip_share: float) -> dict[str, Any]:
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
            f"skipped ({skip_counts(skipped)}); first: {examples_line(summary['examples'])}",
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
            f"%): {skip_counts(summary['skipped'])}; first: {examples_line(summary['examples'])}"
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
