"""Published numbers are generated, not typed: every table of measured figures in README.md
and docs/ is rendered from the JSON the bench, the recipes and the runs leave (`vlm
results`, `make results`).

- `regions`: the `<!-- results:NAME -->` ... `<!-- /results:NAME -->` markers a document holds its
  tables in.
- `registry`: every table: its document, the JSON it reads, the function that renders it.
- `bench`, `runs`, `recorded`: the renderers (bench JSON; a run's summary.json / vqa.json; figures
  recorded once with their provenance where the runs' outputs were not kept).
- `launches`: the one producer cheap enough to re-run here (operators per training step, seconds on
  a CPU).
"""
