"""The registry of long-context tasks: name -> (generator, spec, metric, whether it has a depth)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from eval.longctx.aggregation import CWESpec, FWESpec, generate_cwe, generate_fwe
from eval.longctx.niah import NiahSpec, generate_niah
from eval.longctx.sample import Sample, Tokenizer
from eval.longctx.variable_tracking import VTSpec, generate_vt


@dataclass(frozen=True)
class TaskDef:
    generator: Callable[..., Sample]
    spec: Any
    metric: str  # "string_match_all" | "string_match_part"
    has_depth: bool


TASKS: dict[str, TaskDef] = {
    "niah_single_repeat": TaskDef(
        generate_niah, NiahSpec(haystack="repeat"), "string_match_all", True
    ),
    "niah_single_essay": TaskDef(
        generate_niah, NiahSpec(haystack="essay"), "string_match_all", True
    ),
    "niah_single_uuid": TaskDef(
        generate_niah, NiahSpec(haystack="essay", value_kind="uuids"), "string_match_all", True
    ),
    "niah_multikey": TaskDef(
        generate_niah, NiahSpec(haystack="essay", num_keys=4), "string_match_all", True
    ),
    "niah_multikey_repeat": TaskDef(
        generate_niah, NiahSpec(haystack="repeat", num_keys=4), "string_match_all", True
    ),
    "niah_multivalue": TaskDef(
        generate_niah, NiahSpec(haystack="essay", num_values=4), "string_match_all", True
    ),
    "niah_multiquery": TaskDef(
        generate_niah,
        NiahSpec(haystack="essay", num_keys=4, num_queries=4),
        "string_match_all",
        True,
    ),
    "vt": TaskDef(generate_vt, VTSpec(), "string_match_all", True),
    "cwe": TaskDef(generate_cwe, CWESpec(), "string_match_all", False),
    "fwe": TaskDef(generate_fwe, FWESpec(), "string_match_all", False),
}
DEFAULT_TASKS = [
    "niah_single_repeat",
    "niah_single_essay",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
]


def task_def(name: str) -> TaskDef:
    if name not in TASKS:
        raise ValueError(f"unknown long-context task {name!r}; allowed: {', '.join(TASKS)}")
    return TASKS[name]


def generate_sample(
    name: str,
    tokenizer: Tokenizer,
    target_length: int,
    depth: float | None = None,
    seed: int = 0,
    index: int = 0,
) -> Sample:
    """One sample of task `name`, `target_length` prompt tokens (±2 %), needle at `depth` percent."""
    td = task_def(name)
    if td.has_depth and depth is None:
        raise ValueError(f"task {name} places a needle: give a depth in [0, 100]")
    return td.generator(
        name,
        td.spec,
        tokenizer,
        target_length,
        None if not td.has_depth else float(depth),
        seed,
        index,
    )
