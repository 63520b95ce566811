"""Offline RULER-style long-context harness: seeded task generators sized with the model's
tokenizer (`tasks.generate_sample`), a lengths x depths sweep scored like RULER plus a
log-likelihood ranking mode (`sweep.run_sweep` with `config.LongCtxConfig`), JSON summaries and
heat maps (`plot`). See eval/README.md."""
