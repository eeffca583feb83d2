"""The decode step's sampling in two launches: temperature, the exponential race with each request's own
counter-based noise (`rollout.noise`), the first argmax for greedy rows, and the chosen token's log-prob.

The torch path (`rollout.sampler`) upcasts the logits, materializes log_softmax [B, V] in fp32, takes an
argmax, and draws noise per seeded row: at batch 256 on k3-small's 164k vocabulary about 0.3 ms of device
time a step, and one generator launch per row (512 host launches a step in a GRPO rollout). Here each row is
read once, in its own dtype.

Contract of `sample_rows(logits, temps, keys)`:
- logits [B, V] (fp32 / bf16 / fp16, unit column stride); temps fp32 [B] on the device: a row's temperature,
  0 for a greedy row; keys int64 [2, B] on the device: each row's seed and the position of the token it
  draws (`rollout.noise.row_keys`' inputs).
- -> (tokens int64 [B], log-probs fp32 [B]). A greedy row takes the first argmax of its logits; a sampled
  row the first argmax of z / T - log(E) with E = `rollout.noise.exponentials` (the race argmax p / E in log
  form, the same words bit for bit). The log-prob is log_softmax(z / T) at the token, T = 1 for greedy
  rows, computed in fp32 with an online log-sum-exp (within a few ulps of torch's log_softmax).
No truncation (top-k / top-p) and no alternatives (top log-probs, given ids' log-probs): the sampler sends
those rows through its torch path, whose one log-softmax gives both the token's log-prob and the alternatives.

Each row is split over up to `splits` programs (enough programs to fill the device at small batches); a
second kernel combines the splits' running max, sum, best score and index per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout import noise

# the hash's constants as the kernels may read them (jit functions see module globals only as constexpr)
MIX_1, MIX_2 = tl.constexpr(noise.MIX_1), tl.constexpr(noise.MIX_2)
SEED_SALT, KEY_SALT = tl.constexpr(noise.SEED_SALT), tl.constexpr(noise.KEY_SALT)

BLOCK = 1024  # vocabulary entries a program reads per iteration
TARGET_PROGRAMS = 1024  # about eight per SM on an H200: split rows until the batch has this many programs


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * MIX_1
    x = x ^ (x >> 15)
    x = x * MIX_2
    return x ^ (x >> 16)


@triton.jit
def _partial(
    logits_ptr,
    stride,
    temps_ptr,
    keys_ptr,
    m_ptr,
    s_ptr,
    best_ptr,
    arg_ptr,
    B,
    V,
    per_split,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    seed = tl.load(keys_ptr + row)
    position = tl.load(keys_ptr + B + row)
    s0 = _mix(_mix((seed & 0xFFFFFFFF).to(tl.uint32) ^ SEED_SALT) ^ (seed >> 32).to(tl.uint32))
    a = _mix(s0 ^ (position & 0xFFFFFFFF).to(tl.uint32))
    b = _mix(a ^ KEY_SALT)
    # running state per lane, reduced across lanes once at the end (a block-wide reduction per tile would
    # synchronize the program four times a tile): max and sum of exp for the log-sum-exp, and the best race
    # score with its index (a lane meets its entries in increasing index, so a strict > keeps the first)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], tl.int32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, V)
    for start in range(lo, hi, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < hi
        z = tl.load(logits_ptr + row * stride + i, mask=ok, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, z)
        # (-inf) - (-inf) is NaN: a lane with no finite logit yet keeps s = 0
        grown = tl.where(m == m_new, s, s * tl.exp(m - m_new)) + tl.where(z == m_new, 1.0, tl.exp(z - m_new))
        s = tl.where(ok & (m_new > float("-inf")), grown, s)
        m = m_new
        score = z
        if not greedy:  # the noise costs more than the row's read: greedy rows skip it
            h = _mix(_mix(a ^ i.to(tl.uint32)) ^ b)
            u = ((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
            score = z - tl.log(-tl.log(u))
        take = ok & (score > best)
        arg = tl.where(take, i, arg)
        best = tl.where(take, score, best)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(s > 0, s * tl.exp(m - top), 0.0), axis=0)
    win = tl.max(best, axis=0)
    first = tl.min(tl.where(best == win, arg, V), axis=0)  # the first index among equal maxima
    out = row * SPLITS + split
    tl.store(m_ptr + out, top)
    tl.store(s_ptr + out, total)
    tl.store(best_ptr + out, win)
    tl.store(arg_ptr + out, first.to(tl.int64))


@triton.jit
def _combine(
    logits_ptr, stride, temps_ptr, m_ptr, s_ptr, best_ptr, arg_ptr, tokens_ptr, logps_ptr, SPLITS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SPLITS)
    m = tl.load(m_ptr + row * SPLITS + j)
    s = tl.load(s_ptr + row * SPLITS + j)
    best = tl.load(best_ptr + row * SPLITS + j)
    arg = tl.load(arg_ptr + row * SPLITS + j)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(s > 0, s * tl.exp(m - top), 0.0), axis=0)
    pick = tl.argmax(best, axis=0)  # splits are in vocabulary order: the first split keeps a tie
    token = tl.sum(tl.where(j == pick, arg, 0), axis=0)
    temp = tl.load(temps_ptr + row)
    temp = tl.where(temp == 0.0, 1.0, temp)
    z = tl.load(logits_ptr + row * stride + token).to(tl.float32) / temp
    tl.store(tokens_ptr + row, token)
    tl.store(logps_ptr + row, z - (top + tl.log(total)))


def splits_for(batch: int, vocab: int) -> int:
    """Programs per row: enough to give the device `TARGET_PROGRAMS`, at most one per BLOCK, a power of two."""
    want = min(-(-TARGET_PROGRAMS // max(batch, 1)), triton.cdiv(vocab, BLOCK))
    return triton.next_power_of_2(max(want, 1))


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], temps fp32 [B], keys int64 [2, B] -> (tokens int64 [B], log-probs fp32 [B]) (module
    docstring)."""
    b, v = logits.shape
    assert logits.stride(1) == 1 and temps.shape == (b,) and keys.shape == (2, b) and keys.dtype == torch.int64
    splits = splits_for(b, v)
    per_split = triton.cdiv(triton.cdiv(v, splits), BLOCK) * BLOCK
    dev = logits.device
    m, s, best = (torch.empty(b, splits, dtype=torch.float32, device=dev) for _ in range(3))
    arg = torch.empty(b, splits, dtype=torch.int64, device=dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logps = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logps
    _partial[(b, splits)](
        logits,
        logits.stride(0),
        temps,
        keys,
        m,
        s,
        best,
        arg,
        b,
        v,
        per_split,
        SPLITS=splits,
        BLOCK=min(BLOCK, triton.next_power_of_2(v)),
        num_warps=4,
    )
    _combine[(b,)](logits, logits.stride(0), temps, m, s, best, arg, tokens, logps, SPLITS=splits, num_warps=1)
    return tokens, logps
