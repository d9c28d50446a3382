"""A small decoder-only transformer whose KV cache lives in kvxfer's page-major pools.

Three flavours, with seeded random weights, computed in float32 on CPU:

- ``mha``: grouped-query attention (4 query heads, 2 KV heads); per layer a K
  and a V block in an MHA pool.
- ``mla``: DeepSeek-style compressed attention; per layer one latent row
  (``kv_lora_rank + rope_dim``) per token in an MLA pool, expanded to K and V
  at attention time.
- ``hybrid``: attention layers (MHA pool) interleaved with Mamba-like layers
  whose conv window and SSM state live in a Mamba pool, one slot per request.

Attention reads K/V through the pool's per-layer views via the request's page
table (token ``t`` -> page ``pages[t // page_size]``, slot ``t % page_size``),
exactly as an engine would, so whatever the cache holds decides the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvxfer.layout import PoolViews


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model and of its cache pools."""

    flavour: str = "mha"
    vocab: int = 97
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    kv_lora_rank: int = 32
    rope_dim: int = 8
    d_conv: int = 4
    d_state: int = 8
    page_size: int = 4
    num_pages: int = 96
    num_slots: int = 8
    cache_dtype: str = "bfloat16"
    seed: int = 0

    def layer_kinds(self) -> list[str]:
        """What each layer is: attn (MHA), mla, or ssm (Mamba-like)."""
        if self.flavour == "mha":
            return ["attn"] * self.n_layers
        if self.flavour == "mla":
            return ["mla"] * self.n_layers
        if self.flavour == "hybrid":
            return ["attn" if i % 2 == 0 else "ssm" for i in range(self.n_layers)]
        raise ValueError(f"flavour={self.flavour!r}; expected mha, mla or hybrid")

    def pools(self) -> list[dict[str, Any]]:
        """The daemon pool entries this model needs (as in a ``kvxfer serve`` config)."""
        kinds = self.layer_kinds()
        n_attn = sum(k != "ssm" for k in kinds)
        if self.flavour == "mla":
            kv = dict(name="kv", kind="mla", layer_num=n_attn, kv_lora_rank=self.kv_lora_rank,
                      qk_rope_head_dim=self.rope_dim, dtype=self.cache_dtype,
                      page_size=self.page_size, num_pages=self.num_pages)
        else:
            kv = dict(name="kv", kind="mha", layer_num=n_attn, head_num=self.n_kv_heads,
                      head_dim=self.head_dim, v_head_dim=self.head_dim, dtype=self.cache_dtype,
                      page_size=self.page_size, num_pages=self.num_pages)
        if self.flavour != "hybrid":
            return [kv]
        ssm = dict(name="ssm", kind="mamba", layer_num=len(kinds) - n_attn,
                   conv_state_shapes=[[self.d_model, self.d_conv]], conv_dtype="float32",
                   temporal_state_shape=[self.d_model, self.d_state], temporal_dtype="float32",
                   num_slots=self.num_slots)
        return [kv, ssm]


@dataclass
class RequestCache:
    """One request's share of the pools: its page table and (hybrid) its Mamba slot."""

    kv: PoolViews
    pages: list[int]
    page_size: int
    ssm: PoolViews | None = None
    slot: int = 0

    def _where(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.pages, dtype=torch.long)
        return table[positions // self.page_size], positions % self.page_size

    def write(self, views: tuple[torch.Tensor, ...], layer: int, positions: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store per-token rows (T, heads, dim) of one layer at ``positions``."""
        pages, slots = self._where(positions)
        view = views[layer]
        view[pages, slots] = values.to(view.dtype)

    def read(self, views: tuple[torch.Tensor, ...], layer: int, length: int) -> torch.Tensor:
        """Rows of tokens 0..length-1 of one layer, (length, heads, dim), as float32."""
        pages, slots = self._where(torch.arange(length))
        return views[layer][pages, slots].float()


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyModel:
    """Seeded random weights and the two entry points an engine has: prefill and decode."""

    def __init__(self, config: ModelConfig) -> None:
        self.cfg = c = config
        gen = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return 2 * torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        self.embed = torch.randn(c.vocab, c.d_model, generator=gen)
        self.unembed = w(c.d_model, c.vocab)
        self.layers: list[dict[str, torch.Tensor]] = []
        qk_dim = c.head_dim + (c.rope_dim if c.flavour == "mla" else 0)
        for kind in c.layer_kinds():
            p = {"w1": w(c.d_model, 2 * c.d_model), "w2": w(2 * c.d_model, c.d_model)}
            if kind == "attn":
                p.update(wq=w(c.d_model, c.n_heads * c.head_dim),
                         wk=w(c.d_model, c.n_kv_heads * c.head_dim),
                         wv=w(c.d_model, c.n_kv_heads * c.head_dim),
                         wo=w(c.n_heads * c.head_dim, c.d_model))
            elif kind == "mla":
                p.update(wq=w(c.d_model, c.n_heads * qk_dim),
                         wdkv=w(c.d_model, c.kv_lora_rank + c.rope_dim),
                         wuk=w(c.kv_lora_rank, c.n_heads * c.head_dim),
                         wuv=w(c.kv_lora_rank, c.n_heads * c.head_dim),
                         wo=w(c.n_heads * c.head_dim, c.d_model))
            else:
                p.update(win=w(c.d_model, c.d_model), wz=w(c.d_model, c.d_model),
                         conv=w(c.d_model, c.d_conv), wb=w(c.d_model, c.d_state),
                         wc=w(c.d_model, c.d_state), wout=w(c.d_model, c.d_model),
                         decay=torch.sigmoid(torch.randn(c.d_model, c.d_state, generator=gen)))
            self.layers.append(p)

    # -- layers ------------------------------------------------------------------------

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   first_pos: int) -> torch.Tensor:
        """q (T, H, d), k/v (S, Hkv, d): causal attention of positions first_pos.. over 0..S-1."""
        c = self.cfg
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
        t_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
        mask = torch.arange(k.shape[0])[None, :] > t_pos
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
        return out.reshape(q.shape[0], c.n_heads * v.shape[-1])

    def _attn_layer(self, i: int, a: int, h: torch.Tensor, cache: RequestCache, pos0: int) -> torch.Tensor:
        c, p = self.cfg, self.layers[i]
        T = h.shape[0]
        positions = torch.arange(pos0, pos0 + T)
        q = (h @ p["wq"]).view(T, c.n_heads, c.head_dim)
        cache.write(cache.kv.k, a, positions, (h @ p["wk"]).view(T, c.n_kv_heads, c.head_dim))
        cache.write(cache.kv.v, a, positions, (h @ p["wv"]).view(T, c.n_kv_heads, c.head_dim))
        k = cache.read(cache.kv.k, a, pos0 + T)
        v = cache.read(cache.kv.v, a, pos0 + T)
        return self._attention(q, k, v, pos0) @ p["wo"]

    def _mla_layer(self, i: int, a: int, h: torch.Tensor, cache: RequestCache, pos0: int) -> torch.Tensor:
        c, p = self.cfg, self.layers[i]
        T = h.shape[0]
        positions = torch.arange(pos0, pos0 + T)
        q = (h @ p["wq"]).view(T, c.n_heads, c.head_dim + c.rope_dim)
        cache.write(cache.kv.latent, a, positions, (h @ p["wdkv"]).view(T, 1, -1))
        latent = cache.read(cache.kv.latent, a, pos0 + T)[:, 0]  # (S, rank + rope)
        S = latent.shape[0]
        nope, rope = latent[:, : c.kv_lora_rank], latent[:, c.kv_lora_rank :]
        k = torch.cat([(nope @ p["wuk"]).view(S, c.n_heads, c.head_dim),
                       rope[:, None, :].expand(S, c.n_heads, c.rope_dim)], dim=-1)
        v = (nope @ p["wuv"]).view(S, c.n_heads, c.head_dim)
        return self._attention(q, k, v, pos0) @ p["wo"]

    def _ssm_layer(self, i: int, s: int, h: torch.Tensor, cache: RequestCache) -> torch.Tensor:
        p = self.layers[i]
        assert cache.ssm is not None and cache.ssm.temporal is not None
        conv_state = cache.ssm.conv[0][s, cache.slot]      # (d_model, d_conv): last inputs
        state = cache.ssm.temporal[s, cache.slot]          # (d_model, d_state)
        window, hidden = conv_state.clone(), state.clone()
        outs = []
        for t in range(h.shape[0]):
            x_in = h[t] @ p["win"]
            window = torch.cat([window[:, 1:], x_in[:, None]], dim=1)
            u = F.silu((window * p["conv"]).sum(-1))
            hidden = p["decay"] * hidden + u[:, None] * (h[t] @ p["wb"])[None, :]
            y = hidden @ (h[t] @ p["wc"])
            outs.append((y * F.silu(h[t] @ p["wz"])) @ p["wout"])
        conv_state.copy_(window)
        state.copy_(hidden)
        return torch.stack(outs)

    def _forward(self, tokens: torch.Tensor, cache: RequestCache, pos0: int) -> torch.Tensor:
        x = self.embed[tokens]
        a = s = 0
        for i, kind in enumerate(self.cfg.layer_kinds()):
            h = _rms(x)
            if kind == "attn":
                x = x + self._attn_layer(i, a, h, cache, pos0)
                a += 1
            elif kind == "mla":
                x = x + self._mla_layer(i, a, h, cache, pos0)
                a += 1
            else:
                x = x + self._ssm_layer(i, s, h, cache)
                s += 1
            p = self.layers[i]
            x = x + F.silu(_rms(x) @ p["w1"]) @ p["w2"]
        return _rms(x[-1]) @ self.unembed

    # -- what an engine calls ------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, prompt: list[int], cache: RequestCache) -> torch.Tensor:
        """Run the prompt, filling the cache for positions 0..len-1; the next token's logits."""
        return self._forward(torch.tensor(prompt), cache, 0)

    @torch.no_grad()
    def decode(self, token: int, position: int, cache: RequestCache) -> torch.Tensor:
        """One step: ``token`` at ``position`` reads the cache of 0..position-1."""
        return self._forward(torch.tensor([token]), cache, position)

    def pages_needed(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.cfg.page_size)
