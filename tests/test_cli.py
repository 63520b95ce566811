"""The `vlm` command line: it starts without torch or transformers, says overrides one way
(`key=value` after the config; the old `--set` is a one-line error), and every entry point is a
`vlm` subcommand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from configs.config import parse_args_anywhere
from vlm.cli import build_parser, main

HEAVY = ("torch", "transformers", "huggingface_hub")


def modules_after(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter has imported once `vlm ARGV` (a help) has run."""
    code = (
        "import contextlib, io, json, sys\nfrom vlm.cli import main\nwith "
        f"contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({argv!r})\n    "
        "except SystemExit:\n        pass\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["data", "--help"],
        ["data", "import-table", "--help"],
        ["eval", "--help"],
        ["bench", "--help"],
    ],
)
def test_help_imports_neither_torch_nor_transformers(argv):
    """What makes `vlm --help` and `vlm data ...` start at once: every subcommand's registration
    builds argparse only (all of them run for any help), and `import vlm` registers no model."""
    loaded = modules_after(argv)
    # all registered
    assert "vlm.cli" in loaded and "data_pipelines.cli" in loaded and "eval.cli" in loaded
    assert not [m for m in HEAVY if m in loaded], (
        f"vlm {' '.join(argv)} imported {[m for m in HEAVY if m in loaded]}"
    )


def test_import_vlm_is_light_and_vlm_model_hf_registers_the_auto_classes():
    code = (
        "import sys\nimport vlm\nassert 'torch' not in sys.modules and 'transformers' not in "
        "sys.modules, 'import vlm is heavy'\nimport vlm.model.hf\nfrom transformers import "
        "AutoConfig\nprint(type(AutoConfig.for_model(vlm.model.hf.MODEL_TYPE)).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ConceptMoEConfig"


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["chain", "a.yaml", "--out", "x", "--set", "train.max_steps=2"], "vlm chain"),
        (["flops", "--config", "a.yaml", "--set=model.moe.top_k=4"], "vlm flops"),
        (
            ["eval", "longctx", "--ckpt", "c", "--out", "o", "--set", "num_samples=2"],
            "vlm eval longctx",
        ),
    ],
)
def test_the_old_set_option_is_a_one_line_error(argv, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{prog}: --set was removed; write overrides as KEY=VALUE after the config\n"


def parse(argv: list[str]):
    return parse_args_anywhere(build_parser(), argv)


def test_overrides_are_key_value_positionals_wherever_they_stand():
    from vlm.train.chain import split_configs

    args = parse(["chain", "a.yaml", "b.yaml", "train.max_steps=2", "--out", "x", "optim.lr=0.1"])
    assert split_configs(args.configs) == (["a.yaml", "b.yaml"], ["train.max_steps=2"])
    assert args.overrides == ["optim.lr=0.1"]

    from eval.cli import longctx_config_from_args

    args = parse(
        [
            "eval",
            "longctx",
            "--ckpt",
            "c",
            "num_samples=3",
            "--out",
            "o",
            "--seed",
            "5",
            "batch_size=2",
        ]
    )
    cfg = longctx_config_from_args(args)
    assert (cfg.num_samples, cfg.batch_size, cfg.seed) == (3, 2, 5)

    args = parse(["flops", "--config", "a.yaml", "model.moe.top_k=4", "--json"])
    assert args.overrides == ["model.moe.top_k=4"]


def test_a_chain_of_overrides_only_is_a_config_error(capsys):
    assert main(["chain", "train.max_steps=2", "--out", "x"]) == 2
    assert "at least one stage config" in capsys.readouterr().err


def test_every_entry_point_is_a_vlm_subcommand():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {
        "train",
        "chain",
        "data",
        "flops",
        "convert",
        "chat",
        "demo",
        "eval",
        "experiment",
        "scaling",
        "bench",
    } <= set(commands)
    assert {"longctx", "lmms-tasks", "vqa", "probe", "ppl", "ct-start"} <= set(
        next(a for a in commands["eval"]._actions if a.dest == "eval_command").choices
    )
    assert (
        "import-bench"
        in next(a for a in commands["data"]._actions if a.dest == "data_command").choices
    )
    # each command runs its module's function
    assert parse(["bench", "decode", "--quick"]).func.__module__ == "eval.bench.cli"
    args = parse(["eval", "ct-start", "SRC", "--ratio", "2"])
    assert (args.src, args.ratio, args.batches) == ("SRC", 2.0, 8)


def test_the_old_bench_module_form_is_the_same_command():
    out = subprocess.run(
        [sys.executable, "-m", "eval.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: vlm bench")


def test_data_help_states_the_importers_default_skip_share():
    from data_pipelines.cli import DEFAULT_MAX_SKIP_SHARE_TEXT
    from data_pipelines.import_summary import DEFAULT_MAX_SKIP_SHARE

    assert float(DEFAULT_MAX_SKIP_SHARE_TEXT) == DEFAULT_MAX_SKIP_SHARE
