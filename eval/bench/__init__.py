"""The benchmark suite: `python -m eval.bench [model|decode|moe|loader|attention|vision|all] [--quick] [--out DIR]`.

`common.py` holds the one measurement method (warm-up, interleaved rounds, median and spread, ratio of medians
to the baseline) and the output helpers; every other module is one part, with a `Settings` dataclass, its
`SETTINGS` per mode (full, quick, smoke), `run(settings) -> result` and `plot(result, path)`.
"""
