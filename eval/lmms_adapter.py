"""lmms-eval model `conceptmoe`: wraps any `eval.protocol.EvalModel` (checked
against lmms-eval 0.7.3).

    lmms-eval eval --model conceptmoe --model_args pretrained=RUN/final --tasks conceptmoe_vqa \
        --include_path TASKS_DIR --output_path OUT

The CLI finds the class through the entry-point group `lmms_eval.models` (see
`eval/lmms_manifest.py`). Model args: `pretrained` (checkpoint dir, loaded with
`vlm.generate.load_eval_model`), `batch_size`, `chat` (auto|true|false: put contexts into the
project's chat template; auto wraps every context that does not already carry the template's role
tokens), `max_new_tokens` (when a task sets none), `stats_dir` / `stats_path` (where the compression
statistics go; see `CompressionLog`).

What lmms-eval 0.7.3 hands a model (read from its source):
- generate_until: `Instance.args == (context, gen_kwargs, doc_to_visual, doc_id, task,
  split)`; the document is `self.task_dict[task][split][doc_id]`; `doc_to_visual(doc)` returns
  a list of PIL images.
- loglikelihood: `(context, continuation, doc_to_visual, doc_id, task, split)` where `continuation`
  is the choice text (multiple choice) or the task's `doc_to_target` method (output_type
  loglikelihood); `acc_mutual_info` adds bare `(context, continuation)` pairs.
- Multiple choice predicts `argmin` of the returned values (built-in models return a loss), and the
  evaluator turns any plain tuple into its `str()` (`unwrap_generation_output`), so each result here
  is a `LoglikResult`: a real `(value, is_greedy)` tuple that also passes through that unwrapping
  intact. Values are the negative log-likelihood for choices (argmin = most likely) and the
  log-likelihood for `doc_to_target` continuations (the perplexity aggregation computes exp(-mean)).
  `acc_mutual_info` cannot be right under both conventions and is not supported.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from tqdm import tqdm

from data_pipelines.chat import ASSISTANT, END, USER, format_chat
from data_pipelines.schema import IMAGE_TOKEN
from eval.lmms_stats import CompressionLog
from eval.protocol import EvalModel

try:  # 0.7.x wraps generation outputs; older versions append results as they are
    from lmms_eval.api.instance import GenerationResult
except ImportError:  # pragma: no cover
    GenerationResult = object


class LoglikResult(tuple, GenerationResult):
    """`(value, is_greedy)` that survives lmms-eval 0.7's output unwrapping (which reads `.text`)."""

    token_counts = None

    def __new__(cls, value: float, greedy: bool):
        return tuple.__new__(cls, (float(value), bool(greedy)))

    # tuple holds the data; skip the dataclass init
    def __init__(self, value: float, greedy: bool) -> None:
        pass

    @property
    def text(self) -> tuple[float, bool]:
        return tuple(self)


def _as_bool_or_auto(value: Any) -> str:
    v = str(value).strip().lower()
    if v in ("auto", "true", "false"):
        return v
    if v in ("1", "yes"):
        return "true"
    if v in ("0", "no"):
        return "false"
    raise ValueError(f"conceptmoe model arg chat={value!r}: allowed auto, true, false")


def _images_of(visuals: Any, where: str) -> list:
    """doc_to_visual output -> flat list of RGB PIL images (nested lists flattened; None -> none)."""
    from PIL import Image

    out, stack = [], [visuals]
    while stack:
        v = stack.pop(0)
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            stack = list(v) + stack
        elif isinstance(v, Image.Image):
            out.append(v.convert("RGB"))
        else:
            raise ValueError(
                f"{where}: conceptmoe takes images only, doc_to_visual gave {type(v).__name__}"
            )
    return out


def _rank_and_world_size() -> tuple[int, int]:
    """This process's place among the evaluation processes (torch.distributed, else accelerate's /
    torchrun's environment): lmms-eval builds each rank's share of the requests from it, so each is
    answered once."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _longest_first(idx: list[int], lengths: list[int], batch_size: int) -> list[list[int]]:
    """Batches of request indices in decreasing prompt length (lmms-eval's Collator): rows of
    similar length pad little, and an out-of-memory error shows on the first batch."""
    from lmms_eval.utils import Collator

    order = Collator(list(zip(idx, lengths)), sort_fn=lambda item: -item[1])
    return [[i for i, _ in batch] for batch in order.get_batched(n=batch_size)]


class ConceptMoELMMS(lmms):
    is_simple = True

    def __init__(
        self,
        pretrained: str | None = None,
        batch_size: int | str = 1,
        chat: str = "auto",
        max_new_tokens: int | str = 128,
        stats_dir: str | None = None,
        stats_path: str | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise ValueError(
                f"conceptmoe: unknown model args {sorted(kwargs)}; allowed: "
                "pretrained, batch_size, chat, max_new_tokens, stats_dir, stats_path"
            )
        if pretrained is None:
            raise ValueError("conceptmoe: model arg pretrained=CHECKPOINT_DIR is required")
        if str(batch_size).startswith("auto"):
            raise ValueError("conceptmoe: batch_size=auto is not supported; give a number")
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"conceptmoe: batch_size must be >= 1, got {batch_size}")
        self.chat = _as_bool_or_auto(chat)
        self.max_new_tokens = int(max_new_tokens)
        self.pretrained = str(pretrained)
        self._rank, self._world_size = _rank_and_world_size()
        self.device = device
        self.model: EvalModel = self._load_model(self.pretrained)
        self.stats = CompressionLog(
            self.pretrained,
            stats_dir=stats_dir,
            stats_path=stats_path,
            rank=self._rank,
            world_size=self._world_size,
        )

    # ---- model loading (subclasses and tests override)
    # ------------------------------------------------
    def _load_model(self, pretrained: str) -> EvalModel:
        from vlm.generate import load_eval_model  # lazy: keeps lmms-eval's model listing cheap
        from vlm.model.weights_check import WeightsError

        try:
            return load_eval_model(pretrained)
        except WeightsError as e:
            # lmms-eval prints a traceback for any Exception; refused weights are one line
            raise SystemExit(f"conceptmoe: {e}") from None

    # ---- prompt layout
    # -----------------------------------------------------------------------------------
    def _format(self, context: str, n_images: int) -> tuple[str, bool]:
        """(prompt, whether the chat template was applied).

        Most lmms-eval tasks hand over a raw context: the question, with `<image>` placeholders
        where the task puts its images (or none: then the images go first, as in training). In
        `auto` mode such a context becomes the user turn of the chat template the model was trained
        on, followed by the generation prompt (LLaVA's and nanoVLM's adapters do the same); only a
        context that already carries the template's role tokens is passed through verbatim."""

        has_slots = IMAGE_TOKEN in context
        if has_slots and context.count(IMAGE_TOKEN) != n_images:
            raise ValueError(
                f"context has {context.count(IMAGE_TOKEN)} {IMAGE_TOKEN} "
                f"placeholders for {n_images} images: {context[:80]!r}"
            )
        body = (
            context if has_slots else IMAGE_TOKEN * n_images + ("\n" if n_images else "") + context
        )
        templated = USER in context or ASSISTANT in context
        if self.chat == "true" or (self.chat == "auto" and not templated):
            # the model's own chat format: ours, or a CT source's (test doubles without one
            # get ours)
            fmt = getattr(getattr(self.model, "tokenizer", None), "format_chat", format_chat)
            return fmt([{"role": "user", "content": body}], add_generation_prompt=True), True
        return body, False

    def _doc(self, task: str, split: str, doc_id: int) -> dict:
        return self.task_dict[task][split][doc_id]

    # ---- requests
    # ----------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            groups[(task, json.dumps(gen_kwargs, sort_keys=True, default=str))].append(i)
        bar = tqdm(
            total=len(requests), desc="conceptmoe generate", disable=True if self.rank else None
        )
        for task, keys in self._by_task(groups):
            self.model.reset_stats()
            for key in keys:
                idx = groups[key]
                gen_kwargs = dict(requests[idx[0]].args[1] or {})
                until = gen_kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                # lmms-eval's own models sample iff temperature > 0; an explicit
                # do_sample=false wins
                sample = (
                    float(gen_kwargs.get("temperature", 0) or 0) > 0
                    and gen_kwargs.get("do_sample") is not False
                )
                temperature = float(gen_kwargs.get("temperature", 0) or 0) if sample else 0.0
                top_p = float(gen_kwargs.get("top_p") or 1.0) if sample else 1.0
                max_new = int(gen_kwargs.get("max_new_tokens") or self.max_new_tokens)
                for batch in _longest_first(
                    idx, [len(requests[i].args[0]) for i in idx], self.batch_size
                ):
                    prompts, images, chatted = self._prepare([requests[i] for i in batch])
                    stop = until + ([END] if any(chatted) else [])
                    outs = self.model.generate(
                        prompts,
                        images if any(images) else None,
                        max_new_tokens=max_new,
                        temperature=temperature,
                        top_p=top_p,
                        stop=stop or None,
                    )
                    for i, text in zip(batch, outs):
                        results[i] = _cut(text, stop)
                    bar.update(len(batch))
            self.stats.record(
                task,
                "generate_until",
                sum(len(groups[k]) for k in keys),
                self.model.compression_stats(),
            )
        bar.close()
        self.stats.write()
        return results

    def loglikelihood(self, requests: list[Instance]) -> list[LoglikResult]:
        results: list[LoglikResult | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            task = req.args[4] if len(req.args) >= 6 else req.task_name
            groups[(task,)].append(i)
        bar = tqdm(
            total=len(requests),
            desc="conceptmoe loglikelihood",
            disable=True if self.rank else None,
        )
        for task, keys in self._by_task(groups):
            self.model.reset_stats()
            idx = [i for k in keys for i in groups[k]]
            lengths = [len(requests[i].args[0]) + len(str(requests[i].args[1])) for i in idx]
            for batch in _longest_first(idx, lengths, self.batch_size):
                contexts, conts, images, is_target = [], [], [], []
                for i in batch:
                    ctx, cont, imgs, target = self._loglik_request(requests[i])
                    contexts.append(ctx)
                    conts.append(cont)
                    images.append(imgs)
                    is_target.append(target)
                out = self.model.loglikelihood(contexts, conts, images if any(images) else None)
                for i, (logp, greedy), target in zip(batch, out, is_target):
                    results[i] = LoglikResult(logp if target else -logp, greedy)
                bar.update(len(batch))
            self.stats.record(task, "loglikelihood", len(idx), self.model.compression_stats())
        bar.close()
        self.stats.write()
        return results

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("conceptmoe does not implement multi-round generation")

    # ---- helpers
    # -----------------------------------------------------------------------------------------
    @staticmethod
    def _by_task(groups: dict[tuple, list[int]]) -> list[tuple[str, list[tuple]]]:
        tasks: dict[str, list[tuple]] = {}
        for key in groups:
            tasks.setdefault(key[0], []).append(key)
        return list(tasks.items())

    def _prepare(self, reqs: list[Instance]) -> tuple[list[str], list[list], list[bool]]:
        prompts, images, chatted = [], [], []
        for req in reqs:
            context, _, doc_to_visual, doc_id, task, split = req.args
            imgs = (
                _images_of(
                    doc_to_visual(self._doc(task, split, doc_id)), f"{task}/{split}/{doc_id}"
                )
                if doc_to_visual is not None
                else []
            )
            prompt, chat = self._format(context, len(imgs))
            prompts.append(prompt)
            images.append(imgs)
            chatted.append(chat)
        return prompts, images, chatted

    def _loglik_request(self, req: Instance) -> tuple[str, str, list, bool]:
        """(context, continuation, images, continuation came from doc_to_target)."""
        if len(req.args) == 2:  # acc_mutual_info's unconditional pair: no document, no image
            context, continuation = req.args
            return self._format(context, 0)[0], continuation, [], False
        context, continuation, doc_to_visual, doc_id, task, split = req.args[:6]
        doc = self._doc(task, split, doc_id)
        target = callable(continuation)
        if target:
            continuation = continuation(doc)
            if isinstance(continuation, list):
                continuation = continuation[0]
            continuation = str(continuation)
        imgs = (
            _images_of(doc_to_visual(doc), f"{task}/{split}/{doc_id}")
            if doc_to_visual is not None
            else []
        )
        return self._format(context, len(imgs))[0], continuation, imgs, target


def _cut(text: str, stops: list[str]) -> str:
    """Truncate at the first stop string: `until` holds even if the model ran past it."""
    hits = [j for j in (text.find(s) for s in stops if s) if j != -1]
    return text[: min(hits)] if hits else text
