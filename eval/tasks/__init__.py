"""lmms-eval task templates for the embedded default dataset (instantiated by `eval.export_tasks`)."""
