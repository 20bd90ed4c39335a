"""compressed-tensors pack-quantized INT4 (symmetric, group-wise), as written in Kimi K2-Thinking / K2.5 / K2.6.

    u = q + 8                      (q in [-8, 7]; K2 QAT codes only use [-7, 7])
    word[r, j] = sum_i u[r, 8j+i] << (4*i)     low nibble first, 8 codes per int32, along the input dim
    W[r, k] = q[r, k] * scale[r, k // group]

numpy only, so the independent reference (ref_numpy.py) can share it without torch.
"""
import numpy as np


def pack_int4(q):
    """q: int array [out, in] with values in [-8, 7], in % 8 == 0 -> int32 [out, in/8]."""
    q = np.asarray(q)
    out, k = q.shape
    if k % 8:
        raise ValueError(f"pack_int4: in={k} is not a multiple of 8")
    if q.min() < -8 or q.max() > 7:
        raise ValueError("pack_int4: codes outside [-8, 7]")
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(out, k // 8, 8)
    word = np.zeros((out, k // 8), dtype=np.uint32)
    for i in range(8):
        word |= u[:, :, i] << np.uint32(4 * i)
    return word.view(np.int32)


def unpack_int4(packed, in_features):
    """int32 [out, in/8] -> int8 codes q [out, in]."""
    w = np.asarray(packed).view(np.uint32)
    out = w.shape[0]
    u = np.empty((out, w.shape[1], 8), dtype=np.int16)
    for i in range(8):
        u[:, :, i] = (w >> np.uint32(4 * i)) & np.uint32(0xF)
    return (u.reshape(out, -1)[:, :in_features] - 8).astype(np.int8)


def dequant_int4(packed, scale, shape, group):
    """-> float64 [out, in] = q * scale (scale given as float array [out, in/group])."""
    out, k = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, k).astype(np.float64)
    s = np.asarray(scale, dtype=np.float64)
    if s.shape != (out, k // group):
        raise ValueError(f"dequant_int4: scale shape {s.shape}, expected {(out, k // group)}")
    return q * np.repeat(s, group, axis=1)
