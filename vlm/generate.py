"""Batched generation and scoring for prompts with images: the model behind every evaluator and the
chat demo.

Legend: B rows, T tokens, V vocabulary.

`ConceptMoEChat` satisfies `eval.protocol.EvalModel`. There is one decode loop: transformers'
`generate` on the model's wrapper (vlm/model/hf.py), which prefills the concept-level caches once
and then runs one cached step per token, batched over prompts of different lengths and image counts
(left-padded rows). Scoring (`loglikelihood`) encodes each distinct context once and teacher-forces
the candidates through cached steps. No path computes the logits of a position it does not read:
the prefill those of each prompt's last token, a full forward those of the scored positions.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from configs.batch import IGNORE_INDEX, TEXT, PackedBatch
from data_pipelines.config import DataConfig, SourceConfig
from data_pipelines.loader import build_loader
from data_pipelines.packing import make_prompt_batch
from data_pipelines.tokenizer import load_tokenizer
from vlm.model.context import ForwardContext
from vlm.model.doc_stats import document_ratios, summarize_documents
from vlm.model.hf import ConceptMoEForCausalLM, hf_config_for, load_vlm
from vlm.model.multimodal import ConceptMoEVLM
from vlm.model.stats import summarize

# a forward whose logits are read at a few positions (or not at all) computes none for the others
NO_LOGITS = ForwardContext(logits=False)


def _png(img) -> bytes:
    if isinstance(img, (bytes, bytearray)):
        return bytes(img)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _left_padded(batch: PackedBatch, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt rows -> (input_ids, attention_mask) left-padded, as transformers' generate wants."""
    real_BT = batch.doc_ids >= 0
    T = real_BT.shape[1]
    shift_B = T - real_BT.sum(1)
    src_BT = (torch.arange(T, device=real_BT.device)[None] - shift_B[:, None]) % T
    ids_BT = torch.where(real_BT, batch.input_ids, pad_id).gather(1, src_BT)
    return ids_BT, real_BT.gather(1, src_BT).long()


class _RowStreamer(BaseStreamer):
    """transformers' streamer protocol for a batch: collects each live row's new tokens and hands
    the rows to `on_tokens` after every step (generate puts the prompt first, then one token per row
    per step)."""

    def __init__(self, B: int, eos_id: int, done_B: torch.Tensor, on_tokens):
        self.rows: list[list[int]] = [[] for _ in range(B)]
        self.eos_id, self.done_B, self.on_tokens, self.prompt_seen = (
            eos_id,
            done_B,
            on_tokens,
            False,
        )

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for i, t in enumerate(value.reshape(-1).tolist()):
            if not self.done_B[i]:
                self.rows[i].append(t)
                self.done_B[i] = t == self.eos_id
        if self.on_tokens is not None:
            self.on_tokens([list(r) for r in self.rows])

    def end(self) -> None:
        pass


class _StopStrings(StoppingCriteria):
    """Ends a row once its new text holds one of `stops` (decoded with special tokens, so that `<|end|>` counts)."""

    def __init__(self, stops: list[str], prompt_len: int, tok, done_B: torch.Tensor):
        self.stops, self.prompt_len, self.tok, self.done_B = stops, prompt_len, tok, done_B
        self.window = max(len(s) for s in stops) + 1  # every token decodes to >= 1 character

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        hit_B = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for i in range(input_ids.shape[0]):
            new = input_ids[i, self.prompt_len :][-self.window :].tolist()
            hit_B[i] = any(s in self.tok.decode(new, skip_special=False) for s in self.stops)
        self.done_B |= hit_B.cpu()
        return hit_B


def _extend(batch: PackedBatch, extra: int, pad_id: int) -> PackedBatch:
    """Room for `extra` more tokens per row (as padding)."""
    B = batch.input_ids.shape[0]
    pad = lambda t, v: torch.cat([t, t.new_full((B, extra), v)], 1)  # noqa: E731
    return PackedBatch(
        pad(batch.input_ids, pad_id),
        pad(batch.labels, IGNORE_INDEX),
        pad(batch.doc_ids, -1),
        pad(batch.position_ids, 0),
        pad(batch.modality, TEXT),
        batch.pixel_patches,
        batch.patch_coords,
        batch.image_grids,
    )


def _put(batch: PackedBatch, rows: torch.Tensor, cols: torch.Tensor, tokens: torch.Tensor) -> None:
    """Append tokens at (rows, cols): they join their row's document (doc 0) as text."""
    batch.input_ids[rows, cols] = tokens
    batch.doc_ids[rows, cols] = 0
    batch.position_ids[rows, cols] = cols
    batch.modality[rows, cols] = TEXT


class ConceptMoEChat:
    """An exported or in-memory model with its tokenizer and image processor."""

    def __init__(
        self, model: ConceptMoEVLM, tokenizer, processor=None, device: str | torch.device = "cpu"
    ):
        self.model = model.eval().to(device)
        self.hf = ConceptMoEForCausalLM(
            hf_config_for(model, getattr(tokenizer, "image_pad_id", -1)), vlm=self.model
        )
        self.tokenizer = tokenizer
        if processor is None and model.vision_cfg is not None:
            processor = model.vision_cfg.build_processor()
        self.processor = processor
        self.device = torch.device(device)
        self.reset_stats()

    # ------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        self._counts = {
            "tokens/text": 0.0,
            "boundaries/text": 0.0,
            "tokens/image": 0.0,
            "boundaries/image": 0.0,
        }
        self._prompt_docs: list[dict] = []

    def prompt_documents(self) -> list[dict]:
        """Each prompt's realized compression at prefill since `reset_stats`
        (`doc_stats.document_ratios`; one document per prompt, kind "chat"): what decides the speed
        a user gets."""
        return list(self._prompt_docs)

    def _record(self, stats: dict) -> None:
        for k in self._counts:
            self._counts[k] += stats.get(k, 0.0)

    def compression_stats(self) -> dict[str, float]:
        c = self._counts
        out = {}
        for m in ("text", "image"):
            if c[f"boundaries/{m}"]:
                out[f"compression/{m}"] = c[f"tokens/{m}"] / c[f"boundaries/{m}"]
            out[f"tokens/{m}"] = c[f"tokens/{m}"]
        total_b = c["boundaries/text"] + c["boundaries/image"]
        if total_b:
            out["compression/ratio"] = (c["tokens/text"] + c["tokens/image"]) / total_b
        return out

    @torch.no_grad()
    def held_out_compression(
        self, shards: list[str], row_tokens: int = 1024, max_batches: int | None = None
    ) -> dict:
        """Realized compression (eval mode: p >= 0.5) of whole samples of `shards` (teacher forced,
        packed as in training), per document: `doc_stats.summarize_documents` ({"all" | kind:
        {modality: {p10, p50, p90, aggregate, docs, no_concept}}}), the like-for-like counterpart of
        the training ratios."""

        if self.processor is None:
            raise ValueError("held-out compression needs a model with a vision tower")
        cfg = DataConfig(
            sources=[SourceConfig(path=str(p), name=f"s{i}") for i, p in enumerate(shards)],
            row_tokens=row_tokens,
            rows_per_batch=4,
            epochs=1,
            shuffle_buffer=0,
            processor=self.processor.cfg,
        )
        docs: list[dict] = []
        for i, batch in enumerate(build_loader(cfg, self.tokenizer)):
            if max_batches is not None and i >= max_batches:
                break
            batch = batch.to(self.device)
            out = self.model(batch, context=NO_LOGITS)
            b_BT = out.chunks.b_BT if out.chunks is not None else batch.doc_ids >= 0
            docs += document_ratios(b_BT, batch.doc_ids, batch.modality, batch.kind)
        return summarize_documents(docs)

    # ------------------------------------------------------------ batching
    def prompt_batch(self, prompts: list[str], images=None) -> PackedBatch:
        images = images or [[] for _ in prompts]
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
        pairs = [(p, [_png(im) for im in ims]) for p, ims in zip(prompts, images)]
        return make_prompt_batch(pairs, self.tokenizer, self.processor).to(self.device)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        images=None,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        use_cache: bool = True,
        on_tokens=None,
    ) -> list[str]:
        """Continuations of a batch of prompts (ragged lengths and image counts), decoded by
        transformers' `generate` on the model's wrapper: left-padded rows, greedy at temperature 0,
        else nucleus sampling (torch's RNG seeded with `seed`, the caller's RNG state left alone).
        `use_cache`: prefill the concept-level caches once, then one cached step per token; False
        re-runs the whole prefix every step (the reference the cache is tested against). `stop`:
        strings that end a row (special tokens such as `<|end|>` included), cut from the text.
        `on_tokens(ids per row)` after every step streams them."""
        if not prompts:
            return []
        prompt = self.prompt_batch(prompts, images)
        ids_BT, mask_BT = _left_padded(prompt, self.tokenizer.pad_id)
        B, T = ids_BT.shape
        tok = self.tokenizer
        done_B = torch.zeros(B, dtype=torch.bool)
        streamer = _RowStreamer(B, tok.eos_id, done_B, on_tokens)
        criteria = StoppingCriteriaList([_StopStrings(stop, T, tok, done_B)] if stop else [])
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p if temperature > 0 and top_p < 1 else None,
            top_k=None,
            use_cache=use_cache,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
            bos_token_id=tok.bos_id,
        )
        inputs = dict(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            pixel_patches=prompt.pixel_patches,
            patch_coords=prompt.patch_coords,
            image_grids=prompt.image_grids,
        )
        self.hf.on_prefill = self._record_once()
        try:
            if seed is None:
                self.hf.generate(
                    **inputs,
                    generation_config=config,
                    stopping_criteria=criteria,
                    streamer=streamer,
                )
            else:
                with torch.random.fork_rng(
                    devices=[self.device] if self.device.type == "cuda" else []
                ):
                    torch.manual_seed(seed)
                    self.hf.generate(
                        **inputs,
                        generation_config=config,
                        stopping_criteria=criteria,
                        streamer=streamer,
                    )
        finally:
            self.hf.on_prefill = None
        texts = []
        for i in range(B):
            ids = streamer.rows[i]  # the row's tokens up to its end (generate pads finished rows)
            if stop:  # cut at the first stop string, then drop any special tokens before it
                full = tok.decode(ids, skip_special=False)
                cut = min((full.index(s) for s in stop if s in full), default=len(full))
                ids = tok.encode(full[:cut])
            texts.append(tok.decode(ids))
        return texts

    def _record_once(self):
        """The prompts' compression statistics, from the first forward of a `generate` call only."""
        seen = []

        def record(out, batch) -> None:
            if not seen:
                seen.append(True)
                self._record(summarize(out, batch))
                if out.chunks is not None:
                    docs = document_ratios(out.chunks.b_BT, batch.doc_ids, batch.modality)
                    self._prompt_docs += [{**d, "kind": "chat"} for d in docs]

        return record

    @torch.no_grad()
    def loglikelihood(
        self, contexts: list[str], continuations: list[str], images=None, use_cache: bool = True
    ) -> list[tuple[float, bool]]:
        """(sum of log p of each continuation given its context, whether greedy decoding would
        produce it). `use_cache`: every distinct context (with its images) is encoded once, its
        caches repeated for each of its candidates, and the continuations are teacher-forced through
        cached steps; False scores each pair with one full forward (the reference)."""
        if not contexts:
            return []
        conts = [self.tokenizer.encode(c) for c in continuations]
        if any(len(c) == 0 for c in conts):
            raise ValueError("an empty continuation has no likelihood to score")
        images = images or [[] for _ in contexts]
        B, longest = len(contexts), max(len(c) for c in conts)
        n_B = torch.tensor([len(c) for c in conts], device=self.device)
        cont_BT = torch.tensor([c + [0] * (longest - len(c)) for c in conts], device=self.device)
        real = torch.arange(longest, device=self.device)[None] < n_B[:, None]
        if use_cache:
            logits_BTV = self._continuation_logits_cached(contexts, images, cont_BT)
        else:
            batch = _extend(self.prompt_batch(contexts, images), longest, self.tokenizer.pad_id)
            lengths = (batch.doc_ids >= 0).sum(1)
            r, j = real.nonzero(as_tuple=True)
            _put(batch, r, lengths[r] + j, cont_BT[r, j])
            out = self.model(batch, context=NO_LOGITS)
            self._record(summarize(out, batch))
            # Token j of the continuation is predicted at position len(context) + j - 1: the
            # logits of those positions only.
            pos_BT = (lengths[:, None] + torch.arange(longest, device=self.device)[None] - 1).clamp(
                max=batch.input_ids.shape[1] - 1
            )
            logits_BTV = out.logits_at(pos_BT)
        logp_BTV = torch.log_softmax(logits_BTV.float(), -1)
        tok_logp = logp_BTV.gather(-1, cont_BT[..., None]).squeeze(-1)
        greedy = (logp_BTV.argmax(-1) == cont_BT) | ~real
        return [(float((tok_logp[i] * real[i]).sum()), bool(greedy[i].all())) for i in range(B)]

    def _continuation_logits_cached(self, contexts, images, cont_BT: torch.Tensor) -> torch.Tensor:
        """[B, T, V]: the logits predicting each continuation token, from one prefill per distinct context."""
        keys = [(c, tuple(_png(im) for im in ims)) for c, ims in zip(contexts, images)]
        slot: dict = {}  # distinct context -> its row in the prefill
        of_pair = torch.tensor([slot.setdefault(k, len(slot)) for k in keys], device=self.device)
        uniq = [keys.index(k) for k in slot]
        prompt = self.prompt_batch([contexts[i] for i in uniq], [images[i] for i in uniq])
        out, cache = self.model.prefill(prompt, cont_BT.shape[1])
        self._record(summarize(out, prompt))
        cache = cache.select(of_pair)
        steps = [out.last_logits_BV[of_pair]]
        for j in range(cont_BT.shape[1] - 1):
            steps.append(self.model.step(cont_BT[:, j], cache))
        return torch.stack(steps, 1)


def default_device() -> str:
    """Where `load_eval_model` puts a model unless told: the GPU when there is one, else the CPU.
    DeepSpeed's switch DS_ACCELERATOR=cpu, which pins the trainer to the CPU
    (vlm.train.distributed), pins evaluation there too: one setting keeps a whole run, its
    end-of-run evaluation included, off a GPU (the CPU tests set it)."""
    if os.environ.get("DS_ACCELERATOR", "").strip().lower() == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_eval_model(ckpt_dir: str | Path, device: str | None = None) -> ConceptMoEChat:
    """An exported `final/` (or converted) directory -> ConceptMoEChat with its own tokenizer (on
    `device`, by default `default_device()`)."""

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir}: not an exported model directory (no config.json)")
    device = device or default_device()
    model = load_vlm(ckpt_dir)  # WeightsError (one line) for a damaged export
    return ConceptMoEChat(model, load_export_tokenizer(ckpt_dir), device=device)


def load_export_tokenizer(ckpt_dir: Path):
    """An export's own tokenizer, checked against its config (export_checks.check_export_tokenizer);
    WeightsError naming the folder when its tokenizer files are missing, unreadable or another
    model's."""
    from data_pipelines.tokenizer import TokenizerError
    from vlm.model.export_checks import check_export_tokenizer
    from vlm.model.hf import ConceptMoEConfig
    from vlm.model.weights_check import WeightsError, read_config

    try:
        tok = load_tokenizer(ckpt_dir)
    except (TokenizerError, OSError, ValueError) as e:
        raise WeightsError(f"{ckpt_dir}: its tokenizer cannot be loaded ({e})") from None
    check_export_tokenizer(ckpt_dir, read_config(ckpt_dir, ConceptMoEConfig), tok)
    return tok
