"""Independent fp32 reference for the GPTQ INT4 ops, and a packer to build checkpoints by hand.

Written from the layout description, not from kdsl: nothing here imports kdsl (in particular
not kdsl.ops.fallback or kdsl.ops.gptq), so a shared mistake cannot make a wrong kernel look right.

    qweight  int32 [K / 8, N]   word (r, n) holds q[8r + j, n] in bits 4j .. 4j + 3, j = 0..7
    qzeros   int32 [G, N / 8]   word (g, c) holds z[g, 8c + j] in bits 4j .. 4j + 3
    scales   [G, N]             fp16 or bf16
    g_idx    int32 [K]          group of each input row (k // group_size unless act-order)

    w[k, n] = (q[k, n] - zero[g_idx[k], n]) * s[g_idx[k], n]
        zero = stored + 1 for checkpoint_format "gptq", stored for "gptq_v2"
    y = x.float() @ w           (fp32)

The unpacking works on the bits of each word one nibble position at a time, on int64 copies
of the words (so the sign bit of an int32 word is just bit 31, never an arithmetic-shift
artefact); the packer builds each word as an unsigned sum and reinterprets it as int32.
"""
from __future__ import annotations

import torch

NIBBLES = 8  # 4-bit values per int32 word
NIBBLE_MASK = 0xF
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


# ----------------------------------------------------------------------------------------------
# bits


def _as_unsigned_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 holding the same 32 bits as a value in [0, 2**32)."""
    assert packed.dtype == torch.int32, f"packed words must be int32, got {packed.dtype}"
    words = packed.to(torch.int64)
    return torch.where(words < 0, words + (1 << 32), words)


def _as_signed_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bit pattern."""
    if words.numel():
        assert int(words.min()) >= 0 and int(words.max()) < (1 << 32), "words must fit in 32 bits"
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def unpack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> int64 [K, N] in 0..15; row k comes from nibble k % 8 of word row k // 8."""
    words = _as_unsigned_words(qweight)
    rows, n = words.shape
    q = torch.empty((rows * NIBBLES, n), dtype=torch.int64, device=qweight.device)
    for j in range(NIBBLES):
        q[j::NIBBLES] = (words // (1 << (4 * j))) % 16
    return q


def unpack_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """int32 [G, N / 8] -> int64 [G, N] in 0..15 (the stored values); column n from nibble n % 8."""
    words = _as_unsigned_words(qzeros)
    groups, cols = words.shape
    z = torch.empty((groups, cols * NIBBLES), dtype=torch.int64, device=qzeros.device)
    for j in range(NIBBLES):
        z[:, j::NIBBLES] = (words // (1 << (4 * j))) % 16
    return z


def pack_qweight(q: torch.Tensor) -> torch.Tensor:
    """Integers [K, N] in 0..15 -> int32 [K / 8, N], q[k] in bits 4 * (k % 8) of word row k // 8."""
    k, n = q.shape
    assert k % NIBBLES == 0, f"K = {k} must be a multiple of 8"
    q = q.to(torch.int64)
    assert q.numel() == 0 or (int(q.min()) >= 0 and int(q.max()) <= NIBBLE_MASK), "values must lie in 0..15"
    words = torch.zeros((k // NIBBLES, n), dtype=torch.int64, device=q.device)
    for j in range(NIBBLES):
        words += q[j::NIBBLES] * (1 << (4 * j))
    return _as_signed_int32(words)


def pack_qzeros(z: torch.Tensor) -> torch.Tensor:
    """Stored zeros [G, N] in 0..15 -> int32 [G, N / 8], z[:, n] in bits 4 * (n % 8) of word column n // 8."""
    g, n = z.shape
    assert n % NIBBLES == 0, f"N = {n} must be a multiple of 8"
    z = z.to(torch.int64)
    assert z.numel() == 0 or (int(z.min()) >= 0 and int(z.max()) <= NIBBLE_MASK), "values must lie in 0..15"
    words = torch.zeros((g, n // NIBBLES), dtype=torch.int64, device=z.device)
    for j in range(NIBBLES):
        words += z[:, j::NIBBLES] * (1 << (4 * j))
    return _as_signed_int32(words)


# ----------------------------------------------------------------------------------------------
# reference maths


def num_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else k // group_size


def default_g_idx(k: int, group_size: int, device="cpu") -> torch.Tensor:
    rows = torch.arange(k, dtype=torch.int32, device=device)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def dequant_ref(qweight, qzeros, scales, g_idx=None, *, group_size: int = 128, checkpoint_format: str = "gptq"):
    """fp32 [K, N]: w[k, n] = (q[k, n] - zero[g_idx[k], n]) * s[g_idx[k], n]."""
    q = unpack_qweight(qweight)
    zero = unpack_qzeros(qzeros) + ZERO_OFFSET[checkpoint_format]
    k = q.shape[0]
    groups = (g_idx if g_idx is not None else default_g_idx(k, group_size, q.device)).long()
    # (q - z) is an integer in -16..15 and s an fp16/bf16 value: the fp32 product is exact.
    return (q - zero[groups]).to(torch.float32) * scales.to(torch.float32)[groups]


def gemm_ref(x, qweight, qzeros, scales, g_idx=None, *, group_size: int = 128, checkpoint_format: str = "gptq"):
    """fp32 [..., N] = x.float() @ dequant_ref(...)."""
    w = dequant_ref(qweight, qzeros, scales, g_idx, group_size=group_size, checkpoint_format=checkpoint_format)
    return x.float() @ w


def rel_fro_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F in fp64 (0 when both are empty)."""
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------
# hand-made checkpoints


def make_checkpoint(
    k: int, n: int, *, group_size: int = 128, checkpoint_format: str = "gptq", sym: bool = False,
    g_idx: str = "default", scale_dtype: torch.dtype = torch.float16, scale: float = 0.01,
    device="cpu", generator: torch.Generator | None = None,
) -> dict:
    """A random checkpoint built from integer tensors, not by any quantizer.

    q: uniform in 0..15. Real zeros: 8 everywhere when sym; otherwise uniform in 1..15 for
    "gptq" (stored as zero - 1, i.e. 0..14) and uniform in 0..15 for "gptq_v2" (stored as is).
    scales: positive, uniform in [0.5, 1.5) * scale, rounded to scale_dtype.
    g_idx: "default" (k // group_size), "none" (None: the op's default), "perm" (act-order:
    a random permutation of arange(K), then // group_size), "random" (any group per row).

    Returns the checkpoint tensors ("qweight", "qzeros", "scales", "g_idx") and the integers
    they were built from ("q" [K, N], "zero" [G, N] real zeros, "stored_zero" [G, N]).
    """
    groups = num_groups(k, group_size)
    size = k if group_size == -1 else group_size
    gen_device = generator.device if generator is not None else device

    def randint(low, high, shape):
        return torch.randint(low, high, shape, generator=generator, device=gen_device).to(device)

    q = randint(0, 16, (k, n))
    if sym:
        zero = torch.full((groups, n), 8, dtype=torch.int64, device=device)
    elif checkpoint_format == "gptq":
        zero = randint(1, 16, (groups, n))
    else:
        zero = randint(0, 16, (groups, n))
    stored = zero - ZERO_OFFSET[checkpoint_format]
    s = torch.rand((groups, n), generator=generator, device=gen_device).to(device)
    scales = ((s + 0.5) * scale).to(scale_dtype)

    if g_idx == "none":
        groups_of_rows = None
    elif g_idx == "default":
        groups_of_rows = default_g_idx(k, group_size, device)
    elif g_idx == "perm":
        perm = torch.randperm(k, generator=generator, device=gen_device).to(device)
        groups_of_rows = (perm // size).to(torch.int32)
    elif g_idx == "random":
        groups_of_rows = randint(0, groups, (k,)).to(torch.int32)
    else:
        raise ValueError(f"g_idx mode {g_idx!r}")
    return {
        "qweight": pack_qweight(q), "qzeros": pack_qzeros(stored), "scales": scales, "g_idx": groups_of_rows,
        "q": q, "zero": zero, "stored_zero": stored,
    }


def integer_weight(ckpt: dict) -> torch.Tensor:
    """int64 [K, N] = q - zero[g_idx[k]] from the integers a hand-made checkpoint was built from."""
    q = ckpt["q"]
    k = q.shape[0]
    groups = ckpt["g_idx"]
    if groups is None:
        groups = default_g_idx(k, -1 if ckpt["zero"].shape[0] == 1 else k // ckpt["zero"].shape[0], q.device)
    return q - ckpt["zero"][groups.long()]
