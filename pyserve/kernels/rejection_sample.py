"""Speculative verification: accept or reject each request's draft tokens against the target
distribution, then sample the one token that follows.

Layouts (R verification rows in all, B requests; request b owns rows cu_num_rows[b] up to
cu_num_rows[b + 1], at least one row: its k drafts' rows, then the bonus row):
  target_probs:    f32 [R, V], the target's sampling distribution at each row (one-hot for greedy)
  draft_probs:     f32 [R, V] the distribution each draft token was drawn from, or None when the
                   drafts were chosen deterministically (n-gram lookup): q is then one-hot
  draft_token_ids: int64 [R], the draft token each row verifies (ignored on bonus rows)
  seeds, positions: int64 [R], the key of each row's random numbers (kernels.keyed_noise): the
                   uniform u is the key's number at index V, the Exp(1) noise of token v is
                   -log of its number at index v; the kernel computes them in place
  coupled:         int32 [B], 1 for a request verified by its own race (below)
  cu_num_rows:     int32 [B + 1]
Outputs: output_token_ids int64 [R] (request b's accepted drafts, then one sampled token, then
-1 padding) and num_output int32 [B] (accepted + 1).

Rule (exact rejection sampling): draft j is accepted iff u_j * q_j(d_j) < p_j(d_j) (probability
min(1, p/q)) and every draft before it was. At the first rejection the token is drawn from
max(0, p - q) renormalised; if all drafts pass, from p at the bonus row. Draws are exponential
races, argmax(w / noise), which sample in proportion to w without normalising. A residual with no
mass left (p == q up to rounding) falls back to p. With greedy target rows this is exactly "keep
drafts while they equal the argmax". A coupled request (a seeded one, keyed by its seed and each
row's token index) instead keeps its drafts while they equal its race's pick argmax(p / noise) at
their row, and takes the pick at the first that does not: the token plain sampling would draw
there, so its output does not depend on how many drafts a step verified. A draft id outside
[0, V) is rejected (and adds nothing to q's one-hot).
"""

import torch
import triton
import triton.language as tl

from pyserve.kernels._checks import check_shape, check_tensor
from pyserve.kernels._launch import launch
from pyserve.kernels.keyed_noise import keyed_exponential_rows, keyed_uniform, keyed_uniform_tl


@triton.jit
def _race(p_ptr, q_ptr, r, stride_p, stride_q, d, seed, pos, vocab_size, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row r's races with its keyed noise: (argmax of max(p - q, 0) / noise, argmax of p / noise,
    the residual's mass)."""
    best_res = -1.0
    arg_res = 0
    best_p = -1.0
    arg_p = 0
    mass = 0.0
    for off in range(0, vocab_size, BLOCK_V):
        idx = off + tl.arange(0, BLOCK_V)
        mask = idx < vocab_size
        p = tl.load(p_ptr + r * stride_p + idx, mask=mask, other=0.0)
        if HAS_Q:
            q = tl.load(q_ptr + r * stride_q + idx, mask=mask, other=0.0)
        else:
            q = (idx == d).to(tl.float32)
        w = tl.maximum(p - q, 0.0)
        noise = -tl.log(keyed_uniform_tl(seed, pos, idx.to(tl.int64)))
        mass += tl.sum(w, axis=0)
        s_res = tl.where(mask, w / noise, -1.0)
        s_p = tl.where(mask, p / noise, -1.0)
        m_res = tl.max(s_res, axis=0)
        m_p = tl.max(s_p, axis=0)
        a_res = tl.argmax(s_res, axis=0) + off
        a_p = tl.argmax(s_p, axis=0) + off
        arg_res = tl.where(m_res > best_res, a_res, arg_res)
        best_res = tl.maximum(m_res, best_res)
        arg_p = tl.where(m_p > best_p, a_p, arg_p)
        best_p = tl.maximum(m_p, best_p)
    return arg_res, arg_p, mass


@triton.jit
def _rejection_sample_kernel(
    p_ptr, q_ptr, draft_ptr, seeds_ptr, positions_ptr, coupled_ptr, cu_ptr, out_ptr, num_out_ptr,
    vocab_size, stride_p, stride_q,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per request: count the leading accepted drafts, then race over the vocabulary
    for the final token (residual and plain p at once), then write the request's row outputs."""
    b = tl.program_id(0)
    r0 = tl.load(cu_ptr + b).to(tl.int64)  # r * stride may pass 2**31
    m = tl.load(cu_ptr + b + 1) - r0
    coupled = tl.load(coupled_ptr + b)
    n_acc = 0
    still = 1
    for j in range(0, m - 1):
        r = r0 + j
        d = tl.load(draft_ptr + r)
        known = (d >= 0) & (d < vocab_size)
        seed = tl.load(seeds_ptr + r)
        pos = tl.load(positions_ptr + r)
        if coupled != 0:
            _, pick, _ = _race(p_ptr, q_ptr, r, stride_p, stride_q, d, seed, pos, vocab_size, HAS_Q, BLOCK_V)
            ok = known & (pick == d)
        else:
            p_d = tl.load(p_ptr + r * stride_p + d, mask=known, other=0.0)
            if HAS_Q:
                q_d = tl.load(q_ptr + r * stride_q + d, mask=known, other=1.0)
            else:
                q_d = 1.0
            u = keyed_uniform_tl(seed, pos, vocab_size.to(tl.int64))
            ok = known & (u * q_d < p_d)
        still = still * ok.to(tl.int32)
        n_acc += still
    r = r0 + n_acc
    is_residual = (n_acc < m - 1) & (coupled == 0)
    d = tl.load(draft_ptr + r)
    arg_res, arg_p, mass = _race(p_ptr, q_ptr, r, stride_p, stride_q, d, tl.load(seeds_ptr + r),
                                 tl.load(positions_ptr + r), vocab_size, HAS_Q, BLOCK_V)
    token = tl.where(is_residual & (mass > 0.0), arg_res, arg_p).to(tl.int64)
    for j in range(0, m):
        draft = tl.load(draft_ptr + r0 + j)
        out = tl.where(j < n_acc, draft, tl.where(j == n_acc, token, -1))
        tl.store(out_ptr + r0 + j, out)
    tl.store(num_out_ptr + b, n_acc + 1)


def _check(target_probs, draft_probs, draft_token_ids, seeds, positions, coupled, cu_num_rows):
    check_tensor("target_probs", target_probs, 2, (torch.float32,))
    dev = target_probs.device
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, 2, (torch.float32,), dev)
        check_shape("draft_probs", draft_probs, target_probs.shape)
    for name, t in (("draft_token_ids", draft_token_ids), ("seeds", seeds), ("positions", positions)):
        check_tensor(name, t, 1, (torch.int64,), dev)
        check_shape(name, t, target_probs.shape[:1])
    check_tensor("cu_num_rows", cu_num_rows, 1, (torch.int32,), dev)
    if cu_num_rows.numel() < 1:
        raise ValueError("cu_num_rows must hold at least one offset (0)")
    check_tensor("coupled", coupled, 1, (torch.int32,), dev)
    check_shape("coupled", coupled, (cu_num_rows.numel() - 1,))


def rejection_sample(target_probs, draft_probs, draft_token_ids, seeds, positions, coupled, cu_num_rows):
    """Triton launcher: (output_token_ids [R] int64, num_output [B] int32)."""
    _check(target_probs, draft_probs, draft_token_ids, seeds, positions, coupled, cu_num_rows)
    num_rows, vocab = target_probs.shape
    num_reqs = cu_num_rows.numel() - 1
    out = torch.empty(num_rows, dtype=torch.int64, device=target_probs.device)
    num_out = torch.empty(num_reqs, dtype=torch.int32, device=target_probs.device)
    if num_reqs == 0:
        return out, num_out
    q = draft_probs if draft_probs is not None else target_probs  # unread when HAS_Q is False
    launch(
        _rejection_sample_kernel, (num_reqs,), (),
        p_ptr=target_probs, q_ptr=q, draft_ptr=draft_token_ids, seeds_ptr=seeds, positions_ptr=positions,
        coupled_ptr=coupled, cu_ptr=cu_num_rows, out_ptr=out, num_out_ptr=num_out,
        vocab_size=vocab, stride_p=target_probs.stride(0), stride_q=q.stride(0),
        HAS_Q=draft_probs is not None, BLOCK_V=min(1024, triton.next_power_of_2(vocab)),
    )
    return out, num_out


def keyed_noise(seeds, positions, vocab_size):
    """(u [R], noise [R, V]): the numbers the kernel computes in place for each row's key."""
    u = keyed_uniform(seeds, positions, torch.full_like(seeds, vocab_size))
    return u, keyed_exponential_rows(seeds, positions, vocab_size)


def rejection_sample_ref(target_probs, draft_probs, draft_token_ids, seeds, positions, coupled, cu_num_rows):
    """The same rule in torch, vectorised over rows and requests (the CPU serving path)."""
    _check(target_probs, draft_probs, draft_token_ids, seeds, positions, coupled, cu_num_rows)
    dev = target_probs.device
    num_rows, vocab = target_probs.shape
    uniform, noise = keyed_noise(seeds, positions, vocab)
    cu = cu_num_rows.long()
    num_reqs = cu.numel() - 1
    counts = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), counts)
    pos = torch.arange(num_rows, device=dev) - cu[:-1][req]
    is_draft = pos < (counts - 1)[req]
    known = (draft_token_ids >= 0) & (draft_token_ids < vocab)
    d = draft_token_ids.clamp(0, vocab - 1).unsqueeze(1)
    p_d = target_probs.gather(1, d).squeeze(1)
    q_d = draft_probs.gather(1, d).squeeze(1) if draft_probs is not None else torch.ones_like(p_d)
    picks = (target_probs / noise).argmax(dim=1)  # each row's race over p
    row_coupled = coupled.bool()[req]
    ok = known & torch.where(row_coupled, picks == draft_token_ids, uniform * q_d < p_d)
    stop = ~(is_draft & ok)  # first stop of a request = its final row
    first = torch.where(stop, pos, torch.full_like(pos, num_rows))
    n_acc = torch.full((num_reqs,), num_rows, dtype=torch.int64, device=dev).scatter_reduce(
        0, req, first, reduce="amin")
    final = cu[:-1] + n_acc
    p = target_probs[final]
    q = draft_probs[final] if draft_probs is not None else \
        torch.zeros_like(p).scatter_(1, d[final], known[final].unsqueeze(1).to(p.dtype))
    residual = (p - q).clamp_min_(0.0)
    use_residual = (n_acc < counts - 1) & (residual.sum(dim=1) > 0) & ~coupled.bool()
    w = torch.where(use_residual.unsqueeze(1), residual, p)
    token = (w / noise[final]).argmax(dim=1)
    out = torch.where(pos < n_acc[req], draft_token_ids, torch.full_like(draft_token_ids, -1))
    out[final] = token
    return out, (n_acc + 1).to(torch.int32)
