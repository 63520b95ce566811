"""The benchmark suite: `vlm bench [model|decode|moe|loader|attention|vision|realized|gpu|all]
[--quick] [--out DIR]`.

`cli.py` is the command; `common.py` holds the one measurement method (warm-up, interleaved rounds,
median and spread, ratio of medians to the baseline) and the output helpers; every other module (or
package: `gpu/`) is one part, with a `Settings` dataclass, its `SETTINGS` per mode (full, quick,
smoke), `run(settings) -> result` and `plot(result, path)`.
"""
