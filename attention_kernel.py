"""
The single attention entry point of bam-gpt.

    out = attention(q, k, v, *, doc_start=None, prior=None, row_scale=None,
                    scale_prior=False, q_offset=None, softmax_scale=None, impl="auto")

For query position i and key position j (0-based, d = j - i <= 0 under the causal mask):

    l_ij = softmax_scale * q_i . k_j                        content score, softmax_scale = 1/sqrt(head_dim)
    B(d)                                                    the positional log-prior of each head (priors.py)
    s_ij = (l_ij + B(d)) * r_i     if scale_prior             BAM + SSMax: the prior is scaled too
         =  l_ij * r_i + B(d)      otherwise                  ALiBi + SSMax, and every variant without SSMax (r = 1)
    key j is visible to query i iff doc_start[i] <= j <= i    causal AND same-document
    out_i = sum_j softmax_j(s_ij) v_j

The logit is "log likelihood of the content match + log prior of the distance", so the softmax is the
posterior over which key to read (the paper's reading). prior is None (NoPE, a uniform prior), a
priors.BoundPrior (a registered prior with one layer's (H,) parameters), or a bare GGD triple
(theta_alpha, theta_beta, theta_mu) of (H,) tensors: B(d) = -exp(theta_alpha) (|d - mu| + 1e-5)^theta_beta.

Shapes: q (B, H, Tq, D); k, v (B, H, Tk, D) with Tq <= Tk; query t sits at absolute position q_offset + t
(default Tk - Tq, i.e. the queries are the last Tq positions). doc_start is (B, Tk) int: the first position
of the document that each position belongs to. row_scale is (B or 1, H, Tq). Everything is differentiable:
q, k, v, the prior's parameters, row_scale.

Implementations (impl), none of which ever substitutes one prior for another: an impl that cannot compute the
given prior raises.
  "torch"   the plain-PyTorch reference below, for every prior: it loops over query chunks and only ever
            materialises a (chunk x Tk) score block, so memory is linear in the length.
  "cpu"     CPU training, every prior: the reference's math with a hand-written backward (query blocks that skip
            the keys causality hides, the prior read as a view of its table and its gradient summed per distance).
  "triton"  the Triton flash-attention kernel below: no T x T tensor at all, but only for the priors whose form
            it hard-codes (none, ggd, alibi: a prior whose `native` set names "triton").
  "flex"    FlexAttention (compiled), for every prior: score_mod reads the prior's table over the distances, a
            block mask skips hidden tiles. The fused GPU path for priors the kernel does not hard-code; on the CPU
            forward only (FlexAttention has no CPU backward in torch 2.13).
  "sdpa"    CPU, every prior: PyTorch's fused SDPA kernel with the prior as a float attn_mask (below), chunked
            over queries like the reference; gradients only where that mask needs none (not for a trained prior).
  "auto"    the fastest impl that computes the prior: on CUDA Triton if the prior is native to it, else Flex; on
            the CPU "sdpa" without gradients (evaluation), "cpu" with them (auto_impl says why).
"""
import contextlib
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# alibi_slopes and ggd_prior are re-exported: `from attention_kernel import alibi_slopes` keeps working
from priors import GGD_EPS, BoundPrior, alibi_slopes, bind, ggd_mu, ggd_prior  # noqa: F401

IMPLS = ("auto", "torch", "cpu", "flex", "triton", "sdpa")


# ----------------------------------------------------------------------------------------------------------
# Reference implementation (CPU, tests, and any prior)
# ----------------------------------------------------------------------------------------------------------
def _chunk_rows(batch, heads, n_keys, budget_bytes=256 * 2**20):
    # ~4 fp32 temporaries of shape (B, H, rows, n_keys) are alive at once (scores, bias, mask fill, probs)
    return max(1, budget_bytes // (16 * batch * heads * max(n_keys, 1)))


def _neg_inf_where(hidden):
    # adding a 0 / -inf tensor is several times faster on CPU than masked_fill_ with a broadcast boolean mask
    return torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))


def _hidden(qpos, kpos, ds):
    """Whether key j is hidden from query i: j > i, or j before the query's document start ds (B, rows). (rows, keys),
    or (B, 1, rows, keys) with documents."""
    hidden = kpos[None, :] > qpos[:, None]
    if ds is not None:
        hidden = (hidden | (kpos[None, None, :] < ds[:, :, None]))[:, None]
    return hidden


def _mask_invisible(s, qpos, kpos, ds):
    """Set s[..., i, j] = -inf where key j is not visible to query i: j > i, or j before doc start ds (B, rows).
    Without autograd, in place and only on the columns that can be hidden (the causal diagonal block, and keys
    before the chunk's latest document start): at long lengths that is a sliver of the block. Under autograd one
    addition of a 0 / -inf tensor over the block is cheaper than in-place writes into slices (which add a
    CopySlices pass)."""
    if s.requires_grad:
        return s + _neg_inf_where(_hidden(qpos, kpos, ds))  # the same values and gradients as masked_fill, faster
    c = int(qpos[0] - kpos[0])
    s[..., c:].masked_fill_(kpos[None, c:] > qpos[:, None], float("-inf"))
    if ds is not None and (c := int(ds.max() - kpos[0])) > 0:
        s[..., :c].masked_fill_((kpos[None, None, :c] < ds[:, :, None])[:, None], float("-inf"))
    return s


def _bias_table(prior, dmin, dmax, device):
    """The log-prior at every distance dmin..dmax (inclusive): (H, dmax - dmin + 1) float32. The prior depends
    only on d = j - i, so evaluating it once per distinct distance and gathering is much cheaper than per pair."""
    return prior.table(torch.arange(dmin, dmax + 1, device=device))


def _chunk_scores(q, k, a, b, lo, q_offset, *, doc_start, prior, row_scale, scale_prior, softmax_scale):
    """The final masked scores s of queries a..b-1 against keys lo..(q_offset + b - 1): (B, H, b - a, keys) fp32."""
    i0, i1 = q_offset + a, q_offset + b  # absolute positions of the chunk's queries: [i0, i1)
    qpos = torch.arange(i0, i1, device=q.device)
    kpos = torch.arange(lo, i1, device=q.device)
    s = torch.matmul(q[:, :, a:b].float(), k[:, :, lo:i1].float().transpose(-1, -2)).mul_(softmax_scale)
    # In-place updates of the fresh score block save one (B, H, rows, keys) allocation each: add_ is always
    # safe under autograd (its backward needs no values); mul_ only when row_scale needs no gradient.
    if prior is not None:
        dmin = lo - (i1 - 1)
        bias = _bias_table(prior, dmin, i1 - 1 - i0, q.device)[:, kpos[None, :] - qpos[:, None] - dmin]
        if row_scale is None or scale_prior:
            s.add_(bias)
    if row_scale is not None:
        r = row_scale[:, :, a:b, None].float()
        s = s * r if r.requires_grad and torch.is_grad_enabled() else s.mul_(r)
        if prior is not None and not scale_prior:
            s.add_(bias)
    return _mask_invisible(s, qpos, kpos, None if doc_start is None else doc_start[:, i0:i1])


def _offset_and_scale(q, k, q_offset, softmax_scale):
    """attention()'s defaults resolved: q_offset = Tk - Tq (the queries are the last positions), softmax_scale =
    1 / sqrt(head_dim)."""
    return (k.shape[2] - q.shape[2] if q_offset is None else int(q_offset),
            1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale))


def _query_chunks(q, k, doc_start, q_offset, softmax_scale, chunk_size):
    """(q_offset, softmax_scale, [(a, b, lo)]): query chunks a..b-1 and the first key lo any of them can see; the
    defaults of q_offset and softmax_scale resolved. Shared by the reference, "cpu" and "sdpa"."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    q_offset, softmax_scale = _offset_and_scale(q, k, q_offset, softmax_scale)
    chunk = chunk_size or _chunk_rows(B, H, Tk)
    chunks = []
    for a in range(0, Tq, chunk):
        b = min(a + chunk, Tq)
        # lo skips keys before the chunk's earliest document start
        lo = int(doc_start[:, q_offset + a:q_offset + b].min()) if doc_start is not None else 0
        chunks.append((a, b, lo))
    return q_offset, softmax_scale, chunks


def attention_torch(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
                    q_offset=None, softmax_scale=None, chunk_size=None):
    """Plain-PyTorch attention with the contract above, chunked over queries (peak memory O(chunk x Tk))."""
    prior = bind(prior)
    q_offset, softmax_scale, chunks = _query_chunks(q, k, doc_start, q_offset, softmax_scale, chunk_size)
    outs = []
    for a, b, lo in chunks:
        s = _chunk_scores(q, k, a, b, lo, q_offset, doc_start=doc_start, prior=prior, row_scale=row_scale,
                    scale_prior=scale_prior, softmax_scale=softmax_scale)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, v[:, :, lo:q_offset + b].float()).to(q.dtype))
    return torch.cat(outs, dim=2)


def attention_probs(q, k, *, doc_start=None, prior=None, row_scale=None, scale_prior=False, q_offset=None,
                    softmax_scale=None):
    """The attention weights softmax_j(s_ij) of the reference math: (B, H, Tq, Tk) float32, 0 on hidden keys.
    For inspecting a few query rows (the result is Tq x Tk); same arguments as attention()."""
    prior = bind(prior)
    q_offset, softmax_scale, chunks = _query_chunks(q, k, doc_start, q_offset, softmax_scale, None)
    B, H, Tq, _ = q.shape
    probs = torch.zeros(B, H, Tq, k.shape[2], device=q.device)
    for a, b, lo in chunks:
        s = _chunk_scores(q, k, a, b, lo, q_offset, doc_start=doc_start, prior=prior, row_scale=row_scale,
                    scale_prior=scale_prior, softmax_scale=softmax_scale)
        probs[:, :, a:b, lo:q_offset + b] = torch.softmax(s, dim=-1)
    return probs


# ----------------------------------------------------------------------------------------------------------
# CPU training path (impl="cpu"): the reference's math with a hand-written backward.
#
# Autograd through the reference keeps every intermediate of a score block and reaches the prior by scattering
# each score's gradient back through the (rows x keys) gather of its table. Written out by hand, per query block:
#   forward   q' = q * softmax_scale * r            SSMax's row scale folds into the queries: q'.k = l r
#             S = q' K^T + B rho                    rho = r when SSMax scales the prior, else 1; -inf where hidden
#             P = softmax(S),  O = P V              P is kept for the backward
#   backward  dS = P * (dP - rowsum(dP * P)),  dP = dO V^T      softmax's own fused backward
#             dq' = dS K,  dK += dS^T q',  dV += P^T dO
#             dB(d) = sum over b, i of rho_bi dS_b,i,i+d        sum_b rho dS, summed along its diagonals
#             drho_bi = sum_j dS_bij B(j - i)                   a matmul batched over (head, row)
# and autograd takes it from q' to q and r, and from the table to the prior's parameters. The (rows x keys)
# matrix B(j - i) of a block is a strided *view* of `ext`, the table repeated once per block row: row i of the
# view starts i entries earlier in its own copy (_toeplitz). Its backward is the same view: each block adds its
# sum_b rho dS into a zeroed ext-shaped buffer through it, and one sum over the rows gives dB per distance.
# Each block of CPU_BLOCK query rows stops at its last query's key and starts at its earliest document start, so
# most of the triangle that causality hides is skipped instead of computed and masked. The gradients are the
# reference's up to float rounding (tests/test_model.py); the saved P blocks make training memory O(T^2), as
# the reference's is.
# ----------------------------------------------------------------------------------------------------------
CPU_BLOCK = 64  # query rows per block: fewer rows skip more of the causal triangle, each block costs ~25 op calls


def _toeplitz(ext, rows, keys, col):
    """The (H, rows, keys) view v[h, i, j] = table[h, col - i + j] of ext (H, R, n), R >= rows copies of the
    table (H, n); needs col >= rows - 1 and col + keys <= n."""
    H, R, n = ext.shape
    return ext.as_strided((H, rows, keys), (R * n, n - 1, 1), ext.storage_offset() + col)


class _CPUAttention(torch.autograd.Function):
    """q' (= q * softmax_scale * r), k, v -> O. table: the prior at distances dmin..CPU_BLOCK - 1, (H or 1, n);
    rho: the prior's row scale (B or 1, H, Tq) or None; blocks = [(a, b, lo, i0)]: query rows a..b-1 at absolute
    positions i0.. against keys lo..i0 + b - a - 1."""

    @staticmethod
    def forward(ctx, qs, k, v, table, rho, doc_start, blocks, dmin, save):
        out, saved = torch.empty_like(qs), []
        rows_max = max(b - a for a, b, _, _ in blocks)
        ext = table[:, None, :].expand(-1, rows_max, -1).contiguous() if table is not None else None
        for a, b, lo, i0 in blocks:
            i1 = i0 + b - a
            s = torch.matmul(qs[:, :, a:b], k[:, :, lo:i1].transpose(-1, -2))
            bias = None
            if table is not None:
                bias = _toeplitz(ext, b - a, i1 - lo, lo - i0 - dmin)
                s.add_(bias) if rho is None else s.addcmul_(bias, rho[:, :, a:b, None])
            qpos, kpos = torch.arange(i0, i1, device=qs.device), torch.arange(lo, i1, device=qs.device)
            s.add_(_neg_inf_where(_hidden(qpos, kpos, None if doc_start is None else doc_start[:, i0:i1])))
            p = torch.softmax(s, dim=-1)
            out[:, :, a:b] = torch.matmul(p, v[:, :, lo:i1])
            saved.append((p, bias) if save else None)
        ctx.blocks, ctx.dmin, ctx.blocks_saved = blocks, dmin, saved
        if save:
            ctx.save_for_backward(qs, k, v, table, rho, ext)
        return out

    @staticmethod
    def backward(ctx, do):
        qs, k, v, table, rho, ext = ctx.saved_tensors
        dqs, dk, dv = torch.empty_like(qs), torch.zeros_like(k), torch.zeros_like(v)
        # (H, R, n): one table copy per block row, per head even for a table shared by the heads (summed at the end)
        dext = qs.new_zeros(qs.shape[1], *ext.shape[1:]) if ctx.needs_input_grad[3] else None
        drho = torch.zeros_like(rho) if ctx.needs_input_grad[4] else None
        for (a, b, lo, i0), (p, bias) in zip(ctx.blocks, ctx.blocks_saved):
            i1, dob = i0 + b - a, do[:, :, a:b]
            ds = torch._softmax_backward_data(torch.matmul(dob, v[:, :, lo:i1].transpose(-1, -2)), p, -1, p.dtype)
            dv[:, :, lo:i1] += torch.matmul(p.transpose(-1, -2), dob)
            dqs[:, :, a:b] = torch.matmul(ds, k[:, :, lo:i1])
            dk[:, :, lo:i1] += torch.matmul(ds.transpose(-1, -2), qs[:, :, a:b])
            if drho is not None:  # (H, rows, B, keys) @ (H, rows, keys, 1): one pass over ds
                g = torch.matmul(ds.permute(1, 2, 0, 3), bias[..., None])[..., 0].permute(2, 0, 1)
                drho[:, :, a:b] += g.sum_to_size(drho[:, :, a:b].shape)
            if dext is not None:
                view = _toeplitz(dext, b - a, i1 - lo, lo - i0 - ctx.dmin)
                if rho is None:
                    view += ds.sum(0)
                elif rho.shape[0] == 1:
                    view.addcmul_(ds.sum(0), rho[0, :, a:b, None])
                else:  # ds is not needed after this
                    view += ds.mul_(rho[:, :, a:b, None]).sum(0)
        del ctx.blocks_saved
        dtable = dext.sum(1).sum_to_size(table.shape) if dext is not None else None
        return dqs, dk, dv, dtable, drho, None, None, None, None


def attention_cpu(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
                  q_offset=None, softmax_scale=None, block_rows=CPU_BLOCK):
    """attention() with the reference's math and a hand-written backward (see above): CPU training's impl."""
    prior = bind(prior)
    q_offset, softmax_scale, chunks = _query_chunks(q, k, doc_start, q_offset, softmax_scale, block_rows)
    blocks = [(a, b, lo, q_offset + a) for a, b, lo in chunks]
    dmin = min(lo - (i0 + b - a - 1) for a, b, lo, i0 in blocks)  # the most negative distance any block sees
    table = _bias_table(prior, dmin, min(block_rows, q.shape[2]) - 1, q.device) if prior is not None else None
    scale = softmax_scale if row_scale is None else softmax_scale * row_scale[..., None].float()
    rho = row_scale.float() if row_scale is not None and scale_prior and prior is not None else None
    with torch.autocast(q.device.type, enabled=False):  # fp32 throughout, like the reference
        out = _CPUAttention.apply(q.float() * scale, k.float(), v.float(), table, rho, doc_start, blocks, dmin,
                                  needs_grad(q, k, v, prior, row_scale))
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# CPU fast path (impl="sdpa"): PyTorch's fused CPU attention kernel with the prior as a float attn_mask.
#
# Per query chunk, SSMax's row scale r_i moves into the queries, l_ij r_i = ((q_i r_i) . k_j) * softmax_scale, so
#     s_ij = l_ij r_i + M_ij,   M_ij = B(j - i) r_i  if scale_prior  else  B(j - i),   M_ij = -inf where invisible,
# which is scaled_dot_product_attention(q r, k, v, attn_mask=M): PyTorch's fused (flash) CPU kernel.
# The keys are read in reverse order (softmax does not care): then B(j - i) = rtable[i' + j'] for the chunk's row
# index i' and the reversed key index j', a Hankel matrix, i.e. a strided *view* of the reversed (H, rows + keys - 1)
# prior table that the kernel reads without a copy; causality is -inf table entries. Only a mask that depends on
# more than the distance (SSMax scaling the prior, documents) is written, into one buffer that every chunk reuses
# (a fresh allocation per chunk costs more in page faults than the kernel itself). The buffer bounds the chunk, so
# memory stays linear in the length.
# ----------------------------------------------------------------------------------------------------------
def _sdpa_chunk_rows(batch, heads, n_keys, budget_bytes=128 * 2**20):
    # one fp32 (batch, heads, rows, keys) mask buffer; the fused kernel's blocks want a few hundred rows
    return int(min(512, max(64, budget_bytes // (4 * batch * heads * max(n_keys, 1)))))


def _hankel_mask(rtable, rows, r, doc_rows, kmax, buf):
    """One chunk's float mask, (B or 1, H or 1, rows, keys), keys in reverse order (see above); a view of rtable
    when it can be. rtable: (H or 1, rows + keys - 1), entry u for distance d = rows - 1 - u; r: (B or 1, H, rows, 1)
    row scales when they scale the prior, else None; doc_rows: (B, rows) document starts or None; kmax: the
    position of the first (reversed) key."""
    H, n = rtable.shape
    keys = n - rows + 1
    if r is None:  # a function of the distance alone: causality (d > 0) is -inf table entries
        rtable = rtable.masked_fill(torch.arange(n, device=rtable.device) < rows - 1, float("-inf"))
    view = rtable.as_strided((1, H, rows, keys), (H * n, n, 1, 1))
    if r is None and doc_rows is None:
        return view
    shape = (doc_rows.shape[0] if doc_rows is not None else r.shape[0], H if r is None else r.shape[1], rows, keys)
    m = buf[:math.prod(shape)].view(shape) if buf is not None else rtable.new_empty(shape)
    if r is None:
        m.copy_(view.expand(shape))
    else:  # causality: key j' is after query i' iff i' + j' < rows - 1, in the first rows - 1 columns
        torch.mul(view.expand(shape), r, out=m)
        ij = torch.arange(rows, device=m.device)
        m[..., :rows - 1].add_(_neg_inf_where(ij[:, None] + ij[None, :rows - 1] < rows - 1))
    if doc_rows is not None and (c := int(kmax - doc_rows.max())) < keys - 1:  # keys before a document start
        kpos = kmax - torch.arange(c + 1, keys, device=m.device)
        m[..., c + 1:].add_(_neg_inf_where(kpos[None, None, :] < doc_rows[:, :, None])[:, None])
    return m


def _sdpa_mask_is_constant(prior, row_scale, scale_prior):
    """Whether no tensor that the mask is built from needs a gradient (the fused kernel gives none for its mask):
    true for NoPE, RoPE, a fixed prior such as ALiBi, and SSMax that scales only the content."""
    return not needs_grad(prior) and not (scale_prior and prior is not None and needs_grad(row_scale))


def attention_sdpa(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
                   q_offset=None, softmax_scale=None, chunk_size=None):
    """attention() through torch's fused CPU SDPA kernel, chunked over queries (see above). Gradients flow to q, k,
    v and to a row_scale that scales only the content, through the kernel's fused backward; a trained prior (or
    SSMax scaling one) raises, since the kernel gives no gradient for its mask. Under autograd each chunk's mask is
    a fresh tensor that the backward keeps, so training memory is O(T^2) when a mask has to be written."""
    prior = bind(prior)
    if not _sdpa_mask_is_constant(prior, row_scale, scale_prior):
        raise NotImplementedError("impl='sdpa' gives no gradient for the prior (nor for an SSMax scale applied to "
                                  "it); train with impl='cpu' (impl='auto' does)")
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    chunk = chunk_size or _sdpa_chunk_rows(B, H, Tk)
    q_offset, softmax_scale, chunks = _query_chunks(q, k, doc_start, q_offset, softmax_scale, chunk)
    dtype, (q, k, v) = q.dtype, (q.float(), k.float(), v.float())  # fp32 inside, like the reference
    if prior is None and row_scale is None and doc_start is None and q_offset == 0 and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale).to(dtype)
    written = doc_start is not None or (row_scale is not None and scale_prior and prior is not None)
    grad = needs_grad(q, k, v)
    buf = q.new_empty(B * H * min(chunk, Tq) * Tk) if written and not grad else None
    k_rev, v_rev = k.flip(2), v.flip(2)  # key j sits at Tk - 1 - j
    outs = []
    for a, b, lo in chunks:  # lo: keys before it are invisible to every query of the chunk
        i0, i1 = q_offset + a, q_offset + b  # absolute positions of this chunk's queries: [i0, i1)
        dmin, dmax = lo - (i1 - 1), i1 - i0 - 1
        rtable = (_bias_table(prior, dmin, dmax, q.device).flip(1) if prior is not None
                  else q.new_zeros(1, dmax - dmin + 1))
        qc, r = q[:, :, a:b], None
        if row_scale is not None:
            r = row_scale[:, :, a:b, None].float()
            qc = qc * r
        mask = _hankel_mask(rtable, b - a, r if scale_prior and prior is not None else None,
                            doc_start[:, i0:i1] if doc_start is not None else None, i1 - 1, buf)
        outs.append(F.scaled_dot_product_attention(qc, k_rev[:, :, Tk - i1:Tk - lo], v_rev[:, :, Tk - i1:Tk - lo],
                                                   attn_mask=mask, scale=softmax_scale))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(dtype)


def attention(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
              q_offset=None, softmax_scale=None, impl="auto"):
    """The one attention function the model calls. See the module docstring for the math, shapes and impls."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    prior = bind(prior)
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq > Tk:
        raise ValueError(f"attention: Tq={Tq} queries but only Tk={Tk} keys; queries must be the last positions")
    if q_offset is not None and not 0 <= q_offset <= Tk - Tq:
        raise ValueError(f"attention: q_offset={q_offset} puts queries outside the {Tk} keys (Tq={Tq})")
    kw = dict(doc_start=doc_start, prior=prior, row_scale=row_scale, scale_prior=scale_prior, q_offset=q_offset,
              softmax_scale=softmax_scale)
    impl = auto_impl(q, prior, k, v, row_scale) if impl == "auto" else impl
    if impl == "triton":
        return attention_triton(q, k, v, **kw)
    if impl == "flex":
        return attention_flex(q, k, v, **kw)
    if impl == "sdpa":
        return attention_sdpa(q, k, v, **kw)
    if impl == "cpu":
        return attention_cpu(q, k, v, **kw)
    return attention_torch(q, k, v, **kw)


def needs_grad(*tensors):
    """Whether autograd will want a gradient of any of these (tensors, BoundPriors, None)."""
    flat = [t for x in tensors for t in ((x.params if isinstance(x, BoundPrior) else (x,)))]
    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in flat)


def auto_impl(q, prior, *tensors):
    """impl="auto": the fastest implementation that computes `prior` exactly. CUDA: the Triton kernel when the prior
    is native to it, else FlexAttention. CPU without gradients (evaluation): the fused-SDPA path, 2-6x faster than
    the reference (README, "Measured on a 2-core CPU"); compiled Flex is slower there and compiles anew for every
    shape. CPU training: "cpu", the reference's math with a hand-written backward (the fused CPU kernel gives no
    gradient for its mask, i.e. for a trained prior; "cpu" trains every prior, also faster than SDPA's own
    backward for NoPE at the demo's and bench.py's shapes)."""
    if q.is_cuda:
        native = prior is None or "triton" in prior.prior.native
        return "triton" if native and _triton_available() else "flex"
    return "cpu" if needs_grad(q, prior, *tensors) else "sdpa"


# ----------------------------------------------------------------------------------------------------------
# FlexAttention (torch.nn.attention.flex_attention, compiled): the fused path for any registered prior. The prior
# enters as its table over the distances (_bias_table, the reference's), indexed in score_mod; the causal +
# document mask is a block mask, so fully hidden tiles are skipped. Gradients reach the prior's parameters and
# row_scale through the tensors score_mod captures (flex differentiates them). FlexAttention's CPU path has no
# backward (torch 2.13): on the CPU impl="flex" evaluates, and refuses to run where a gradient is needed.
# ----------------------------------------------------------------------------------------------------------
def _flex_scores(q, k, v, table, rs, prior_scale, ds, q_offset, softmax_scale):
    """FlexAttention with s = l * rs + B(d) * prior_scale, the visible keys doc_start[i] <= j <= i. One graph for
    every variant (absent parts are ones / zeros), so torch.compile builds it once per shape, not per flag."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]

    def score_mod(score, b, h, qi, ki):  # d = ki - (qi + q_offset) <= 0 where visible; hidden ones clamped in range
        bias = table[h, torch.clamp(ki - qi - q_offset, max=0) + Tk - 1]
        return score * rs[b, h, qi] + bias * prior_scale[b, h, qi]

    def visible(b, h, qi, ki):
        return (ki <= qi + q_offset) & (ki >= ds[b, qi + q_offset])

    block_mask = create_block_mask(visible, B, None, Tq, Tk, device=q.device)
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=softmax_scale)


# Compiled at the first call and again for each new shape: with dynamic shapes, torch 2.13's CPU FlexAttention
# template generates C++ that does not compile, so the shapes stay static.
_flex_compiled = torch.compile(_flex_scores, dynamic=False)


def attention_flex(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False, q_offset=None,
                   softmax_scale=None):
    """The FlexAttention implementation of attention() (same contract, see the module docstring)."""
    prior = bind(prior)
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    if not needs_grad(q, k, v, prior, row_scale):  # FlexAttention's CPU path refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    elif not q.is_cuda:
        raise RuntimeError("impl='flex' has no backward on the CPU (FlexAttention's CPU path is forward-only in "
                           f"torch {torch.__version__}); train on the CPU with impl='cpu' (or 'auto')")
    q_offset, softmax_scale = _offset_and_scale(q, k, q_offset, softmax_scale)
    dev = q.device
    table = _bias_table(prior, -(Tk - 1), 0, dev) if prior is not None else torch.zeros(H, Tk, device=dev)
    ones = torch.ones(B, H, Tq, device=dev)
    rs = row_scale.float().expand(B, H, Tq).contiguous() if row_scale is not None else ones
    # BAM + SSMax scales the prior too: (l + B) r = l r + B r. A copy, not rs itself: tensors that alias each
    # other would make torch.compile build a second graph.
    prior_scale = rs.clone() if scale_prior and row_scale is not None else torch.ones_like(ones)
    ds = doc_start.to(dev).expand(B, Tk) if doc_start is not None else torch.zeros(B, Tk, dtype=torch.long, device=dev)
    return _flex_compiled(q, k.to(q.dtype), v.to(q.dtype), table, rs, prior_scale, ds.contiguous(), q_offset,
                          softmax_scale)


def _triton_available():
    return triton is not None  # the import is tried once, below (no import inside code that torch.compile traces)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel: flash attention with any registered prior and SSMax applied per tile.
#
# Structure follows Triton's fused-attention tutorial: forward = one online-softmax loop over K/V blocks in
# base 2 (exp2, log2(e) folded into the scores) in stages (unmasked tiles, then the boundary tiles masked);
# backward = preprocess Delta = rowsum(O * dO), a kernel per K/V block accumulating dK, dV over query blocks,
# and a separate kernel per query block for dQ (no atomics), which also produces d row_scale and per-program
# partial sums for the prior parameters, reduced afterwards in PyTorch (deterministic: two runs are bitwise equal).
#
# The kernel never sees a prior's formula, only tables by distance, built in PyTorch once per call from the
# registered fn (_prior_tables): B(d) per head, and for the K parameters that need a gradient their derivative
# tables J_k(d) = dB(d)/dtheta_k (forward-mode autograd, outside the custom ops), K a compile-time constant.
# Why derivative tables and not the gradient w.r.t. the table (dB per head and distance, handed to autograd):
# dB(d) is a sum along the diagonals of every dS tile, which a query-block program can neither hold (its
# distances span the whole row) nor store in linear memory, so it would need a third kernel per block diagonal
# recomputing S, P and dP, after a pass that knows Delta' (below). perf_model.py (sm_90, D = 64, bf16) puts a
# forward-class kernel with a prior at 0.137 clocks per score before any diagonal reduction, against 0.148 for
# the dQ kernel's two derivative tables of GGD or Cauchy (+0.073 per further parameter): the tables cost no
# more for the shipped priors, need no new pass, and keep the exact zero below.
#
# Math, per (batch, head), query i (absolute position), key j, d = j - i, r_i = row_scale (1 without SSMax):
#   l = softmax_scale * q_i.k_j ;  s = (l + B) r  if scale_prior  else  l r + B ;  masked s = -inf
#   P = softmax_j(s) ;  O = P V ;  LSE_i = log sum_j exp(s_ij) (stored in base 2)
# Backward, with Delta_i = sum_j P_ij dP_ij = rowsum(O_i * dO_i) and dP = dO V^T:
#   dS = P * (dP - Delta)          gradient w.r.t. the final score s
#   dl = dS r,  dq = softmax_scale dl K,  dk = softmax_scale dl^T Q,  dv = P^T dO
#   dtheta_k = sum_ij w_i dS_ij J_k(d_ij), w = r if scale_prior else 1 ;  dr_i = sum_j dS_ij x_ij,
#   x = l + B if scale_prior else l
# A prior can be huge where the probability sits (GGD with theta_beta < 0: B(d = mu) about -3e7): exact in fp32
# softmax, but sum_j dS_ij J_ij then multiplies rounding noise in (dP - Delta) by 1e7 on rows where that entry
# carries the probability (a document's first query). Because sum_j dS_ij = 0 exactly in real arithmetic, the dQ
# kernel replaces Delta by Delta'_i = sum_j P_ij dP_ij (accumulated in the same loop) for those gradients:
#   sum_j P (dP - Delta') f = sum_j dS f - (Delta' - Delta) sum_j P f,
# which makes them exactly 0 where the reference's are (one visible key) and more accurate elsewhere.
# All kernels run with enable_fp_fusion=False and compute scores through the one _scores helper from the one
# table the forward saved, so that the backward's recomputed s is bit-identical to the forward's: with
# |s| ~ 1e7 one ulp is 2^2, and P = exp2(s - LSE) of a row whose single key carries that prior would otherwise
# come out as 2^(+-ulp) instead of 1.
# ----------------------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path works without triton
    triton = None


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:
    # Triton's interpreter multiplies bfloat16 blocks as their raw uint16 storage; there (only) tl.dot gets its
    # bf16 operands upcast to fp32, which is exact, so the CPU tests still see bf16 rounding of P and dS.
    _INTERPRET_BF16_UPCAST = tl.constexpr(_interpreting())
    _LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _dot(a, b, acc, DOT_PREC: tl.constexpr):
        if _INTERPRET_BF16_UPCAST:
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
            if b.dtype == tl.bfloat16:
                b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=DOT_PREC)

    @triton.jit
    def _prior_tile(qpos, kpos, tab, d0):
        """B(d) for a tile, read by distance d = kpos - qpos (broadcast against each other) from the head's table,
        whose entry t holds B(d0 + t). One load per score instead of a log2 and an exp2 (see perf_model.py)."""
        return tl.load(tab + (kpos - qpos - d0))

    @triton.jit
    def _scores(qk, bias, r, sm_scale, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr, SCALE_PRIOR: tl.constexpr):
        """Final score in base 2 (s * log2 e) and the content score l. Shared by all kernels so that the backward
        recomputes bit-identical scores (LSE of a row with one huge-prior key depends on it)."""
        l = qk * sm_scale
        s = l
        if HAS_RS:
            if HAS_PRIOR:
                if SCALE_PRIOR:
                    s = (l + bias) * r
                else:
                    s = l * r + bias
            else:
                s = l * r
        else:
            if HAS_PRIOR:
                s = l + bias
        return s * _LOG2E, l

    @triton.jit
    def _visible(qpos, kpos, ds):
        """causal AND same document: doc_start[i] <= j <= i (broadcast shapes)."""
        return (kpos <= qpos) & (kpos >= ds)

    @triton.jit
    def _tile_scores(qk, qpos, kpos, ds, r, tab, d0, sm_scale, MASKED: tl.constexpr, HAS_DOC: tl.constexpr,
                     HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr, SCALE_PRIOR: tl.constexpr):
        """The (masked) final scores of a tile from its raw q.k products, as every kernel computes them: prior,
        _scores, then -inf where the key is not visible. qpos, kpos, ds (the queries' doc_start) and r broadcast
        against qk (the dK/dV kernel passes them transposed). Returns s (base 2), l and the prior B (0 without one)."""
        bias = 0.0
        if HAS_PRIOR:
            bias = _prior_tile(qpos, kpos, tab, d0)
        s, l = _scores(qk, bias, r, sm_scale, HAS_PRIOR, HAS_RS, SCALE_PRIOR)
        if MASKED:
            if HAS_DOC:
                vis = _visible(qpos, kpos, ds)
            else:
                vis = kpos <= qpos
            s = tl.where(vis, s, float("-inf"))
        return s, l, bias

    @triton.jit
    def _program_ids(H):
        """(block index, batch * head index, batch, head) of this program; b and h are 64-bit so that base offsets
        such as b * stride_b do not overflow (B * H * T * D may exceed 2^31)."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        return pid, bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64)

    @triton.jit
    def _row_state(DS_ptr, RS_ptr, srt, offs_m, qpos, row_ok,
                   HAS_DOC: tl.constexpr, HAS_RS: tl.constexpr, BLOCK_M: tl.constexpr):
        """A block of query rows' doc_start (0 without documents) and SSMax row_scale r (1 without SSMax).
        DS_ptr points at this batch's doc_start, RS_ptr at this (batch, head)'s row_scale."""
        if HAS_DOC:
            ds_rows = tl.load(DS_ptr + qpos, mask=row_ok, other=0)
        else:
            ds_rows = tl.zeros([BLOCK_M], dtype=tl.int32)
        if HAS_RS:
            r_rows = tl.load(RS_ptr + offs_m * srt, mask=row_ok, other=0.0)
        else:
            r_rows = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        return ds_rows, r_rows

    @triton.jit
    def _q_block_ranges(pid_m, row_ok, ds_rows, q_offset, Tq, Tk,
                        HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Key-block ranges for query block pid_m (forward and dQ): [lo, u0) masked (document boundary),
        [u0, u1) unmasked, [u1, hi) masked (diagonal). Blocks before lo / from hi on are never loaded."""
        q_first = q_offset + pid_m * BLOCK_M
        q_last_valid = q_offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Tq) - 1
        hi = q_last_valid // BLOCK_N + 1  # last key needed = last valid query position (causal)
        causal_lo = (q_first + 1) // BLOCK_N  # blocks < causal_lo lie entirely at or below the diagonal
        if HAS_DOC:
            min_ds = tl.min(tl.where(row_ok, ds_rows, Tk), 0)  # earliest document start of the block's rows
            max_ds = tl.max(tl.where(row_ok, ds_rows, 0), 0)
            lo = tl.minimum(min_ds // BLOCK_N, hi)
            doc_hi = (max_ds + BLOCK_N - 1) // BLOCK_N  # blocks >= doc_hi start after every row's document start
        else:
            lo = tl.full([], 0, tl.int32)
            doc_hi = tl.full([], 0, tl.int32)
        u1 = tl.minimum(tl.maximum(causal_lo, lo), hi)
        u0 = tl.minimum(tl.maximum(doc_hi, lo), u1)
        return lo, u0, u1, hi

    # ------------------------------------------------------------------ forward
    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, stride_kt, stride_kd, stride_vt, stride_vd,
                   offs_d, d_ok, qpos, ds_rows, r_rows, tab, d0, sm_scale, Tk, blk_lo, blk_hi,
                   MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                   SCALE_PRIOR: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
        for blk in range(blk_lo, blk_hi):
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < Tk
            kT = tl.load(K_ptr + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            qk = _dot(q, kT, None, DOT_PREC)
            s, _l, _b = _tile_scores(qk, qpos[:, None], offs_n[None, :], ds_rows[:, None], r_rows[:, None],
                                     tab, d0, sm_scale, MASKED, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR)
            # online softmax; a row with nothing visible yet has m = -inf: subtract 0 instead (no -inf - -inf)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V_ptr + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd(Q, K, V, O, LSE, DS, RS, PTAB,
                  sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                  sdsb, srb, srh, srt,
                  H, Tq, Tk, q_offset, sm_scale, d0, n_dist,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                  DOT_PREC: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Tq
        qpos = q_offset + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM  # head dims that are not a power of two are padded with zeros
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + h * svh
        ds_rows, r_rows = _row_state(DS + b * sdsb, RS + b * srb + h * srh, srt, offs_m, qpos, row_ok,
                                     HAS_DOC, HAS_RS, BLOCK_M)
        tab = PTAB + h * n_dist  # this head's prior table (unused without a prior)
        lo, u0, u1, hi = _q_block_ranges(pid_m, row_ok, ds_rows, q_offset, Tq, Tk, HAS_DOC, BLOCK_M, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # stage 1 (tutorial STAGE 1): tiles below the diagonal and after every row's document start, no mask
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, qpos,
                                   ds_rows, r_rows, tab, d0, sm_scale, Tk, u0, u1,
                                   False, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_N, DOT_PREC)
        # stage 2 (tutorial STAGE 2): boundary tiles, masked -- document starts, then the diagonal
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, qpos,
                                   ds_rows, r_rows, tab, d0, sm_scale, Tk, lo, u0,
                                   True, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_N, DOT_PREC)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, qpos,
                                   ds_rows, r_rows, tab, d0, sm_scale, Tk, u1, hi,
                                   True, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_N, DOT_PREC)
        # epilogue: rows with no visible key give O = 0 and LSE = +inf (so the backward's P is exactly 0)
        has_mass = l_i > 0.0
        o = acc / tl.where(has_mass, l_i, 1.0)[:, None]
        lse = tl.where(has_mass, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log2(tl.where(has_mass, l_i, 1.0)),
                       float("inf"))
        tl.store(LSE + bh * Tq + offs_m, lse, mask=row_ok)
        tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod, o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    # ------------------------------------------------------------------ backward
    @triton.jit
    def _attn_bwd_preprocess(O, DO, DELTA, sob, soh, sot, sod, sdob, sdoh, sdot, sdod, H, Tq,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]
        o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod, mask=mask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_d[None, :] * sdod, mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * Tq + offs_m, delta, mask=offs_m < Tq)

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, Q_ptr, DO_ptr, LSE_ptr, DELTA_ptr, DS_ptr, RS_ptr,
                        sqt, sqd, sdot, sdod, srt, offs_n, offs_d, d_ok, tab, d0, sm_scale,
                        Tq, q_offset, blk_lo, blk_hi,
                        MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                        SCALE_PRIOR: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
        for blk in range(blk_lo, blk_hi):
            offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Tq
            qpos = q_offset + offs_m
            qT = tl.load(Q_ptr + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
                         mask=d_ok[:, None] & row_ok[None, :], other=0.0)
            # padded query rows: LSE = +inf makes P = 0, and dO = 0, so they add nothing
            lse = tl.load(LSE_ptr + offs_m, mask=row_ok, other=float("inf"))
            qkT = _dot(k, qT, None, DOT_PREC)  # (BLOCK_N, BLOCK_M): keys x queries
            # doc_start is only needed (and loaded) for the masked tiles
            ds, r = _row_state(DS_ptr, RS_ptr, srt, offs_m, qpos, row_ok, MASKED and HAS_DOC, HAS_RS, BLOCK_M)
            sT, _l, _b = _tile_scores(qkT, qpos[None, :], offs_n[:, None], ds[None, :], r[None, :],
                                      tab, d0, sm_scale, MASKED, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR)
            pT = tl.exp2(sT - lse[None, :])
            do = tl.load(DO_ptr + offs_m[:, None] * sdot + offs_d[None, :] * sdod,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PREC)
            delta = tl.load(DELTA_ptr + offs_m, mask=row_ok, other=0.0)
            dpT = _dot(v, tl.trans(do), None, DOT_PREC)
            dsT = pT * (dpT - delta[None, :])
            if HAS_RS:
                dsT = dsT * r[None, :]  # dl = dS r
            dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PREC)
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, DS, RS, PTAB, QEND, QCLEAN,
                       sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdob, sdoh, sdot, sdod,
                       sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sdsb, srb, srh, srt,
                       H, Tq, Tk, q_offset, sm_scale, d0, n_dist, n_kblocks,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                       SCALE_PRIOR: tl.constexpr, DOT_PREC: tl.constexpr):
        pid_n, bh, b, h = _program_ids(H)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < Tk
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        tab = PTAB + h * n_dist  # this head's prior table (unused without a prior)
        n0 = pid_n * BLOCK_N
        n_qblocks = (Tq + BLOCK_M - 1) // BLOCK_M
        # query blocks that can see this key block: from the first query at or after n0 ...
        lo = tl.maximum(n0 - q_offset, 0) // BLOCK_M
        # ... to the last query block whose earliest document start is <= n_last (precomputed, see _kv_ranges)
        if HAS_DOC:
            hi = tl.load(QEND + b * n_kblocks + pid_n)
            clean_end = tl.load(QCLEAN + b * n_kblocks + pid_n)  # blocks < clean_end: every doc_start <= n0
        else:
            hi = n_qblocks
            clean_end = n_qblocks
        lo = tl.minimum(lo, hi)
        # first query block whose first query is at or after the block's last key (a ragged last key block is
        # thus always in the masked stage, where keys >= Tk are masked as being after every query)
        causal_clean = (tl.maximum(n0 + BLOCK_N - 1 - q_offset, 0) + BLOCK_M - 1) // BLOCK_M
        u0 = tl.minimum(tl.maximum(causal_clean, lo), hi)
        u1 = tl.minimum(tl.maximum(clean_end, u0), hi)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        Q_ptr = Q + b * sqb + h * sqh
        DO_ptr = DO + b * sdob + h * sdoh
        LSE_ptr = LSE + bh * Tq
        DELTA_ptr = DELTA + bh * Tq
        DS_ptr = DS + b * sdsb
        RS_ptr = RS + b * srb + h * srh
        # the diagonal query blocks, masked (tutorial: "compute dK and dV for masked blocks" first)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_ptr, DO_ptr, LSE_ptr, DELTA_ptr, DS_ptr, RS_ptr,
                                 sqt, sqd, sdot, sdod, srt, offs_n, offs_d, d_ok, tab, d0, sm_scale,
                                 Tq, q_offset, lo, u0,
                                 True, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_M, DOT_PREC)
        # then the query blocks strictly below the diagonal and inside the key block's document, unmasked
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_ptr, DO_ptr, LSE_ptr, DELTA_ptr, DS_ptr, RS_ptr,
                                 sqt, sqd, sdot, sdod, srt, offs_n, offs_d, d_ok, tab, d0, sm_scale,
                                 Tq, q_offset, u0, u1,
                                 False, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_M, DOT_PREC)
        # finally query blocks where a later document starts (document boundary), masked
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_ptr, DO_ptr, LSE_ptr, DELTA_ptr, DS_ptr, RS_ptr,
                                 sqt, sqd, sdot, sdod, srt, offs_n, offs_d, d_ok, tab, d0, sm_scale,
                                 Tq, q_offset, u1, hi,
                                 True, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, BLOCK_M, DOT_PREC)
        tl.store(DK + b * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :] * sdkd,
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :] * sdvd,
                 dv.to(DV.dtype.element_ty), mask=kv_mask)

    # The dQ kernel's per-row sums over the row's visible keys j (dS = P (dP - Delta)): pdp = sum P dP (Delta');
    # sx, px = sum dS x, sum P x (row_scale; x as in the section comment); sj, pj (BLOCK_M, KP): column k holds
    # sum dS J_k, sum P J_k (prior parameter k). Each "p" sum corrects its "s" sum for Delta' - Delta.
    @triton.jit
    def _bwd_dq_inner(dq, a_pdp, a_sx, a_px, a_sj, a_pj, q, do, lse, delta, r_rows, K_ptr, V_ptr, skt, skd, svt, svd,
                      offs_d, d_ok, qpos, ds_rows, tab, jtab, d0, n_dist, sm_scale, Tk, blk_lo, blk_hi,
                      MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                      SCALE_PRIOR: tl.constexpr, ACC_DPP: tl.constexpr, N_GRAD: tl.constexpr, KP: tl.constexpr,
                      NEED_RS_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
        kcol = tl.arange(0, KP)[None, :]
        for blk in range(blk_lo, blk_hi):
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < Tk
            kT = tl.load(K_ptr + offs_n[None, :] * skt + offs_d[:, None] * skd,
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            vT = tl.load(V_ptr + offs_n[None, :] * svt + offs_d[:, None] * svd,
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            qk = _dot(q, kT, None, DOT_PREC)
            s, l, bias = _tile_scores(qk, qpos[:, None], offs_n[None, :], ds_rows[:, None], r_rows[:, None],
                                      tab, d0, sm_scale, MASKED, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR)
            p = tl.exp2(s - lse[:, None])
            dp = _dot(do, vT, None, DOT_PREC)
            ds = p * (dp - delta[:, None])
            if HAS_RS:
                dl = ds * r_rows[:, None]
            else:
                dl = ds
            dq = _dot(dl.to(kT.dtype), tl.trans(kT), dq, DOT_PREC)
            if ACC_DPP:  # Delta' = sum_j P dP (see the section comment)
                a_pdp += tl.sum(p * dp, 1)
            if NEED_RS_GRAD:
                x = l
                if HAS_PRIOR and SCALE_PRIOR:
                    x = l + bias
                a_sx += tl.sum(ds * x, 1)
                a_px += tl.sum(p * x, 1)
            for k in tl.static_range(N_GRAD):
                jk = _prior_tile(qpos[:, None], offs_n[None, :], jtab + k * n_dist, d0)
                a_sj += tl.where(kcol == k, tl.sum(ds * jk, 1)[:, None], 0.0)
                a_pj += tl.where(kcol == k, tl.sum(p * jk, 1)[:, None], 0.0)
        return dq, a_pdp, a_sx, a_px, a_sj, a_pj

    @triton.jit
    def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, DS, RS, PTAB, JTAB, DRS, PART,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdob, sdoh, sdot, sdod,
                     sdqb, sdqh, sdqt, sdqd, sdsb, srb, srh, srt,
                     H, Tq, Tk, q_offset, sm_scale, d0, n_dist, n_qblocks,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                     SCALE_PRIOR: tl.constexpr, N_GRAD: tl.constexpr, KP: tl.constexpr, NEED_RS_GRAD: tl.constexpr,
                     ACC_DPP: tl.constexpr, DOT_PREC: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Tq
        qpos = q_offset + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        qd_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_d[None, :] * sdod,
                     mask=qd_mask, other=0.0)
        lse = tl.load(LSE + bh * Tq + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=row_ok, other=0.0)
        ds_rows, r_rows = _row_state(DS + b * sdsb, RS + b * srb + h * srh, srt, offs_m, qpos, row_ok,
                                     HAS_DOC, HAS_RS, BLOCK_M)
        tab = PTAB + h * n_dist  # this head's prior table (unused without a prior)
        jtab = JTAB + h * (N_GRAD * n_dist)  # its derivative tables, one per parameter that needs a gradient
        lo, u0, u1, hi = _q_block_ranges(pid_m, row_ok, ds_rows, q_offset, Tq, Tk, HAS_DOC, BLOCK_M, BLOCK_N)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        zero, zero_k = tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M, KP], dtype=tl.float32)
        a_pdp, a_sx, a_px, a_sj, a_pj = zero, zero, zero, zero_k, zero_k
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + h * svh
        # the same three stages as the forward: unmasked interior tiles, then document-boundary and diagonal tiles
        for stage in tl.static_range(3):
            if stage == 0:
                blk_lo, blk_hi, masked = u0, u1, False
            elif stage == 1:
                blk_lo, blk_hi, masked = lo, u0, True
            else:
                blk_lo, blk_hi, masked = u1, hi, True
            dq, a_pdp, a_sx, a_px, a_sj, a_pj = _bwd_dq_inner(
                dq, a_pdp, a_sx, a_px, a_sj, a_pj, q, do, lse, delta, r_rows, K_ptr, V_ptr, skt, skd, svt, svd,
                offs_d, d_ok, qpos, ds_rows, tab, jtab, d0, n_dist, sm_scale, Tk, blk_lo, blk_hi,
                masked, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, ACC_DPP, N_GRAD, KP, NEED_RS_GRAD,
                BLOCK_N, DOT_PREC)
        tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :] * sdqd,
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)
        corr = a_pdp - delta  # Delta' - Delta
        if NEED_RS_GRAD:
            tl.store(DRS + bh * Tq + offs_m, a_sx - corr * a_px, mask=row_ok)
        if N_GRAD > 0:
            w = tl.where(row_ok, 1.0, 0.0)
            if HAS_RS and SCALE_PRIOR:
                w = w * r_rows  # dB = dS r
            g = tl.sum(w[:, None] * (a_sj - corr[:, None] * a_pj), 0)
            kc = tl.arange(0, KP)
            tl.store(PART + (bh * n_qblocks + pid_m) * N_GRAD + kc, g, mask=kc < N_GRAD)


# ------------------------------------------------------------------ launch configuration and the autograd wrapper
# Fixed tiles per (head_dim, dtype) rather than triton.autotune: the backward's tile-skipping tables depend on the
# block sizes, and under the interpreter autotuning would multiply test time. Tests may set INTERPRET_BLOCKS.
INTERPRET_BLOCKS = (32, 32)


def _configs(block_d, dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dK/dV and dQ kernels. Chosen so that the sm_90
    builds (ptxas, all prior/SSMax/document flags on) spill no or almost no registers; not tuned on hardware."""
    if _interpreting():
        bm, bn = INTERPRET_BLOCKS
        return dict(fwd=(bm, bn, 4, 1), dkdv=(bm, bn, 4, 1), dq=(bm, bn, 4, 1), pre=bm)
    if dtype == torch.float32:  # ieee dots run on FMA units: the exact path for gradient checks, not for speed
        if block_d <= 64:
            return dict(fwd=(64, 32, 8, 2), dkdv=(32, 64, 8, 2), dq=(64, 32, 8, 2), pre=64)
        return dict(fwd=(32, 32, 4, 2), dkdv=(16, 32, 4, 2), dq=(32, 16, 4, 2), pre=64)
    if block_d <= 64:
        return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 3), dq=(128, 32, 8, 3), pre=128)
    # dK/dV: 64 keys per warpgroup, or Hopper's wgmma is not used (mma.sync from ldmatrix instead: perf_model.py
    # predicts 5x the time, bound by shared-memory bandwidth)
    return dict(fwd=(128, 32, 8, 2), dkdv=(32, 64, 4, 2), dq=(64, 16, 8, 2), pre=128)


def _prior_tables(prior, H, Tq, Tk, q_offset, cfg, device):
    """The prior by distance for the kernels, which never evaluate a formula: (table, jtab, theta, d0). table
    (H, n) fp32: entry t is B(d0 + t), for every distance a tile touches (padded rows and keys included). jtab
    (H, K, n): the derivative tables dB/dtheta_k of the K parameters that need a gradient; theta (H, K) those
    parameters stacked: the ops never read its values, they return its gradient sum_ij w dS J_k and autograd
    takes it on to the parameters (None, None when K = 0). The derivatives are forward-mode autograd (a tangent
    of ones per parameter: B_h depends on head h's parameters only), here because the ops run below the autograd
    key, where forward-mode AD is not allowed. d > 0 is never visible: 0 there, so that a prior undefined there
    (inf, NaN) cannot reach a gradient sum as 0 * inf."""
    pad = max(max(c[:2]) for c in (cfg["fwd"], cfg["dkdv"], cfg["dq"]))
    d0 = -(q_offset + Tq - 1) - pad
    n = Tq + Tk + 2 * pad - 1
    future = torch.arange(d0, d0 + n, device=device) > 0
    params = tuple(t.detach() for t in prior.params)
    of = lambda *ps: _bias_table(BoundPrior(prior.prior, ps), d0, d0 + n - 1, device).float().expand(H, n)
    table = of(*params).masked_fill(future, 0.0).contiguous()
    need = [i for i, t in enumerate(prior.params) if t.requires_grad] if torch.is_grad_enabled() else []
    if not need:
        return table, None, None, d0
    ones = [tuple(torch.ones_like(t) if j == i else torch.zeros_like(t) for j, t in enumerate(params)) for i in need]
    jtab = torch.stack([torch.func.jvp(of, params, tangent)[1] for tangent in ones], 1)
    theta = torch.stack([prior.params[i].float() for i in need], 1)
    return table, jtab.masked_fill(future, 0.0).contiguous(), theta, d0


def _kv_ranges(ds_rows, block_m, block_n, Tk):
    """Per (batch, key block): (q_end, q_clean). Query blocks >= q_end see none of the key block (their earliest
    doc_start is after its last key); query blocks < q_clean have every doc_start <= the block's first key, so
    documents need no mask there. Exact for the usual non-decreasing doc_start, conservative otherwise."""
    B, Tq = ds_rows.shape
    nm = triton.cdiv(Tq, block_m)
    pad = nm * block_m - Tq
    big = torch.iinfo(torch.int32).max
    rows = ds_rows.to(torch.int64)
    qmin = F.pad(rows, (0, pad), value=big).view(B, nm, block_m).amin(-1)
    qmax = F.pad(rows, (0, pad), value=-1).view(B, nm, block_m).amax(-1)
    suffix_min = qmin.flip(-1).cummin(-1).values.flip(-1).contiguous()  # non-decreasing
    prefix_max = qmax.cummax(-1).values.contiguous()  # non-decreasing
    n0 = torch.arange(0, Tk, block_n, device=ds_rows.device)
    n_last = torch.clamp(n0 + block_n, max=Tk) - 1
    q_end = torch.searchsorted(suffix_min, n_last.expand(B, -1).contiguous(), right=True)
    q_clean = torch.searchsorted(prefix_max, n0.expand(B, -1).contiguous(), right=True)
    return q_end.to(torch.int32).contiguous(), q_clean.to(torch.int32).contiguous()


def _st(t):
    return tuple(t.stride())


# The kernels are registered as two PyTorch custom ops, forward and backward, with fake-tensor implementations
# (shapes only) and the autograd formula tying them together: torch.compile then traces a model through
# attention as through any other op (no graph break) and Inductor fuses the code around it. The ops are opaque:
# they run the kernels exactly as eager mode does, so compiled and eager results are bitwise equal.
Tensor, OptTensor = torch.Tensor, Optional[torch.Tensor]


def _block_d(head_dim):
    return max(16, triton.next_power_of_2(head_dim))  # head dims that are not a power of two are padded


def _launch_state(q, k, doc_start, row_scale):
    """What both ops derive from their inputs: block_d, tile configuration, dot precision, doc_start as
    (B, Tk) int32, row_scale as (B, H, Tq) fp32, and a dummy pointer for absent inputs."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    block_d = _block_d(D)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"  # input_precision only matters for fp32 inputs
    dummy = torch.zeros(1, device=q.device, dtype=torch.float32)
    ds = doc_start.to(device=q.device, dtype=torch.int32).contiguous().expand(B, Tk) if doc_start is not None else None
    rs = row_scale.float().expand(B, H, Tq) if row_scale is not None else None
    return block_d, _configs(block_d, q.dtype), dot_prec, dummy, ds, rs


def _device_of(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("bam::triton_attention_fwd", mutates_args=())
def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: OptTensor, table: OptTensor, jtab: OptTensor,
                theta: OptTensor, row_scale: OptTensor, scale_prior: bool, q_offset: int, softmax_scale: float,
                d0: int) -> tuple[Tensor, Tensor]:
    """The forward kernel: (O, LSE). LSE (B, H, Tq) fp32 is the row log-sum-exp in base 2 (the backward needs it).
    table, jtab, theta, d0 as _prior_tables makes them; jtab and theta are only kept for the backward."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    has_prior, has_doc, has_rs = table is not None, doc_start is not None, row_scale is not None
    with _device_of(q):
        block_d, cfg, dot_prec, dummy, ds, rs = _launch_state(q, k, doc_start, row_scale)
        o = torch.empty_like(q)
        lse = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
        bm, bn, warps, stages = cfg["fwd"]
        _attn_fwd[(triton.cdiv(Tq, bm), B * H)](
            q, k, v, o, lse, ds if has_doc else dummy, rs if has_rs else dummy, table if has_prior else dummy,
            *_st(q), *_st(k), *_st(v), *_st(o),
            ds.stride(0) if has_doc else 0, *(_st(rs) if has_rs else (0, 0, 0)),
            H, Tq, Tk, q_offset, softmax_scale, d0, table.shape[1] if has_prior else 0,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, HAS_DOC=has_doc, HAS_PRIOR=has_prior,
            HAS_RS=has_rs, SCALE_PRIOR=scale_prior and has_rs, DOT_PREC=dot_prec,
            num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return o, lse


@_triton_fwd.register_fake
def _(q, k, v, doc_start, table, jtab, theta, row_scale, scale_prior, q_offset, softmax_scale, d0):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("bam::triton_attention_bwd", mutates_args=())
def _triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, doc_start: OptTensor,
                table: OptTensor, jtab: OptTensor, row_scale: OptTensor, scale_prior: bool, q_offset: int,
                softmax_scale: float, d0: int, need_rs: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward kernels: (dQ, dK, dV, d theta (H, K) fp64 from the derivative tables jtab (H, K, n),
    d row_scale (B, H, Tq) fp32). The last two are empty without jtab / need_rs."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    has_prior, has_doc, has_rs = table is not None, doc_start is not None, row_scale is not None
    n_grad = jtab.shape[1] if jtab is not None else 0
    with _device_of(q):
        block_d, cfg, dot_prec, dummy, ds, rs = _launch_state(q, k, doc_start, row_scale)
        dev = q.device
        do = do.contiguous() if do.stride(-1) != 1 else do
        dummy_i = torch.zeros(1, device=dev, dtype=torch.int32)
        ds_arg, ds_st = (ds, ds.stride(0)) if has_doc else (dummy_i, 0)
        rs_arg, rs_st = (rs, _st(rs)) if has_rs else (dummy, (0, 0, 0))
        ptab, n_dist = (table, table.shape[1]) if has_prior else (dummy, 0)
        common = dict(HEAD_DIM=D, BLOCK_D=block_d, HAS_DOC=has_doc, HAS_PRIOR=has_prior, HAS_RS=has_rs,
                      SCALE_PRIOR=scale_prior and has_rs, DOT_PREC=dot_prec, enable_fp_fusion=False)
        # preprocess: Delta = rowsum(O * dO)
        delta = torch.empty((B, H, Tq), device=dev, dtype=torch.float32)
        pm = cfg["pre"]
        _attn_bwd_preprocess[(triton.cdiv(Tq, pm), B * H)](
            o, do, delta, *_st(o), *_st(do), H, Tq, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pm, enable_fp_fusion=False)
        # dK, dV: one program per key block, looping over query blocks
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        bm, bn, warps, stages = cfg["dkdv"]
        n_kb = triton.cdiv(Tk, bn)
        q_end, q_clean = _kv_ranges(ds[:, q_offset:q_offset + Tq], bm, bn, Tk) if has_doc else (dummy_i, dummy_i)
        _attn_bwd_dkdv[(n_kb, B * H)](
            q, k, v, do, dk, dv, lse, delta, ds_arg, rs_arg, ptab, q_end, q_clean,
            *_st(q), *_st(k), *_st(v), *_st(do), *_st(dk), *_st(dv), ds_st, *rs_st,
            H, Tq, Tk, q_offset, softmax_scale, d0, n_dist, n_kb,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common)
        # dQ (+ d row_scale, + per-program partial sums of d theta): one program per query block, looping over keys
        dq = torch.empty_like(q)
        bm, bn, warps, stages = cfg["dq"]
        n_qb = triton.cdiv(Tq, bm)
        drs = torch.empty((B, H, Tq), device=dev, dtype=torch.float32) if need_rs else dummy
        part = torch.empty((B, H, n_qb, n_grad), device=dev, dtype=torch.float32) if n_grad else dummy
        _attn_bwd_dq[(n_qb, B * H)](
            q, k, v, do, dq, lse, delta, ds_arg, rs_arg, ptab, jtab if n_grad else dummy, drs, part,
            *_st(q), *_st(k), *_st(v), *_st(do), *_st(dq), ds_st, *rs_st,
            H, Tq, Tk, q_offset, softmax_scale, d0, n_dist, n_qb,
            BLOCK_M=bm, BLOCK_N=bn, N_GRAD=n_grad, KP=triton.next_power_of_2(max(n_grad, 1)),
            NEED_RS_GRAD=need_rs, ACC_DPP=n_grad > 0 or need_rs, num_warps=warps, num_stages=stages, **common)
        # deterministic reduction of the per-program partials (fixed order, no atomics)
        g = part.double().sum(dim=(0, 2)) if n_grad else q.new_empty(0, dtype=torch.float64)
    return dq, dk, dv, g, drs if need_rs else q.new_empty(0, dtype=torch.float32)


@_triton_bwd.register_fake
def _(do, q, k, v, o, lse, doc_start, table, jtab, row_scale, scale_prior, q_offset, softmax_scale, d0, need_rs):
    g = q.new_empty(jtab.shape[:2] if jtab is not None else (0,), dtype=torch.float64)
    drs = q.new_empty(q.shape[:3] if need_rs else (0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), g, drs


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, doc_start, table, jtab, theta, row_scale, scale_prior, q_offset, softmax_scale, d0 = inputs
    ctx.save_for_backward(q, k, v, *output, doc_start, table, jtab, row_scale)
    ctx.args = (scale_prior, q_offset, softmax_scale, d0)
    ctx.theta_dtype = theta.dtype if theta is not None else None
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, doc_start, table, jtab, row_scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_rs = row_scale is not None and need[7]
    dq, dk, dv, g, drs = _triton_bwd(do, q, k, v, o, lse, doc_start, table, jtab if need[6] else None, row_scale,
                                     *ctx.args, need_rs)
    g_rs = drs.sum_to_size(row_scale.shape).to(row_scale.dtype) if need_rs else None  # broadcast over the batch
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None,
            g.to(ctx.theta_dtype) if need[6] else None, g_rs, None, None, None, None)


_triton_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def attention_triton(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
                     q_offset=None, softmax_scale=None):
    """The Triton implementation of attention() (same contract, see the module docstring), for every registered
    prior. Needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first imported (then it runs, slowly,
    on CPU tensors)."""
    prior = bind(prior)
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package")
    if not q.is_cuda and not _interpreting():
        raise RuntimeError("the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 before importing triton)")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"attention_triton: unsupported dtype {q.dtype}")
    if k.shape != (B, H, Tk, D) or v.shape != k.shape:
        raise ValueError(f"attention_triton: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    k, v = k.to(q.dtype), v.to(q.dtype)
    if D > 256:
        raise ValueError(f"attention_triton: head_dim {D} > 256 is not supported")
    q_offset, softmax_scale = _offset_and_scale(q, k, q_offset, softmax_scale)
    if not 0 <= q_offset <= Tk - Tq:
        raise ValueError(f"attention_triton: q_offset={q_offset} puts queries outside the {Tk} keys (Tq={Tq})")
    if Tq == 0:
        return q * 0.0  # nothing to attend from (still connected to autograd)
    # unit stride along head_dim keeps the loads vectorised; other strides are passed as they are
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if doc_start is not None and doc_start.shape[-1] != Tk:
        raise ValueError(f"attention_triton: doc_start has {doc_start.shape[-1]} positions, keys have {Tk}")
    if row_scale is not None and row_scale.shape[-1] != Tq:
        raise ValueError(f"attention_triton: row_scale has {row_scale.shape[-1]} rows, queries have {Tq}")
    tables = (None, None, None, 0) if prior is None else _prior_tables(
        prior, H, Tq, Tk, q_offset, _configs(_block_d(D), q.dtype), q.device)
    return _triton_fwd(q, k, v, doc_start, *tables[:3], row_scale, bool(scale_prior), q_offset, softmax_scale,
                       tables[3])[0]
