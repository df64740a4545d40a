"""
bam-gpt's attention: one function, one formula, several implementations.

attention() is causal softmax attention plus a log-prior of query-key distance (the paper's BAM),
SSMax's row scale and document boundaries. The file reads: the contract, dense_attention (the
formula in dense, runnable code: the spec), the chunked reference "torch", the skip bound, then
which impl computes what. "sdpa" is the CPU eval path (attention_sdpa.py), "triton" the fused
kernel (attention_kernel.py), "auto" the fastest that can:

    impl    what it is                                     CPU                 CUDA
    auto    CUDA: triton; CPU: sdpa without gradients, else torch
    torch   chunked reference, every prior                 train + evaluate    train + evaluate
    sdpa    PyTorch's SDPA per query chunk, prior as mask  evaluate            -
    triton  flash-attention kernel, every prior            TRITON_INTERPRET=1  train + evaluate

sdpa also trains where the mask needs no gradient. An impl that cannot compute a call raises with
the reason; none swaps in another prior. sdpa and triton skip the keys first_keys rules out.
"""

import math
from typing import NamedTuple, Optional

import torch

from attention_kernel import attention_triton, interpreting, triton_available, triton_too_old
from attention_sdpa import attention_sdpa
from priors import BoundPrior, Prior, bind

IMPLS = ("auto", "torch", "sdpa", "triton")


def attention(
    q,
    k,
    v,
    *,
    doc_start=None,
    prior=None,
    row_scale=None,
    scale_prior=False,
    q_offset=None,
    softmax_scale=None,
    impl="auto",
    skip=True,
    key_norm=None,
    prior_gap=None,
):
    """Causal attention with a prior, computed by `impl` (resolved by pick_impl).

    q is (B, H, Tq, D), k and v (B, H, Tk, D), Tq <= Tk; query t is at position i = q_offset + t
    (default Tk - Tq). With content score l_ij = softmax_scale q_i . k_j (default 1/sqrt(D)):
        s_ij = (l_ij + prior(j - i)) r_i     if scale_prior (BAM + SSMax)
        s_ij = l_ij r_i + prior(j - i)       else
        out_i = sum_j softmax_j(s_ij) v_j    over the keys doc_start[i] <= j <= i
    prior: None (NoPE), a BoundPrior, or a GGD triple (theta_alpha, theta_beta, theta_mu) of (H,)
    tensors; prior(d) is its log-prior table by distance (priors.py). row_scale: r, (B or 1, H, Tq),
    SSMax's s_h log n_i, or None for 1. doc_start (B, Tk): where each position's document starts.
    skip: False reads every key, True skips keys provably below 2^-24 / Tk, "zero" below 2^-150
    (first_keys). key_norm (B, H): max |k_j|; prior_gap (H, >= Tk): prior_gap(prior, n); both if
    known (a KV cache's)."""
    args = AttentionArgs(doc_start, prior, row_scale, scale_prior, q_offset, softmax_scale, skip)
    args = args._replace(key_norm=key_norm, prior_gap=prior_gap).resolve(q, k, v)
    impl, first_key = plan(q, k, v, args, impl)
    if impl == "torch":
        return attention_torch(q, k, v, args)
    if impl == "sdpa":
        return attention_sdpa(q, k, v, args, first_key)
    return attention_triton(q, k, v, args, first_key)


class AttentionArgs(NamedTuple):
    """attention()'s keywords but impl; resolve() checks them, gives what every impl takes."""

    doc_start: Optional[torch.Tensor] = None
    prior: Optional[BoundPrior] = None
    row_scale: Optional[torch.Tensor] = None
    scale_prior: bool = False
    q_offset: Optional[int] = None
    softmax_scale: Optional[float] = None
    skip: bool | str = True
    key_norm: Optional[torch.Tensor] = None
    prior_gap: Optional[torch.Tensor] = None

    def resolve(self, q, k, v):
        """Args checked against q, k, v (ValueError names the misfit); prior bound (priors.bind,
        sole taker of GGD triples); q_offset int (default Tk - Tq: queries are the last positions);
        softmax_scale float (default 1/sqrt(D))."""
        B, H, Tq, D = q.shape
        Tk = k.shape[2]
        if k.shape != (B, H, Tk, D) or v.shape != k.shape:
            raise ValueError(
                f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                "do not match"
            )

        # Tq > Tk fails here too: no offset fits
        q_offset = Tk - Tq if self.q_offset is None else self.q_offset
        if not 0 <= q_offset <= Tk - Tq:
            raise ValueError(
                f"attention: q_offset={q_offset} puts queries outside the {Tk} keys (Tq={Tq})"
            )
        if self.doc_start is not None and self.doc_start.shape[-1] != Tk:
            raise ValueError(
                f"attention: doc_start has {self.doc_start.shape[-1]} positions, keys have {Tk}"
            )
        if self.row_scale is not None and self.row_scale.shape[-1] != Tq:
            raise ValueError(
                f"attention: row_scale has {self.row_scale.shape[-1]} rows, queries have {Tq}"
            )

        softmax_scale = 1.0 / math.sqrt(D) if self.softmax_scale is None else self.softmax_scale
        return self._replace(
            prior=bind(self.prior),
            scale_prior=bool(self.scale_prior),
            q_offset=int(q_offset),
            softmax_scale=float(softmax_scale),
        )

    def needs_grad(self, q, k, v):
        """Whether autograd wants a gradient of any input (prior params too)."""
        params = self.prior.params if self.prior is not None else ()
        tensors = (q, k, v, self.row_scale, *params)
        return torch.is_grad_enabled() and any(
            torch.is_tensor(t) and t.requires_grad for t in tensors
        )

    def query_chunks(self, Tq, rows):
        """(start, stop, earliest) per chunk of `rows` query rows start..stop-1; earliest: the
        first key any of them sees (their earliest document start)."""
        for start in range(0, Tq, rows):
            stop = min(start + rows, Tq)
            earliest = 0
            if self.doc_start is not None:
                positions = slice(self.q_offset + start, self.q_offset + stop)
                earliest = int(self.doc_start[:, positions].min())
            yield start, stop, earliest


def ssmax_log_n(pos, doc_start=None):
    """SSMax's log n_i at query positions pos (1-D); n_i = keys query i sees = its position in its
    document + 1 (as the authors). (B, T) with doc_start (B, T), else (1, T); r_i = s_h log n_i."""
    start = 0 if doc_start is None else doc_start
    return (pos[None, :] - start + 1).float().log()


def dense_attention(q, k, v, **kwargs):
    """attention()'s formula for its keywords (impl aside), dense (Tq x Tk) in float64: the spec
    the tests hold every impl to. Returns float64."""
    args = AttentionArgs(**kwargs).resolve(q, k, v)
    # query and key positions
    i = torch.arange(q.shape[2], device=q.device)[:, None] + args.q_offset
    j = torch.arange(k.shape[2], device=q.device)[None, :]

    content = args.softmax_scale * q.double() @ k.double().transpose(-1, -2)
    log_prior = 0.0
    if args.prior is not None:
        log_prior = args.prior.table((j - i).flatten()).double().view(-1, *(j - i).shape)
    row_scale = 1.0 if args.row_scale is None else args.row_scale.double()[..., None]
    if args.scale_prior:
        scores = (content + log_prior) * row_scale
    else:
        scores = content * row_scale + log_prior

    visible = j <= i
    if args.doc_start is not None:
        # (B, 1, Tq, Tk)
        visible = visible & (j >= args.doc_start[:, i])[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


# ---- The reference (impl "torch")
# dense_attention's math in fp32 per query chunk: only a (chunk x Tk) score block exists, so
# memory is linear in length. Any prior, any device.
def attention_torch(q, k, v, args, chunk_size=None):
    """attention()'s reference impl ("torch") for resolved AttentionArgs; chunk_size: query rows
    per chunk (default: fits 256 MiB)."""
    chunks = _chunked_probs(q, k, args, chunk_size)
    outs = [probs @ v[:, :, earliest:end].float() for _, _, earliest, end, probs in chunks]
    return torch.cat(outs, dim=2).to(q.dtype)


def attention_probs(q, k, **kwargs):
    """Weights softmax_j(s_ij) for attention()'s keywords (impl aside): (B, H, Tq, Tk) float32, 0
    on hidden keys. For inspecting a few rows."""
    args = AttentionArgs(**kwargs).resolve(q, k, k)
    all_probs = torch.zeros(*q.shape[:3], k.shape[2], device=q.device)
    for start, stop, earliest, end, probs in _chunked_probs(q, k, args):
        all_probs[:, :, start:stop, earliest:end] = probs
    return all_probs


def _chunked_probs(q, k, args, chunk_size=None):
    """(start, stop, earliest, end, softmax_j(s_ij)) per chunk: query rows start..stop-1, keys
    earliest..end-1."""
    # ~4 live fp32 (B, H, rows, Tk) temporaries: scores, prior, mask, probs
    batch, heads, Tq, _ = q.shape
    budget_bytes = 256 * 2**20
    rows = chunk_size or max(1, budget_bytes // (16 * batch * heads * max(k.shape[2], 1)))
    for start, stop, earliest in args.query_chunks(Tq, rows):
        scores = _chunk_scores(q, k, args, start, stop, earliest)
        yield start, stop, earliest, args.q_offset + stop, torch.softmax(scores, dim=-1)


def _chunk_scores(q, k, args, start, stop, earliest):
    """Masked scores s of query rows start..stop-1 vs keys earliest..q_offset + stop - 1:
    (B, H, stop - start, keys) fp32."""
    # one past the last key these rows see; then query and key positions
    end = args.q_offset + stop
    i = torch.arange(args.q_offset + start, end, device=q.device)[:, None]
    j = torch.arange(earliest, end, device=q.device)[None, :]
    queries = args.softmax_scale * q[:, :, start:stop].float()
    content = queries @ k[:, :, earliest:end].float().transpose(-1, -2)

    # depends on d = j - i only: evaluated once per distance (most negative first), gathered
    log_prior = 0.0
    if args.prior is not None:
        nearest = earliest - (end - 1)
        table = args.prior.table(torch.arange(nearest, stop - start, device=q.device))
        log_prior = table[:, j - i - nearest]
    row_scale = 1.0
    if args.row_scale is not None:
        row_scale = args.row_scale[:, :, start:stop, None].float()
    if args.scale_prior:
        scores = (content + log_prior) * row_scale
    else:
        scores = content * row_scale + log_prior

    visible = j <= i
    if args.doc_start is not None:
        visible = visible & (j >= args.doc_start[:, i])[:, None]
    # 0 where visible, -inf where hidden: faster on CPU than masked_fill; backward is identity
    hidden = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible, float("-inf"))
    return scores + hidden


# ---- Skipping: the keys a row's prior proves cannot matter
# In the README's notation, l_ij = softmax_scale q_i . k_j and B_h(d) the log-prior at d = j - i:
# s_ij = r_i l_ij + w_i B_h(j - i), with w_i = r_i if scale_prior, else 1. A row keeps its own key,
# so key j weighs at most e^(s_ij - s_ii). With kappa = max_j |k_j| (Cauchy-Schwarz: |l_ij| <=
# softmax_scale |q_i| kappa) and S(n) = max_{m >= n} B_h(-m), every key at distance n = i - j has
#     s_ij - s_ii <= |r_i| softmax_scale |q_i| kappa - r_i l_ii - w_i G(n),   G(n) = B_h(0) - S(n)
# for w_i > 0. G is non-decreasing, so row i's first key is F_i = i - n_i + 1, n_i the least n where
# that is <= -tau: each key before F_i weighs below e^-tau.
# - A row skips at most Tk keys: its skipped mass is below Tk e^-tau = 2^-24 / e for tau = ln Tk +
#   24 ln 2 + 1, within fp32 rounding of its sum.
# - A column is skipped by at most Tq <= Tk rows, each below e^-tau: its mass (dK, dV) alike.
# - The "+ 1" leaves a factor e of margin: the bound's own terms are rounded in fp32.
# "zero" (tau = 150 ln 2 + 1; always with gradients) skips weights below 2^-150, which fp32 rounds
# to 0. Flat priors (theta_beta <= 0), rows with w_i <= 0 and short rows keep every key.
def first_keys(q, k, args, grad=False):
    """F_i (B, H, Tq): the first key each row reads, at or after its document's start, for resolved
    AttentionArgs; None where skip is off or there is no prior."""
    if not args.skip or args.prior is None:
        return None

    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    tau = math.log(Tk) + 24 * math.log(2) + 1
    if grad or args.skip == "zero":
        tau = 150 * math.log(2) + 1

    # a longer table (a KV cache's, to its capacity) has a G no larger: its windows still hold
    gap = prior_gap(args.prior, Tk, q.device) if args.prior_gap is None else args.prior_gap

    # of the keys, only the rows' own are read: a decode step converts one, not the cache
    rows = torch.arange(Tq, device=q.device) + args.q_offset
    queries = q.detach().float()
    own_keys = k[:, :, args.q_offset : args.q_offset + Tq].detach().float()
    kappa = args.key_norm
    if kappa is None:
        kappa = k.detach().float().norm(dim=-1).amax(-1)
    diagonal = args.softmax_scale * (queries * own_keys).sum(-1)
    content = args.softmax_scale * queries.norm(dim=-1) * kappa[..., None]

    r = torch.ones(B, H, Tq, device=q.device)
    if args.row_scale is not None:
        r = args.row_scale.detach().float().expand(B, H, Tq)
    w = r if args.scale_prior else torch.ones_like(r)
    need = (r.abs() * content - r * diagonal + tau) / w
    need = need.masked_fill(w <= 0, float("inf"))

    # per head, every batch's rows at once
    need = need.transpose(0, 1).reshape(H, B * Tq)
    distance = torch.searchsorted(gap, need).view(H, B, Tq).transpose(0, 1)
    first_key = (rows - distance + 1).clamp_min(0)
    if args.doc_start is not None:
        first_key = torch.maximum(first_key, args.doc_start[:, None, rows])
    return first_key


def prior_gap(prior, n, device):
    """G(n) = B_h(0) - max_{m >= n} B_h(-m) at n = 0 .. n - 1: (H, n) float32, non-decreasing. It
    depends on the prior alone: a KV cache builds it once, for its capacity."""
    log_prior = prior.table(-torch.arange(n, device=device)).float()
    suffix_max = log_prior.flip(-1).cummax(-1).values.flip(-1)
    return (log_prior[:, :1] - suffix_max).contiguous()


# ---- Which impl can compute which prior, where
def plan(q, k, v, args, impl):
    """(impl, first keys) of a call with resolved AttentionArgs: pick_impl's impl, and first_keys'
    where that impl skips (the reference reads every key)."""
    grad = args.needs_grad(q, k, v)
    impl = pick_impl(impl, args.prior, q.device, grad, q.dtype, q.shape[-1])
    first_key = None if impl == "torch" else first_keys(q, k, args, grad)
    return impl, first_key


def _trained(prior):
    """A registered Prior with trainable params, or a BoundPrior whose params require grad."""
    if isinstance(prior, Prior):
        return bool(prior.trainable)
    return prior is not None and any(t.requires_grad for t in prior.params)


def impl_error(impl, prior, device, grad, dtype=None, head_dim=None):
    """Why `impl` cannot compute `prior` (Prior, BoundPrior or None) on `device` ("cpu", "cuda",
    torch.device), with gradients if grad, for `dtype`, `head_dim` (None: any); None if it can."""
    if impl not in IMPLS:
        return f"unknown attention impl {impl!r}; choose one of {', '.join(IMPLS)}"

    device = torch.device(device)
    if impl == "sdpa" and device.type != "cpu":
        return "impl='sdpa' is the CPU evaluation path; on a GPU use impl='triton' (or 'auto')"
    if impl == "sdpa" and grad and _trained(prior):
        return (
            "impl='sdpa' cannot train a prior (it enters PyTorch's fused kernel as a constant "
            "mask); train with impl='torch' (or 'auto')"
        )

    if impl == "triton" and not triton_available():
        return "impl='triton' needs the triton package (pip install triton)"
    # a Triton too old for the kernel stops a GPU run, with "auto" too: not the slow reference
    too_old = triton_too_old()
    if too_old and (impl == "triton" or impl == "auto" and device.type == "cuda"):
        return too_old
    if impl == "triton" and device.type != "cuda" and not interpreting():
        return (
            "impl='triton' needs a CUDA device (or TRITON_INTERPRET=1 set before triton is first "
            "imported)"
        )
    kernel_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if impl == "triton" and dtype is not None and dtype not in kernel_dtypes:
        return (
            f"impl='triton' computes in float32, float16 or bfloat16, not {dtype}; use impl='torch'"
        )
    if impl == "triton" and head_dim is not None and head_dim > 256:
        return f"impl='triton' supports head_dim <= 256, not {head_dim}; use impl='torch'"
    return None


def pick_impl(impl, prior, device, grad, dtype=None, head_dim=None):
    """`impl` resolved: "auto" is the fastest that can (CUDA: triton; CPU: sdpa without gradients,
    else torch); an impl that cannot raises ValueError(impl_error's message)."""
    error = impl_error(impl, prior, device, grad, dtype, head_dim)
    if error:
        raise ValueError(error)
    if impl != "auto":
        return impl

    if torch.device(device).type == "cuda":
        order = ("triton", "torch")
    else:
        order = ("torch",) if grad else ("sdpa", "torch")
    return next(i for i in order if impl_error(i, prior, device, grad, dtype, head_dim) is None)
