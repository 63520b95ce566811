"""Inference caches: token-level KV for encoder and decoder layers, concept-level KV for
the concept model.

Legend: B rows, T tokens, D width, Q query heads, J key/value heads, C cache entries, d head width.

Rows are ragged: each has its own length (tokens, or concepts for a concept cache: the concept
model's, and the cross-attention decoder's, which keeps one key/value per concept). A cache is one
padded buffer per layer plus the lengths; appending writes at each row's length, attention masks
past it. In a decode step every row computes (fixed shapes, so the step can be compiled and captured
as a CUDA graph); a concept cache keeps the new entry only for the rows whose boundary fired
(`advance_B`): no Python loop over rows or tokens, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """Keys and values of one attention layer: [B, kv_heads, capacity, head_dim], `len_B` filled per row."""

    k_BJCd: torch.Tensor
    v_BJCd: torch.Tensor
    len_B: torch.Tensor
    window: int = 0  # sliding-window layers read only their last `window` entries

    @staticmethod
    def allocate(
        B: int, kv_heads: int, capacity: int, head_dim: int, dtype, device, window: int = 0
    ) -> "KVCache":
        z = torch.zeros(B, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        return KVCache(z, z.clone(), torch.zeros(B, dtype=torch.long, device=device), window)

    def fill(self, k_BJTd: torch.Tensor, v_BJTd: torch.Tensor, len_B: torch.Tensor) -> None:
        """Prefill: the first T positions of every row (positions past `len_B` are padding, never read)."""
        T = k_BJTd.shape[2]
        if T > self.k_BJCd.shape[2]:
            raise ValueError(
                f"prefill of {T} positions exceeds the cache capacity {self.k_BJCd.shape[2]}"
            )
        self.k_BJCd[:, :, :T] = k_BJTd
        self.v_BJCd[:, :, :T] = v_BJTd
        self.len_B.copy_(len_B)

    def write(self, k_BJ1d, v_BJ1d) -> None:
        """One new key/value per row at its length, not yet counted. Fixed shapes: every row writes,
        no host synchronisation (room was made before the step: `InferenceCache.make_room`)."""
        rows = torch.arange(self.len_B.shape[0], device=self.len_B.device)
        self.k_BJCd[rows, :, self.len_B] = k_BJ1d[:, :, 0]
        self.v_BJCd[rows, :, self.len_B] = v_BJ1d[:, :, 0]

    def advance(self, advance_B: torch.Tensor | None = None) -> None:
        """Count the written entry (for the rows with `advance_B`; None: every row). A row that does
        not keep it overwrites the slot with its next entry."""
        self.len_B.add_(1 if advance_B is None else advance_B.long())

    def append(self, k_BJ1d, v_BJ1d, advance_B: torch.Tensor | None = None) -> None:
        self.write(k_BJ1d, v_BJ1d)
        self.advance(advance_B)

    def attend(self, q_BQ1d, extra: int = 0) -> torch.Tensor:
        """One query per row over that row's filled entries plus `extra` written past them (only the
        last `window` of them if set)."""
        len_B = self.len_B + extra
        C = self.k_BJCd.shape[2]
        j_1C = torch.arange(C, device=len_B.device)[None]
        mask_BC = j_1C < len_B[:, None]
        if self.window:
            mask_BC &= j_1C >= len_B[:, None] - self.window
        return F.scaled_dot_product_attention(
            q_BQ1d,
            self.k_BJCd,
            self.v_BJCd,
            attn_mask=mask_BC[:, None, None],
            enable_gqa=self.k_BJCd.shape[1] != q_BQ1d.shape[1],
        )

    def append_and_attend(
        self, q_BQ1d, k_BJ1d, v_BJ1d, advance_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Self-attention of one new position per row: its key/value joins the row's cache and its
        query attends over the row. Rows with `advance_B` False (a concept cache whose boundary did
        not fire) compute as the others do, with fixed shapes, but do not keep the entry; their
        result is not used."""
        self.write(k_BJ1d, v_BJ1d)
        out = self.attend(q_BQ1d, extra=1)
        self.advance(advance_B)
        return out

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A cache of the given rows (repeats allowed: one prefix continued several ways)."""
        return KVCache(self.k_BJCd[rows], self.v_BJCd[rows], self.len_B[rows], self.window)

    def grow(self, extra: int) -> None:
        """Room for `extra` more positions per row (when a generation runs past the capacity it was given)."""
        pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2)  # noqa: E731
        self.k_BJCd, self.v_BJCd = pad(self.k_BJCd), pad(self.v_BJCd)

    @property
    def capacity(self) -> int:
        return self.k_BJCd.shape[2]

    def nbytes(self) -> int:
        """Bytes of the filled entries (what a cache of exactly the realized length would hold)."""
        per_pos = self.k_BJCd.shape[1] * self.k_BJCd.shape[3] * self.k_BJCd.element_size() * 2
        return int(self.len_B.sum()) * per_pos


def kept(dtype: str, **default):
    """A field of a state carried from one step to the next, and its dtype there: "hidden" (the
    hidden states'), "float32" or "long"; its width is its name's suffix (`_BD` a vector per row,
    `_B` a number). Declared once, here: what keeps the state outside the model (a serving engine's
    slots, vlm/serve/layout.py) lays it out from these fields."""
    return field(metadata={"dtype": dtype}, **default)


@dataclass
class RouterState:
    """What the chunk module carries from one token to the next, per row (`ChunkModule.step`)."""

    # the router's key (cosine) or hidden state (linear) of the last token
    last_key_BD: torch.Tensor = kept("hidden")
    # merge of the tokens after the last boundary (sum; `last` ignores it)
    pending_BD: torch.Tensor = kept("hidden")
    # how many tokens that is (for `mean`; the fixed router's place in the document)
    pending_n_B: torch.Tensor = kept("long")


@dataclass
class DechunkState:
    """What the dechunk carries from one concept to the next, per row (`Dechunk.step`)."""

    # eq. 8's EMA at the last closed concept: what the next token reads
    ema_BD: torch.Tensor = kept("float32")
    # concepts closed so far (the next concept's position)
    n_concepts_B: torch.Tensor = kept("long")
    # residual "delta": the same EMA over the concept model's inputs (None otherwise)
    ema_in_BD: torch.Tensor | None = kept("float32", default=None)


@dataclass
class ChunkState(DechunkState, RouterState):
    """The chunk module's and the dechunk's state in one object (each module reads and
    writes its own fields); fields in the order last_key_BD, pending_BD, pending_n_B,
    ema_BD, n_concepts_B, ema_in_BD."""

    @staticmethod
    def join(router: RouterState, dechunk: DechunkState) -> "ChunkState":
        return ChunkState(
            router.last_key_BD,
            router.pending_BD,
            router.pending_n_B,
            dechunk.ema_BD,
            dechunk.n_concepts_B,
            dechunk.ema_in_BD,
        )


@dataclass
class InferenceCache:
    """Everything the model keeps between decode steps: one entry per realized token or concept."""

    encoder: list[KVCache]
    # one per pass of the concept schedule (a looped layer has one per pass)
    concept: list[KVCache]
    decoder: list[KVCache]
    len_B: torch.Tensor  # tokens per row so far (the next token's position)
    chunk: ChunkState | None = None  # None for the MoE baseline (every token is a concept)
    # token positions each row can hold at allocation (caches grow past it)
    capacity: int = 0
    # decoder_mode cross_attention: the concept keys/values of each cross-attending decoder
    # layer, one entry per realized concept (DLCM eq. 13), filled at prefill and extended when a
    # boundary fires
    cross: list[KVCache] = field(default_factory=list)
    # host-side bounds on the entries any row has used in the token caches (the prompt's padded
    # length plus one per step) and in the concept caches (the prompt's concept capacity plus one
    # per step): see `make_room`
    used_tokens: int = 0
    used_concepts: int = 0

    def select(self, rows: torch.Tensor) -> "InferenceCache":
        """The caches of the given rows, e.g. each prompt repeated once per candidate continuation."""
        ch = self.chunk
        chunk = (
            None
            if ch is None
            else ChunkState(
                *(
                    None if (t := getattr(ch, f.name)) is None else t[rows]
                    for f in fields(ChunkState)
                )
            )
        )
        pick = lambda caches: [c.select(rows) for c in caches]  # noqa: E731
        return InferenceCache(
            pick(self.encoder),
            pick(self.concept),
            pick(self.decoder),
            self.len_B[rows],
            chunk,
            self.capacity,
            pick(self.cross),
            self.used_tokens,
            self.used_concepts,
        )

    def make_room(self, steps: int = 1) -> None:
        """Before `steps` decode steps: grow every cache (doubling) that they could overflow.
        Host-side bookkeeping (bounds on the entries used), so the step itself has no host
        synchronisation and fixed shapes between growths."""
        if self.room() < steps:
            for c in self.encoder + self.decoder + self.concept + self.cross:
                c.grow(max(c.capacity, steps))
        self.used_tokens += steps
        self.used_concepts += steps

    def room(self) -> int:
        """Decode steps every cache has a free slot for (from the host-side bounds)."""
        tok = min((c.capacity for c in self.encoder + self.decoder), default=1 << 62)
        tok -= self.used_tokens
        con = min((c.capacity for c in self.concept + self.cross), default=1 << 62)
        con -= self.used_concepts
        return min(tok, con)

    def token_bytes(self) -> int:
        return sum(c.nbytes() for c in self.encoder + self.decoder)

    def concept_bytes(self) -> int:
        """The concept model's caches (the decoder's cross-attention caches are `cross_bytes`)."""
        return sum(c.nbytes() for c in self.concept)

    def cross_bytes(self) -> int:
        return sum(c.nbytes() for c in self.cross)
