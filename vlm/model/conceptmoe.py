"""The ConceptMoE language model: embed -> encoder E -> chunk -> concept model C -> dechunk ->
decoder D -> logits (or the final hidden states the loss makes them from, a tile at a time).

Legend: B rows, T tokens, D width, V vocabulary, M concept slots.

With `chunk.enabled = False` the same code is the plain MoE baseline: the concept layers run on
every token and the decoder reads their output directly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from configs.batch import PackedBatch
from vlm.model.block import (
    Block,
    StackContext,
    allocate_cross_caches,
    allocate_stack_caches,
    run_stack,
    step_stack,
)
from vlm.model.cache import ChunkState, InferenceCache, KVCache
from vlm.model.chunking import ChunkModule, Chunks, ChunkStep, within_capacity
from vlm.model.config import ModelConfig
from vlm.model.context import DEFAULT, ForwardContext
from vlm.model.cross_attention import ConceptMemory, ConceptStep
from vlm.model.dechunk import Dechunk
from vlm.model.layers import RMSNorm, rope_cos_sin
from vlm.model.output import ModelOutput
from vlm.model.sequence_parallel import SequenceShard
from vlm.model.share_init import fill_, init_normal_
from vlm.model.tiled_loss import LMHead, tokens_per_tile


class Middle(NamedTuple):
    """What `ConceptMoELM.middle` hands the decoder: its input z (eq. 10), what its concept reads
    take (joint decoding's EMA concept per token, the cross-attention decoder's `ConceptMemory`, or
    None for the MoE baseline), the chunking (None for the baseline) and the concept layers' MoE
    stats."""

    z_BTD: torch.Tensor
    c_BTD: torch.Tensor | ConceptMemory | None
    chunks: Chunks | None
    moe_stats: list


class MiddleStep(NamedTuple):
    """`ConceptMoELM.middle_step`'s: the decoder's input and concept read for one token per row, and
    the rows whose new concept found their concept caches full (None where none can be)."""

    z_B1D: torch.Tensor
    c_B1D: torch.Tensor | ConceptStep | None
    dropped_B: torch.Tensor | None = None


class ConceptMoELM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, Dc = cfg.hidden_size, cfg.c_hidden
        tok = dict(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            init_std=cfg.init_std,
        )
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.encoder = nn.ModuleList(
            Block(D, moe=cfg.moe, **tok) for _ in range(cfg.encoder_layers)
        )
        self.chunker = ChunkModule(cfg.chunk, D) if cfg.chunk.enabled else None
        self.concept_up = nn.Linear(D, Dc, bias=False) if Dc != D else None
        self.concept = nn.ModuleList(
            Block(
                Dc,
                cfg.c_heads,
                cfg.c_kv_heads,
                cfg.head_dim,
                cfg.qk_norm,
                cfg.norm_eps,
                cfg.c_moe,
                cfg.init_std,
            )
            for _ in range(cfg.concept_layers)
        )
        self.concept_down = nn.Linear(Dc, D, bias=False) if Dc != D else None
        self.dechunk = Dechunk(cfg.chunk, D) if cfg.chunk.enabled else None
        # the last num_joint_layers decoder layers read the concepts: eq. 11 (joint) or
        # DLCM's cross-attention
        self.joint_from = cfg.decoder_layers - cfg.num_joint_layers
        self.cross = cfg.decoder_mode == "cross_attention"
        self.decoder = nn.ModuleList(
            Block(
                D,
                moe=cfg.moe,
                joint=i >= self.joint_from and not self.cross,
                cross=i >= self.joint_from and self.cross,
                **tok,
            )
            for i in range(cfg.decoder_layers)
        )
        self.norm = RMSNorm(D, cfg.norm_eps)
        # activation checkpointing per block in training (cfg.activation_checkpoint;
        # `gradient_checkpointing` switches it to "full" the transformers way); `compiled`: the
        # blocks are compiled (vlm.model.compile)
        self.activation_checkpoint = cfg.activation_checkpoint
        self.compiled = False
        # sequence parallelism (vlm.model.sequence_parallel): this rank's place in the group its
        # rows are split over, set once by the trainer (`shard_sequence`); None: whole rows
        self.sequence_shard: SequenceShard | None = None
        self.lm_head = LMHead(D, cfg.vocab_size)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.chunk.joint_decoding_zero_init:
            self.zero_joint_projections()

    def shard_sequence(self, shard: SequenceShard | None) -> None:
        """Split every row of a training forward over `shard`'s group: this rank computes its
        tokens [s T / S, (s + 1) T / S) and its share of the concept slots, and its output (final
        hidden states, chunking, MoE statistics) is its tokens' (the trainer's loss reads this
        rank's part of the batch: vlm.train.sequence_shard). Refused (ValueError, one line) for
        what it cannot split."""
        if shard is not None and shard.size > 1:
            for ok, what in (
                (not self.cross, "model.decoder_mode: cross_attention"),
                (self.chunker is None or self.cfg.chunk.router != "topk", "chunk.router: topk"),
                (not self.cfg.chunk.grid_aware_boundaries, "chunk.grid_aware_boundaries: true"),
                (self.cfg.attention_window == 0, "model.attention_window > 0"),
            ):
                if not ok:
                    raise ValueError(f"parallel.sequence={shard.size} does not support {what}")
            for heads, name in (
                (self.cfg.num_heads, "num_heads"),
                (self.cfg.c_heads, "concept heads"),
            ):
                if heads % shard.size:
                    raise ValueError(
                        f"parallel.sequence={shard.size} must divide the attention's {heads} "
                        f"query heads (model.{name}): Ulysses splits heads over the group"
                    )
        self.sequence_shard = shard if shard is not None and shard.size > 1 else None

    @property
    def gradient_checkpointing(self) -> bool:
        return self.activation_checkpoint != "none"

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.activation_checkpoint = (
            ("full" if self.activation_checkpoint == "none" else self.activation_checkpoint)
            if on
            else "none"
        )

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)) and not (
            self.dechunk is not None and m is self.dechunk.residual
        ):
            init_normal_(m.weight, std=self.cfg.init_std)  # at this rank's share (share_init)
            if getattr(m, "bias", None) is not None:
                fill_(m.bias, 0.0)

    @torch.no_grad()
    def zero_joint_projections(self) -> None:
        """The decoder's concept reads start at zero: eq. 11's W^c, or the cross-attention's W_O
        (its sublayer then adds nothing: DLCM eq. 14 reduces to its residual)."""
        for blk in self.decoder:
            if blk.attn.joint:
                for proj in (blk.attn.cq_proj, blk.attn.ck_proj, blk.attn.cv_proj):
                    fill_(proj.weight, 0.0)
            if blk.cross is not None:
                fill_(blk.cross.o_proj.weight, 0.0)

    def hidden(
        self,
        x_BTD,
        doc_BT,
        pos_BT,
        above_BT=None,
        force=None,
        cache: InferenceCache | None = None,
        states: list | None = None,
        context: ForwardContext = DEFAULT,
    ):
        """Final hidden states [B, T, D] (before the norm), the chunking, and the MoE stats of every
        layer. With `cache` (prefill: one document per row) every layer's keys and values and the
        chunk state are kept. `context`: what a training forward needs from its step."""
        cfg = self.cfg
        shard = self.sequence_shard if cache is None else None
        ctx = StackContext.build(
            doc_BT,
            pos_BT if shard is None else shard.local(pos_BT),
            cfg.head_dim,
            cfg.rope_theta,
            x_BTD.dtype,
            cfg.attn_backend,
            window=cfg.attention_window,
            compiled=self.compiled,
            router_losses=context.router_losses,
            shard=shard,
        )
        ckpt = self.activation_checkpoint
        h_BTD, moe_stats = run_stack(
            self.encoder,
            x_BTD,
            ctx,
            caches=cache.encoder if cache else None,
            checkpoint=ckpt,
            states=states,
            statistics=context.statistics,
        )
        mid = self.middle(h_BTD, doc_BT, pos_BT, above_BT, force, ctx, cache, context)
        if states is not None:
            states.append(mid.z_BTD)
        out_BTD, s = run_stack(
            self.decoder,
            mid.z_BTD,
            ctx,
            c_BTD=mid.c_BTD,
            joint_from=self.joint_from,
            caches=cache.decoder if cache else None,
            checkpoint=ckpt,
            states=states,
            cross_caches=cache.cross if cache else None,
            statistics=context.statistics,
        )
        return out_BTD, mid.chunks, moe_stats + mid.moe_stats + s

    # ---------------------------------------------------------------- the middle
    # chunk -> concept model -> dechunk, between the encoder and the decoder: `middle` for whole
    # sequences, `middle_step` for one token per row over explicit state (the concept caches and the
    # chunk state of an `InferenceCache`), `allocate_concept_caches` beside them. The model's own
    # paths call them, and so does the vLLM plugin (vlm/serve) with views of its per-request slots.
    def middle(
        self,
        h_BTD,
        doc_BT,
        pos_BT,
        above_BT=None,
        force=None,
        ctx: StackContext | None = None,
        cache: InferenceCache | None = None,
        context: ForwardContext = DEFAULT,
    ) -> Middle:
        """The decoder's input and what its concept reads take, from the encoder's output. With
        `cache` (prefill: one document per row) the concept caches are filled and the chunk state
        set (`cache.chunk`); concept caches already in `cache` (given from outside, of a fixed
        capacity) keep the first concepts that fit them (`within_capacity`), else they are allocated
        for the prompt's concepts plus one per token still to come. `ctx`: the token stack's
        context (the cross-attention decoder's concept memory reads it; built when not given)."""
        cfg = self.cfg
        ch: Chunks | None = None
        # sequence parallelism: h holds this rank's tokens, doc_BT and pos_BT the whole rows'
        shard = self.sequence_shard if cache is None else None
        row_cdoc_BM = None  # the whole row's concept documents (their attention's masks)
        if self.chunker is None:  # every token a concept: the concept stack splits as the tokens
            c_BMD, row_cdoc_BM = h_BTD, doc_BT
            cpos_BM = pos_BT if shard is None else shard.local(pos_BT)
        else:
            ch = self.chunker(h_BTD, doc_BT, above_BT, force, context, shard)
            if cache is not None and cache.concept:
                ch = within_capacity(ch, cache.concept[0].capacity)
            c_BMD = self.chunker.merge(h_BTD, doc_BT, ch, shard)
            row_cdoc_BM, cpos_BM = ch.cdoc_BM if shard is None else ch.row_cdoc_BM, ch.cpos_BM
        concept_in_BMD = c_BMD
        if cache is not None and not cache.concept:
            self.allocate_concept_caches(
                cache, c_BMD.shape[1] + cache.capacity - h_BTD.shape[1], h_BTD
            )
        if self.concept_up is not None:
            c_BMD = self.concept_up(c_BMD)
        cctx = StackContext.build(
            row_cdoc_BM,
            cpos_BM,
            cfg.head_dim,
            cfg.rope_theta,
            c_BMD.dtype,
            cfg.attn_backend,
            use_rope=cfg.concept_pos == "rope",
            compiled=self.compiled,
            router_losses=context.router_losses,
            shard=shard,
        )
        c_BMD, moe_stats = run_stack(
            self.concept,
            c_BMD,
            cctx,
            cfg.concept_schedule,
            caches=cache.concept if cache else None,
            checkpoint=self.activation_checkpoint,
            statistics=context.statistics,
        )
        if self.concept_down is not None:
            c_BMD = self.concept_down(c_BMD)
        if ch is None:
            return Middle(c_BMD, None, None, moe_stats)
        smoothed_BMD = self.dechunk.smooth(c_BMD, ch, shard)
        z_BTD, cread_BTD, cread_in_BTD = self.dechunk(
            h_BTD, c_BMD, ch, concept_in_BMD, smoothed_BMD, shard
        )
        if cache is not None:
            cache.chunk = ChunkState.join(
                self.chunker.prefill_state(h_BTD, doc_BT, ch),
                self.dechunk.prefill_state(doc_BT, ch, cread_BTD, cread_in_BTD),
            )
        # the decoder attends over the smoothed concepts instead of adding its own (eq. 11)
        if self.cross:
            if ctx is None:
                ctx = StackContext.build(
                    doc_BT,
                    pos_BT,
                    cfg.head_dim,
                    cfg.rope_theta,
                    h_BTD.dtype,
                    cfg.attn_backend,
                    window=cfg.attention_window,
                    compiled=self.compiled,
                    router_losses=context.router_losses,
                )
            cread_BTD = ConceptMemory.build(
                smoothed_BMD, ch.cidx_BT, ch.b_BT, doc_BT, ctx, cfg.head_dim
            )
        return Middle(z_BTD, cread_BTD, ch, moe_stats)

    def middle_step(
        self, h_B1D: torch.Tensor, cache: InferenceCache, force_B: torch.Tensor | None = None
    ) -> MiddleStep:
        """`middle` for one new token per row ([B, 1, D], the encoder's output), over the concept
        caches and chunk state of `cache` (updated in place). Fixed shapes, no host synchronisation
        (but on CPU, see below): every row runs the concept model; the rows whose boundary did not
        fire keep their caches as they were (masked, not sliced out). A row whose concept caches are
        full (the concepts closed so far fill their capacity: caches of a fixed size given from
        outside; `InferenceCache.make_room` keeps the model's own from filling) keeps no new concept:
        as if its boundary had not fired, counted in `dropped_B`. Such caches must have their write
        position within the capacity (their length at most capacity - 1), where a full row still
        writes (fixed shapes): its last entry is scratch, so such a caller works on copies and keeps
        the rows that gained a concept, as the vLLM plugin does. `force_B` sets the boundaries
        instead of the router."""
        if self.chunker is None:  # every token is a concept, at its token position
            return MiddleStep(self.concept_step(h_B1D, cache.len_B, None, cache), None)
        state = cache.chunk
        ck: ChunkStep = self.chunker.step(h_B1D[:, 0], state, force_B)
        pos_B = state.n_concepts_B  # the new concept's place: the concepts closed so far
        dropped_B = None
        if cache.concept:
            full_B = pos_B >= cache.concept[0].capacity
            dropped_B = ck.b_B & full_B
            ck = ck._replace(b_B=ck.b_B & ~full_B)
        if (
            h_B1D.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and not bool(ck.b_B.any())
        ):
            # The CPU's host is its device: when no row closed a concept (half the steps at R = 2,
            # batch 1), the concept model's results would all be dropped, so it is not run. Same
            # numbers, less work.
            c_B1D = torch.zeros_like(h_B1D)
        else:
            c_B1D = self.concept_step(ck.c_BD[:, None], pos_B, ck.b_B, cache)
        d = self.dechunk.step(h_B1D, c_B1D, ck, state)
        # the cross-attention decoder appends the new (smoothed) concepts to its caches; joint
        # decoding reads c
        return MiddleStep(
            d.z_B1D, ConceptStep(d.c_B1D, ck.b_B) if self.cross else d.c_B1D, dropped_B
        )

    # ---------------------------------------------------------------- inference with caches
    def _caches(
        self, kv_heads: int, n: int, B: int, capacity: int, like: torch.Tensor, window: int = 0
    ) -> list[KVCache]:
        """`n` bare caches (eval/bench/decode.py builds synthetic ones with it; the model allocates per module)."""
        return [
            KVCache.allocate(
                B, kv_heads, capacity, self.cfg.head_dim, like.dtype, like.device, window
            )
            for _ in range(n)
        ]

    def allocate_inference_cache(self, B: int, capacity: int, like: torch.Tensor) -> InferenceCache:
        """Token caches for `capacity` positions per row; the concept caches are sized at prefill,
        once the prompt's concepts are known (`allocate_concept_caches`)."""
        w = self.cfg.attention_window
        return InferenceCache(
            allocate_stack_caches(self.encoder, B, capacity, like, window=w),
            [],
            allocate_stack_caches(self.decoder, B, capacity, like, window=w),
            torch.zeros(B, dtype=torch.long, device=like.device),
            capacity=capacity,
        )

    def allocate_concept_caches(
        self, cache: InferenceCache, capacity: int, like: torch.Tensor
    ) -> None:
        """The concept model's caches (one per pass of its schedule) and the cross-attention
        decoder's concept caches, `capacity` concepts per row."""
        B = cache.len_B.shape[0]
        cache.concept = allocate_stack_caches(
            self.concept, B, capacity, like, self.cfg.concept_schedule
        )
        cache.cross = (
            allocate_cross_caches(self.decoder, B, capacity, like)
            if self.chunker is not None
            else []
        )

    @torch.no_grad()
    def prefill(
        self,
        batch: PackedBatch,
        inputs_embeds: torch.Tensor | None = None,
        above_BT=None,
        max_new_tokens: int = 0,
    ) -> tuple[ModelOutput, InferenceCache]:
        """The prompts' output (one document per row, right-padded) and the caches `step` continues
        from. The output's logits are those of each row's last token (`last_logits_BV`)."""
        x_BTD = self.embed(batch.input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x_BTD.shape
        cache = self.allocate_inference_cache(B, T + max_new_tokens, x_BTD)
        out_BTD, ch, moe_stats = self.hidden(
            x_BTD, batch.doc_ids, batch.position_ids, above_BT, cache=cache
        )
        cache.len_B = (batch.doc_ids >= 0).sum(1)
        cache.used_tokens, cache.used_concepts = T, ch.cdoc_BM.shape[1] if ch is not None else T
        out = self.assemble(None, self.norm(out_BTD), ch, moe_stats)
        # the logits of each row's last token only: what generation reads
        last_B = (cache.len_B - 1).clamp_min(0)
        out.last_logits_BV = out.logits_at(last_B[:, None])[:, 0]
        return out, cache

    @torch.no_grad()
    def step(
        self, x_BD: torch.Tensor, cache: InferenceCache, force_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, V] of one new token per row (embedded: [B, D]), extending every cache:
        makes room for it (host-side bookkeeping: the caches grow, rarely, between steps)
        and runs `decode_step`."""
        cache.make_room(1)
        return self.decode_step(x_BD, cache, force_B)

    @torch.no_grad()
    def decode_step(
        self, x_BD: torch.Tensor, cache: InferenceCache, force_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One decode step with fixed shapes and no host synchronisation, so it can be compiled
        (`torch.compile(model.decode_step, fullgraph=True)`) and captured as a CUDA graph: every row
        runs every stack, the concept model included; the rows whose boundary did not fire keep
        their concept state and caches as they were (masked, not sliced out). `force_B` sets the
        boundaries instead of the router (benchmarks at a chosen ratio, as `forward`'s `force`). The
        caches must have room (`step` makes it)."""
        cfg = self.cfg
        rope = rope_cos_sin(cache.len_B[:, None], cfg.head_dim, cfg.rope_theta, x_BD.dtype)
        h_B1D = step_stack(self.encoder, x_BD[:, None], rope, cache.encoder)
        mid = self.middle_step(h_B1D, cache, force_B)
        out_B1D = step_stack(
            self.decoder,
            mid.z_B1D,
            rope,
            cache.decoder,
            c_B1D=mid.c_B1D,
            joint_from=self.joint_from,
            cross_caches=cache.cross,
        )
        cache.len_B.add_(1)
        return self.lm_head(self.norm(out_B1D))[:, 0]

    def concept_step(
        self,
        c_B1D: torch.Tensor,
        pos_B: torch.Tensor,
        fired_B: torch.Tensor | None,
        cache: InferenceCache,
    ) -> torch.Tensor:
        """The concept model (with its width projections) on one new concept per row at concept
        positions `pos_B`; rows with `fired_B` False (None: every row fired) compute too but keep
        their caches as they were."""
        cfg = self.cfg
        crope = (
            rope_cos_sin(pos_B[:, None], cfg.head_dim, cfg.rope_theta, c_B1D.dtype)
            if cfg.concept_pos == "rope"
            else None
        )
        if self.concept_up is not None:
            c_B1D = self.concept_up(c_B1D)
        c_B1D = step_stack(self.concept, c_B1D, crope, cache.concept, fired_B, cfg.concept_schedule)
        return self.concept_down(c_B1D) if self.concept_down is not None else c_B1D

    def forward(
        self,
        batch: PackedBatch,
        inputs_embeds: torch.Tensor | None = None,
        above_BT=None,
        force: str | torch.Tensor | None = None,
        output_hidden_states: bool = False,
        context: ForwardContext = DEFAULT,
    ) -> ModelOutput:
        x_BTD = self.embed(batch.input_ids) if inputs_embeds is None else inputs_embeds
        if self.sequence_shard is not None:  # this rank's tokens (the documents stay whole)
            # a copy: a view would keep the whole row's embeddings alive through the backward
            x_BTD = self.sequence_shard.local(x_BTD).clone()
        states = [] if output_hidden_states else None
        out_BTD, ch, moe_stats = self.hidden(
            x_BTD,
            batch.doc_ids,
            batch.position_ids,
            above_BT,
            force,
            states=states,
            context=context,
        )
        normed_BTD = self.norm(out_BTD)
        # a training forward leaves the logits to the loss, which makes them a tile at a time
        logits_BTV = self.lm_head(normed_BTD) if context.logits else None
        out = self.assemble(logits_BTV, normed_BTD, ch, moe_stats)
        if states is not None:
            out.hidden_states = (x_BTD, *states[:-1], normed_BTD)
        return out

    def assemble(self, logits_BTV, normed_BTD, ch: Chunks | None, moe_stats) -> ModelOutput:
        """The output: the logits (None: not computed), the final hidden states with the output
        layer and the loss's tile size, the chunking and each MoE pass's outcome as they are (no
        host transfer here; the losses are the trainer's: vlm.train.losses)."""
        names = (
            [f"encoder.{i}" for i in range(len(self.encoder))]
            + [f"concept.{i}" for i in self.cfg.concept_schedule]
            + [f"decoder.{i}" for i in range(len(self.decoder))]
        )
        tile = tokens_per_tile(self.cfg.vocab_size, normed_BTD.device, self.cfg.loss_tile_tokens)
        return ModelOutput(
            logits_BTV,
            ch,
            list(zip(names, moe_stats)),
            final_BTD=normed_BTD,
            head=self.lm_head,
            tile_tokens=tile,
        )
