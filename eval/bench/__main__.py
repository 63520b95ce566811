"""`python -m eval.bench ...` is `vlm bench ...` (eval/bench/cli.py)."""

from eval.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
