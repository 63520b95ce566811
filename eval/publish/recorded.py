"""Tables whose runs' outputs were not kept: their figures recorded once in a JSON file with a
`provenance` field (the command, the commit that published them, that the outputs were not kept),
rendered like every other.

    {"provenance": {"command": ..., "commit": ..., "outputs": ...},
     "decimals": 1, "columns": [...], "rows": [[cell, ...], ...]}

A cell is a string (written as it is), a number (at `decimals`) or a list of numbers (joined by
' / ')."""

from __future__ import annotations

from typing import Any

from eval.publish.markdown import cell, table

PROVENANCE_KEYS = ("command", "commit", "outputs")


def check_provenance(data: dict[str, Any], path: str) -> None:
    prov = data.get("provenance")
    if not isinstance(prov, dict) or any(not prov.get(k) for k in PROVENANCE_KEYS):
        keys = ", ".join(PROVENANCE_KEYS)
        raise ValueError(f"{path}: a recorded file needs provenance with {keys}")


def render(data: dict[str, Any]) -> str:
    """The table a recorded file holds."""
    cols, decimals = data["columns"], data.get("decimals")
    for row in data["rows"]:
        if len(row) != len(cols):
            raise ValueError(f"recorded row {row[0]!r}: {len(row)} cells for {len(cols)} columns")
    return table(cols, ([cell(v, decimals) for v in row] for row in data["rows"]))


def lookup(data: dict[str, Any], row_starts: str, column: str) -> Any:
    """The cell of the first row whose first cell starts with `row_starts`, in `column`."""
    j = data["columns"].index(column)
    for row in data["rows"]:
        if row[0].startswith(row_starts):
            return row[j]
    raise KeyError(f"no row starting {row_starts!r}")
