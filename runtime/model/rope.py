"""Rotary position embeddings for arbitrary per-token positions.

Owner: the model runner. Positions are whatever the caller wrote (``Forward.input_at``, docs/sdk.md):
they need not be contiguous, increasing or unique, so cos/sin are computed from the
position values of each forward (once per forward, shared by every layer), never from a
token's index in the sequence.

The inverse frequencies follow transformers' ``modeling_rope_utils`` exactly (same fp32
arithmetic), so our rotations match the HF oracle bit-for-bit on the same device:

* default: ``inv_freq[i] = 1 / theta ** (2i / head_dim)``;
* ``linear``: ``inv_freq / factor``;
* ``llama3``: low frequencies divided by ``factor``, high frequencies kept, a smooth
  interpolation in between (Llama 3.1).
"""

from __future__ import annotations

import math

import torch

from runtime.model.config import ModelConfig

__all__ = ["inv_freq_for", "RotaryEmbedding", "apply_rotary"]


def inv_freq_for(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, fp32 on CPU.

    Args:
        config: the model config (``head_dim``, ``rope_theta``, ``rope_scaling``).

    Returns:
        Tensor[head_dim // 2] (float32).
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq  # [D/2]
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise RuntimeError(f"rope_type {rope_type!r} passed config validation but has no rule")


_BLOCK = 64  # positions of one cos/sin table (64 x head_dim values: one layout, one thread)
_MAX_BLOCKS = 4096  # tables kept (~260k positions); more: start over
_FEW = 16  # positions a forward looked up in Python (a decode step's), not with tensor ops


class RotaryEmbedding:
    """cos/sin tables for one forward, from explicit positions.

    Args:
        config: the model config.
        device: where the forward runs.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = inv_freq_for(config).to(device)  # [D/2] fp32
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # CPU: see cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables for these positions.

        Args:
            positions: Tensor[T] (int64) rotary position of each new token.
            dtype: the model's compute dtype.

        Returns:
            (cos, sin), each Tensor[T, 1, head_dim] in ``dtype`` (the 1 broadcasts over heads).
        """
        if positions.device.type == "cpu":
            cos, sin = self._from_blocks(positions)
        else:  # (no host sync: CUDA graphs capture this)
            cos, sin = self._rows(positions.to(torch.float32))
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()

    def _from_blocks(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [T, D] looked up in tables of ``_BLOCK`` positions, each computed
        alone: torch's vectorized cos/sin take another path for the tail of a call (and
        split long ones over the threads), so a position's value computed among others
        would depend on how many there were and where it sat (docs/performance.md,
        "Deterministic numerics")."""
        if 0 < positions.numel() <= _FEW:  # a decode: no unique / searchsorted / cat
            firsts = positions.tolist()
            b = firsts[0] // _BLOCK
            if all(p // _BLOCK == b for p in firsts):
                table = self._table(b)
                lo = firsts[0] - b * _BLOCK
                if firsts == list(range(firsts[0], firsts[0] + len(firsts))):
                    return table[0][lo: lo + len(firsts)], table[1][lo: lo + len(firsts)]
                rows = positions - b * _BLOCK
                return table[0].index_select(0, rows), table[1].index_select(0, rows)
        blocks = torch.div(positions, _BLOCK, rounding_mode="floor")
        wanted = blocks.unique()  # sorted
        tables = [self._table(b) for b in wanted.tolist()]
        rows = torch.searchsorted(wanted, blocks) * _BLOCK + (positions - blocks * _BLOCK)
        if len(tables) == 1:
            return tables[0][0].index_select(0, rows), tables[0][1].index_select(0, rows)
        return (torch.cat([t[0] for t in tables]).index_select(0, rows),
                torch.cat([t[1] for t in tables]).index_select(0, rows))


    def _table(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables [_BLOCK, D] of positions ``b * _BLOCK`` on (made once)."""
        table = self._blocks.get(b)
        if table is None:
            if len(self._blocks) >= _MAX_BLOCKS:
                self._blocks.clear()
            start = b * _BLOCK
            table = self._blocks[b] = self._rows(torch.arange(
                start, start + _BLOCK, dtype=torch.int64).to(torch.float32))
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query or key heads (the "rotate half" convention of HF Llama/Qwen).

    Args:
        x: Tensor[T, heads, D].
        cos: Tensor[T, 1, D].
        sin: Tensor[T, 1, D].

    Returns:
        Tensor[T, heads, D].
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, D]
    return x * cos + rotated * sin
