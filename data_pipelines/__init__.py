"""Data pipelines: webdataset shards (schema in SCHEMA.md), the embedded default dataset, importers,
tokenizers, chat template, and the packed loader with exact resume.

Entry points: `loader.build_loader`, `config.DataConfig`, `tokenizer.load_tokenizer`,
`default_dataset.ensure_default_dataset`, `chat.iter_vqa_samples`, `cli.add_data_commands`.
"""
