"""`vlm serve` where vLLM is not installed (the project's own venv): one line naming
`make serve-venv`, no traceback; and the server arguments it builds (127.0.0.1 unless told, the
export's engine settings). Runs everywhere; the serving itself is tests/test_serve.py."""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

from vlm.serve.cli import NO_VLLM, add_serve_command, server_argv


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vlm")
    add_serve_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_without_vllm_is_one_line(exported_vlm, capsys):
    from vlm.cli import main

    assert main(["serve", str(exported_vlm)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == NO_VLLM and "make serve-venv" in err and "Traceback" not in err


def test_serve_refuses_a_directory_without_an_export(tmp_path, capsys):
    from vlm.cli import main

    assert main(["serve", str(tmp_path)]) == 2
    assert "no exported model there" in capsys.readouterr().err


def test_server_binds_localhost_with_the_exports_settings(exported_vlm):
    temp = set(Path(tempfile.gettempdir()).iterdir())
    argv = server_argv(_args(str(exported_vlm), "--port", "8123", "--concept-capacity", "64"))
    # nothing written for the server: a start leaves no folder behind (it execs vLLM: no exit hook)
    assert set(Path(tempfile.gettempdir()).iterdir()) == temp
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert value("--host") == "127.0.0.1" and value("--port") == "8123"
    assert value("--model") == str(exported_vlm) and value("--dtype") == "float32"
    overrides = json.loads(value("--hf-overrides"))
    assert overrides["concept_capacity"] == 64
    # the paged token layers' geometry (the tiny model's head of 8 padded to the CPU kernels' 32)
    assert overrides["head_dim"] == 32 and overrides["num_key_value_heads"] == 2
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    # the template itself (vLLM reads a value that names no file as the template): no temp file
    template = value("--chat-template")
    assert template.startswith("{{ bos_token }}")  # the project's prompts start with <bos>
    assert "<|assistant|>" in template
    argv = server_argv(_args(str(exported_vlm), "--host", "0.0.0.0"))
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_bad_port_is_refused_when_parsed(exported_vlm, capsys):
    with pytest.raises(SystemExit):
        _args(str(exported_vlm), "--port", "70000")
    assert "port number" in capsys.readouterr().err
