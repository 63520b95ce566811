"""Inference caches: token-level KV for encoder and decoder layers, concept-level KV for the concept model.

Rows are ragged: each has its own length (tokens, or concepts for a concept cache: the concept model's, and the
cross-attention decoder's, which keeps one key/value per concept). A cache is one padded
buffer per layer plus the lengths; appending writes at each row's length, attention masks past it. In a
decode step the concept model runs only for the rows whose boundary fired, so concept caches are read
and written for a subset of rows (`rows`, an index tensor): no Python loop over rows or tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """Keys and values of one attention layer: [B, kv_heads, capacity, head_dim], `len_B` filled per row."""

    k_BKSd: torch.Tensor
    v_BKSd: torch.Tensor
    len_B: torch.Tensor
    window: int = 0          # sliding-window layers read only their last `window` entries

    @staticmethod
    def allocate(B: int, kv_heads: int, capacity: int, head_dim: int, dtype, device, window: int = 0) -> "KVCache":
        z = torch.zeros(B, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        return KVCache(z, z.clone(), torch.zeros(B, dtype=torch.long, device=device), window)

    def fill(self, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor, len_B: torch.Tensor) -> None:
        """Prefill: the first T positions of every row (positions past `len_B` are padding, never read)."""
        T = k_BKTd.shape[2]
        if T > self.k_BKSd.shape[2]:
            raise ValueError(f"prefill of {T} positions exceeds the cache capacity {self.k_BKSd.shape[2]}")
        self.k_BKSd[:, :, :T] = k_BKTd
        self.v_BKSd[:, :, :T] = v_BKTd
        self.len_B.copy_(len_B)

    def append(self, rows: torch.Tensor | None, k_RK1d, v_RK1d) -> None:
        """Write one new key/value per selected row (`rows`; None = every row) at its length."""
        idx = rows if rows is not None else torch.arange(self.len_B.shape[0], device=self.len_B.device)
        pos_R = self.len_B[idx]   # room was made once per step (InferenceCache.ensure_room), not here (no sync)
        self.k_BKSd[idx, :, pos_R] = k_RK1d[:, :, 0]
        self.v_BKSd[idx, :, pos_R] = v_RK1d[:, :, 0]
        self.len_B[idx] += 1

    def attend(self, rows: torch.Tensor | None, q_RH1d) -> torch.Tensor:
        """One query per selected row over that row's filled entries (the last `window` of them if set)."""
        len_R = self.len_B if rows is None else self.len_B[rows]
        S = self.k_BKSd.shape[2]
        j_1S = torch.arange(S, device=len_R.device)[None]
        mask_RS = j_1S < len_R[:, None]
        if self.window:
            mask_RS &= j_1S >= len_R[:, None] - self.window
        mask_R11S = mask_RS[:, None, None]
        k, v = (self.k_BKSd, self.v_BKSd) if rows is None else (self.k_BKSd[rows], self.v_BKSd[rows])
        return F.scaled_dot_product_attention(q_RH1d, k, v, attn_mask=mask_R11S, enable_gqa=k.shape[1] != q_RH1d.shape[1])

    def append_and_attend(self, rows: torch.Tensor | None, q_RH1d, k_RK1d, v_RK1d) -> torch.Tensor:
        """Self-attention of one new position per selected row (`rows`; None = every row, read in place without
        a gather): its key/value joins the row's cache, then its query attends over the row."""
        self.append(rows, k_RK1d, v_RK1d)
        return self.attend(rows, q_RH1d)

    def select(self, rows: torch.Tensor) -> "KVCache":
        """A cache of the given rows (repeats allowed: one prefix continued several ways)."""
        return KVCache(self.k_BKSd[rows], self.v_BKSd[rows], self.len_B[rows], self.window)

    def grow(self, extra: int) -> None:
        """Room for `extra` more positions per row (when a generation runs past the capacity it was given)."""
        pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2)  # noqa: E731
        self.k_BKSd, self.v_BKSd = pad(self.k_BKSd), pad(self.v_BKSd)

    @property
    def capacity(self) -> int:
        return self.k_BKSd.shape[2]

    def nbytes(self) -> int:
        """Bytes of the filled entries (what a cache of exactly the realized length would hold)."""
        per_pos = self.k_BKSd.shape[1] * self.k_BKSd.shape[3] * self.k_BKSd.element_size() * 2
        return int(self.len_B.sum()) * per_pos


@dataclass
class RouterState:
    """What the chunk module carries from one token to the next, per row (`ChunkModule.step`)."""

    last_key_BD: torch.Tensor        # the router's key (cosine) or hidden state (linear) of the last token
    pending_BD: torch.Tensor         # merge of the tokens after the last boundary (sum; `last` ignores it)
    pending_n_B: torch.Tensor        # how many tokens that is (for `mean`; the fixed router's place in the document)


@dataclass
class DechunkState:
    """What the dechunk carries from one concept to the next, per row (`Dechunk.step`)."""

    ema_BD: torch.Tensor             # eq. 8's EMA at the last closed concept: what the next token reads (fp32)
    n_concepts_B: torch.Tensor       # concepts closed so far (the next concept's position)
    ema_in_BD: torch.Tensor | None = None   # residual "delta": the same EMA over the concept model's inputs


@dataclass
class ChunkState(DechunkState, RouterState):
    """The chunk module's and the dechunk's state in one object (each module reads and writes its own fields);
    fields in the order last_key_BD, pending_BD, pending_n_B, ema_BD, n_concepts_B, ema_in_BD."""

    @staticmethod
    def join(router: RouterState, dechunk: DechunkState) -> "ChunkState":
        return ChunkState(router.last_key_BD, router.pending_BD, router.pending_n_B, dechunk.ema_BD,
                          dechunk.n_concepts_B, dechunk.ema_in_BD)


@dataclass
class InferenceCache:
    """Everything the model keeps between decode steps: one entry per realized token or concept."""

    encoder: list[KVCache]
    concept: list[KVCache]           # one per pass of the concept schedule (a looped layer has one per pass)
    decoder: list[KVCache]
    len_B: torch.Tensor              # tokens per row so far (the next token's position)
    chunk: ChunkState | None = None  # None for the MoE baseline (every token is a concept)
    capacity: int = 0                # token positions each row can hold at allocation (caches grow past it)
    # decoder_mode cross_attention: the concept keys/values of each cross-attending decoder layer, one entry
    # per realized concept (DLCM eq. 13), filled at prefill and extended when a boundary fires
    cross: list[KVCache] = field(default_factory=list)

    def select(self, rows: torch.Tensor) -> "InferenceCache":
        """The caches of the given rows, e.g. each prompt repeated once per candidate continuation."""
        ch = self.chunk
        chunk = None if ch is None else ChunkState(*(None if (t := getattr(ch, f.name)) is None else t[rows]
                                                      for f in fields(ChunkState)))
        pick = lambda caches: [c.select(rows) for c in caches]  # noqa: E731
        return InferenceCache(pick(self.encoder), pick(self.concept), pick(self.decoder), self.len_B[rows], chunk,
                              self.capacity, pick(self.cross))

    def ensure_room(self) -> None:
        """Before a step: grow any cache that one more position per row would overflow (one host sync per step,
        doubling, so a long generation grows it a logarithmic number of times)."""
        n_tok = int(self.len_B.max()) + 1
        n_con = int(self.chunk.n_concepts_B.max()) + 1 if self.chunk is not None else n_tok
        for caches, need in ((self.encoder + self.decoder, n_tok), (self.concept + self.cross, n_con)):
            for c in caches:
                if need > c.capacity:
                    c.grow(c.capacity)

    def token_bytes(self) -> int:
        return sum(c.nbytes() for c in self.encoder + self.decoder)

    def concept_bytes(self) -> int:
        """The concept model's caches (the decoder's cross-attention caches are `cross_bytes`)."""
        return sum(c.nbytes() for c in self.concept)

    def cross_bytes(self) -> int:
        return sum(c.nbytes() for c in self.cross)
