"""The one interface every evaluator in `eval/` talks to.

The real implementation (`vlm.generate.load_eval_model(ckpt_dir)`) and the test doubles in
`eval/testing.py` both satisfy it structurally; nothing here imports the model, so the harnesses
stay testable without a checkpoint.

Prompts carry one `<image>` placeholder per image, in order; `images[i]` lists the PIL images of
prompt `i` (or `images` is None for text-only batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from data_pipelines.schema import IMAGE_TOKEN

if TYPE_CHECKING:  # PIL is only needed for the annotation
    from PIL.Image import Image


@runtime_checkable
class EvalTokenizer(Protocol):
    vocab_size: int
    eos_id: int
    image_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...


@runtime_checkable
class EvalModel(Protocol):
    tokenizer: object  # an EvalTokenizer

    def generate(
        self,
        prompts: list[str],
        images: list[list["Image"]] | None = None,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
    ) -> list[str]: ...

    def loglikelihood(
        self,
        contexts: list[str],
        continuations: list[str],
        images: list[list["Image"]] | None = None,
    ) -> list[tuple[float, bool]]:
        """(sum of log p over the continuation's tokens, whether greedy decoding would produce it)."""
        ...

    def compression_stats(self) -> dict[str, float]:
        """Per-modality realized compression (tokens / concepts) of the calls since the last reset."""
        ...

    def reset_stats(self) -> None: ...


def count_placeholders(prompt: str) -> int:
    return prompt.count(IMAGE_TOKEN)
