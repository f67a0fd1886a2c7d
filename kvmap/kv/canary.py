"""The KV canary: the value every (token id, position, lane) writes into the paged KV cache, defined once.

Rules:
- `canary_value` is the spec: lowbias32 of a mix of token, position and lane, in plain integers. The numpy
  (`canary`), torch (`canary_torch`), numba (kv/kernels.py) and Triton (workers/triton_worker.py) forms use
  the constants below and are tested bit for bit against it (tests/test_kv_cache.py).
- The cache stores the low bits of the value through an integer view of its dtype, so a read-back tells
  exactly which token and position a slot holds whatever the element type (NaN patterns included).
"""

from __future__ import annotations

import numpy as np

MUL_TOKEN = 0x9E3779B1
MUL_POSITION = 0x85EBCA77
MUL_LANE = 0xC2B2AE3D
MIX_1 = 0x7FEB352D
MIX_2 = 0x846CA68B
MASK_32 = 0xFFFFFFFF


def canary_value(token: int, position: int, lane: int) -> int:
    """The spec: one 32-bit value."""
    x = ((token * MUL_TOKEN) & MASK_32) ^ ((position * MUL_POSITION) & MASK_32)
    x = (x + lane * MUL_LANE) & MASK_32
    x ^= x >> 16
    x = (x * MIX_1) & MASK_32
    x ^= x >> 15
    x = (x * MIX_2) & MASK_32
    x ^= x >> 16
    return x


_M = np.uint32


def canary(token_ids: np.ndarray, positions: np.ndarray, lanes: int) -> np.ndarray:
    """[n] token ids, [n] positions -> [n, lanes] uint32 (uint32 arithmetic wraps like the spec's masks)."""
    x = token_ids.astype(_M) * _M(MUL_TOKEN) ^ positions.astype(_M) * _M(MUL_POSITION)
    x = x[:, None] + np.arange(lanes, dtype=_M)[None, :] * _M(MUL_LANE)
    x ^= x >> _M(16)
    x *= _M(MIX_1)
    x ^= x >> _M(15)
    x *= _M(MIX_2)
    x ^= x >> _M(16)
    return x


def canary_torch(token_ids, positions, lanes: int):
    """`canary` in torch int64 arithmetic (any device): [n] token ids, [n] positions -> [n, lanes]."""
    from kvmap._torch import torch

    t = torch()
    m = MASK_32
    x = ((token_ids.to(t.int64) * MUL_TOKEN) & m) ^ ((positions.to(t.int64) * MUL_POSITION) & m)
    x = (x[:, None] + t.arange(lanes, dtype=t.int64, device=x.device)[None, :] * MUL_LANE) & m
    x ^= x >> 16
    x = (x * MIX_1) & m
    x ^= x >> 15
    x = (x * MIX_2) & m
    x ^= x >> 16
    return x
