"""
The attention of bam-gpt: one function, one formula, several implementations of it.

attention() is causal softmax attention with a log-prior over the distance from query to key (the
paper's BAM), SSMax's row scale and document boundaries. dense_attention writes its formula out as
the specification; "torch" is the chunked reference (any prior, any device), "sdpa" the CPU
evaluation path, "triton" the fused kernel (CUDA, attention_kernel.py), "auto" the fastest that can.
attention() checks and resolves its arguments once, impl_error says which impl can do what, and
check_kernel compares the kernel with the reference before a run trusts it.
"""

import math
import time
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from attention_kernel import attention_triton, check_length, interpreting, triton_available
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
):
    """Causal attention with a prior, computed by `impl` (resolved by pick_impl).

    q is (B, H, Tq, D), k and v (B, H, Tk, D), Tq <= Tk; query t sits at position i = q_offset + t
    (default Tk - Tq). With the content score l_ij = softmax_scale q_i . k_j (default 1/sqrt(D)):
        s_ij = (l_ij + prior(j - i)) r_i     if scale_prior (BAM + SSMax)
        s_ij = l_ij r_i + prior(j - i)       else
        out_i = sum_j softmax_j(s_ij) v_j    over the keys doc_start[i] <= j <= i
    prior: None (NoPE), a BoundPrior, or a bare GGD triple (theta_alpha, theta_beta, theta_mu) of
    (H,) tensors; prior(d) is its table of log-priors by distance (priors.py). row_scale: r, of
    shape (B or 1, H, Tq), SSMax's s_h log n_i, or None for 1. doc_start (B, Tk): the position
    where each position's document starts."""
    args = AttentionArgs(doc_start, prior, row_scale, scale_prior, q_offset, softmax_scale)
    args = args.resolve(q, k, v)

    grad = needs_grad(q, k, v, args.prior, args.row_scale)
    impl = pick_impl(impl, args.prior, q.device, grad, q.dtype, q.shape[-1])
    implementation = {"torch": attention_torch, "sdpa": attention_sdpa, "triton": attention_triton}
    return implementation[impl](q, k, v, args)


class AttentionArgs(NamedTuple):
    """attention()'s keywords but impl. resolve() checks them and returns what every impl takes."""

    doc_start: Optional[torch.Tensor] = None
    prior: Optional[BoundPrior] = None
    row_scale: Optional[torch.Tensor] = None
    scale_prior: bool = False
    q_offset: Optional[int] = None
    softmax_scale: Optional[float] = None

    def resolve(self, q, k, v):
        """These arguments checked against q, k and v (a ValueError names what does not fit), the
        prior bound (priors.bind: the one place that takes a GGD triple), q_offset an int (default
        Tk - Tq: the queries are the last positions), softmax_scale a float (default 1/sqrt(D))."""
        prior = bind(self.prior)
        _check_shapes(q, k, v, self.doc_start, self.row_scale, self.q_offset)

        q_offset = self.q_offset
        if q_offset is None:
            q_offset = k.shape[2] - q.shape[2]
        softmax_scale = self.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])

        return self._replace(
            prior=prior,
            scale_prior=bool(self.scale_prior),
            q_offset=int(q_offset),
            softmax_scale=float(softmax_scale),
        )


def _check_shapes(q, k, v, doc_start, row_scale, q_offset):
    """attention()'s argument checks, the same for every impl: a ValueError names what does not
    fit."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if k.shape != (B, H, Tk, D) or v.shape != k.shape:
        raise ValueError(
            f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
        )
    if Tq > Tk:
        raise ValueError(
            f"attention: Tq={Tq} queries but only Tk={Tk} keys; queries must be the last positions"
        )

    if q_offset is not None and not 0 <= q_offset <= Tk - Tq:
        raise ValueError(
            f"attention: q_offset={q_offset} puts queries outside the {Tk} keys (Tq={Tq})"
        )
    if doc_start is not None and doc_start.shape[-1] != Tk:
        raise ValueError(
            f"attention: doc_start has {doc_start.shape[-1]} positions, keys have {Tk}"
        )
    if row_scale is not None and row_scale.shape[-1] != Tq:
        raise ValueError(f"attention: row_scale has {row_scale.shape[-1]} rows, queries have {Tq}")


def dense_attention(q, k, v, **kwargs):
    """attention()'s formula for its keywords (impl aside), written out densely (Tq x Tk) in
    float64: the specification the tests hold every impl to. Returns float64."""
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


# ---- The reference (impl "torch") ----------------------------------------------------------------
# dense_attention's math in fp32, a chunk of queries at a time, so that only a (chunk x Tk) block of
# scores ever exists: memory is linear in the length. Any prior, any device.
def attention_torch(q, k, v, args, chunk_size=None):
    """The reference implementation of attention() (impl "torch"), for its resolved AttentionArgs;
    chunk_size: query rows per chunk (default: what fits _chunk_rows' budget)."""
    chunks = _chunked_probs(q, k, args, chunk_size)
    outs = [probs @ v[:, :, first_key:end].float() for _, _, first_key, end, probs in chunks]
    return torch.cat(outs, dim=2).to(q.dtype)


def attention_probs(q, k, **kwargs):
    """The attention weights softmax_j(s_ij) for attention()'s keywords (impl aside): (B, H, Tq,
    Tk) float32, 0 on hidden keys. For inspecting a few rows."""
    args = AttentionArgs(**kwargs).resolve(q, k, k)
    all_probs = torch.zeros(*q.shape[:3], k.shape[2], device=q.device)
    for start, stop, first_key, end, probs in _chunked_probs(q, k, args):
        all_probs[:, :, start:stop, first_key:end] = probs
    return all_probs


def _chunked_probs(q, k, args, chunk_size=None):
    """(start, stop, first_key, end, softmax_j(s_ij)) per chunk of query rows start..stop-1, over
    their keys first_key..end-1."""
    chunk = chunk_size or _chunk_rows(q.shape[0], q.shape[1], k.shape[2])
    for start, stop, first_key in _query_chunks(q.shape[2], args.doc_start, args.q_offset, chunk):
        scores = _chunk_scores(q, k, args, start, stop, first_key)
        yield start, stop, first_key, args.q_offset + stop, torch.softmax(scores, dim=-1)


def _chunk_rows(batch, heads, n_keys, budget_bytes=256 * 2**20):
    # ~4 fp32 temporaries of shape (B, H, rows, n_keys) are alive at once (scores, prior, mask,
    # probabilities)
    return max(1, budget_bytes // (16 * batch * heads * max(n_keys, 1)))


def _query_chunks(Tq, doc_start, q_offset, chunk):
    """(start, stop, first_key) per chunk: query rows start..stop-1, and the first key any of them
    can see."""
    for start in range(0, Tq, chunk):
        stop = min(start + chunk, Tq)
        first_key = 0
        if doc_start is not None:
            first_key = int(doc_start[:, q_offset + start : q_offset + stop].min())
        yield start, stop, first_key


def _chunk_scores(q, k, args, start, stop, first_key):
    """The masked scores s of query rows start..stop-1 against keys first_key..q_offset + stop - 1:
    (B, H, stop - start, keys) fp32."""
    # one past the last key any of these rows sees; then the query and key positions
    end = args.q_offset + stop
    i = torch.arange(args.q_offset + start, end, device=q.device)[:, None]
    j = torch.arange(first_key, end, device=q.device)[None, :]
    queries = args.softmax_scale * q[:, :, start:stop].float()
    content = queries @ k[:, :, first_key:end].float().transpose(-1, -2)

    # a function of d = j - i alone: evaluated once per distance (the most negative one first),
    # then gathered
    log_prior = 0.0
    if args.prior is not None:
        nearest = first_key - (end - 1)
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
    return scores + _neg_inf_where(~visible)


def _neg_inf_where(hidden):
    # 0 where visible, -inf where hidden, added to the scores: faster on CPU than masked_fill, and
    # its backward is the identity
    return torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))


# ---- The one decision point: which impl can compute which prior, where ---------------------------
def ssmax_log_n(pos, doc_start=None):
    """SSMax's log n_i of the queries at positions pos (1-D), n_i the keys query i sees: its
    position in its document + 1 (as the authors). (B, T) with doc_start (B, T), else (1, T); the
    row scale is then r_i = s_h log n_i."""
    if doc_start is not None:
        n = pos[None, :] - doc_start + 1
    else:
        n = (pos + 1)[None, :]
    return n.float().log()


def needs_grad(*tensors):
    """Whether autograd will want a gradient of any of these (tensors, BoundPriors, None)."""
    flat = []
    for x in tensors:
        flat += x.params if isinstance(x, BoundPrior) else (x,)
    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in flat)


def _trained(prior):
    """A registered Prior with trainable parameters, or a BoundPrior whose parameters require
    grad."""
    if isinstance(prior, Prior):
        return bool(prior.trainable)
    return prior is not None and any(t.requires_grad for t in prior.params)


def impl_error(impl, prior, device, grad, dtype=None, head_dim=None):
    """Why `impl` cannot compute `prior` (a Prior, a BoundPrior or None) on `device` ("cpu", "cuda"
    or a torch.device) with gradients (grad=True) or without, for inputs of `dtype` and `head_dim`
    (None: any); None if it can."""
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
    """`impl` resolved: "auto" becomes the fastest impl that can (CUDA: triton; CPU: sdpa without
    gradients, else torch); an impl that cannot raises ValueError with impl_error's message."""
    if impl == "auto":
        if torch.device(device).type == "cuda":
            order = ("triton", "torch")
        else:
            order = ("torch",) if grad else ("sdpa", "torch")
        return next(i for i in order if impl_error(i, prior, device, grad, dtype, head_dim) is None)

    error = impl_error(impl, prior, device, grad, dtype, head_dim)
    if error:
        raise ValueError(error)
    return impl


# ---- CPU evaluation (impl "sdpa") ----------------------------------------------------------------
# PyTorch's fused CPU attention kernel with the prior as a float attn_mask. Per query chunk, r_i
# moves into the queries: s_ij = ((q_i r_i) . k_j) * softmax_scale + M_ij, M_ij = prior(j - i) r_i
# if scale_prior else prior(j - i), -inf where invisible. With the keys reversed, M is a Hankel
# matrix: a strided view of the reversed prior table, no copy. Only a mask that depends on more than
# the distance (SSMax scaling the prior, documents) is written, into one buffer every chunk reuses
# (fresh ones cost more in page faults than the kernel); the buffer bounds the chunk, so memory
# stays linear in the length.
def _sdpa_chunk_rows(batch, heads, n_keys, budget_bytes=128 * 2**20):
    # one fp32 (batch, heads, rows, keys) mask buffer; the fused kernel's blocks want a few hundred
    # rows
    return int(min(512, max(64, budget_bytes // (4 * batch * heads * max(n_keys, 1)))))


def _hankel_mask(reversed_table, rows, row_scale, doc_rows, newest_key, buf):
    """One chunk's float mask, (B or 1, H or 1, rows, keys), keys in reverse order (see above); a
    view of reversed_table when it can be. reversed_table: (H or 1, rows + keys - 1), entry u for
    distance d = rows - 1 - u; row_scale: (B or 1, H, rows, 1) when it scales the prior, else None;
    doc_rows: (B, rows) document starts or None; newest_key: the position of the first (reversed)
    key; buf: a reused buffer, or None under autograd."""
    H, n = reversed_table.shape
    keys = n - rows + 1
    # a function of the distance alone: causality (d > 0) is -inf table entries
    if row_scale is None:
        future = torch.arange(n, device=reversed_table.device) < rows - 1
        reversed_table = reversed_table.masked_fill(future, float("-inf"))
    view = reversed_table.as_strided((1, H, rows, keys), (H * n, n, 1, 1))
    if row_scale is None and doc_rows is None:
        return view

    batch = doc_rows.shape[0] if doc_rows is not None else row_scale.shape[0]
    shape = (batch, H if row_scale is None else row_scale.shape[1], rows, keys)
    mask = buf[: math.prod(shape)].view(shape) if buf is not None else None
    if row_scale is None:
        mask = view.expand(shape).clone() if mask is None else mask.copy_(view.expand(shape))
    else:
        if mask is None:
            mask = view.expand(shape) * row_scale
        else:
            mask = torch.mul(view.expand(shape), row_scale, out=mask)
        # causality: key column c is after query row r iff r + c < rows - 1, in the first rows - 1
        # columns
        idx = torch.arange(rows, device=mask.device)
        future = idx[:, None] + idx[None, : rows - 1] < rows - 1
        mask[..., : rows - 1].add_(_neg_inf_where(future))

    if doc_rows is None:
        return mask

    # columns 0..shared of the reversed keys lie in every row's document; later ones may not
    shared = int(newest_key - doc_rows.max())
    if shared < keys - 1:
        key_pos = newest_key - torch.arange(shared + 1, keys, device=mask.device)
        before_doc = key_pos[None, None, :] < doc_rows[:, :, None]
        mask[..., shared + 1 :].add_(_neg_inf_where(before_doc)[:, None])
    return mask


def _reversed_prior_table(prior, nearest, farthest, device, like):
    """The log-prior of distances farthest down to nearest, (H, farthest - nearest + 1), or zeros
    (1, n) without a prior."""
    if prior is None:
        return like.new_zeros(1, farthest - nearest + 1)
    return prior.table(torch.arange(nearest, farthest + 1, device=device)).flip(1)


def attention_sdpa(q, k, v, args, chunk_size=None):
    """attention() through torch's fused CPU SDPA kernel (impl "sdpa"), for its resolved
    AttentionArgs, chunked over queries (see above; chunk_size: query rows per chunk). Under
    autograd each chunk's mask is a fresh tensor that the backward keeps (training memory O(T^2));
    impl_error says that it does not train a prior."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    prior = args.prior
    chunk = chunk_size or _sdpa_chunk_rows(B, H, Tk)
    dtype = q.dtype
    # fp32 inside, like the reference
    q = q.float()
    k = k.float()
    v = v.float()
    plain = prior is None and args.row_scale is None and args.doc_start is None
    if plain and args.q_offset == 0 and Tq == Tk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args.softmax_scale)
        return out.to(dtype)

    scaled_prior = args.row_scale is not None and args.scale_prior and prior is not None
    written = args.doc_start is not None or scaled_prior
    grad = needs_grad(q, k, v, prior, args.row_scale)
    buf = q.new_empty(B * H * min(chunk, Tq) * Tk) if written and not grad else None
    # key j sits at Tk - 1 - j
    k_rev = k.flip(2)
    v_rev = v.flip(2)

    outs = []
    for start, stop, first_key in _query_chunks(Tq, args.doc_start, args.q_offset, chunk):
        # the absolute positions of the chunk's queries: [first_query, end); keys before
        # first_key are invisible to all of them
        first_query = args.q_offset + start
        end = args.q_offset + stop
        table = _reversed_prior_table(prior, first_key - (end - 1), stop - start - 1, q.device, q)
        queries = q[:, :, start:stop]
        row_scale = None
        if args.row_scale is not None:
            row_scale = args.row_scale[:, :, start:stop, None].float()
            queries = queries * row_scale

        mask_row_scale = row_scale if args.scale_prior and prior is not None else None
        doc_rows = args.doc_start[:, first_query:end] if args.doc_start is not None else None
        mask = _hankel_mask(table, stop - start, mask_row_scale, doc_rows, end - 1, buf)
        keys = k_rev[:, :, Tk - end : Tk - first_key]
        values = v_rev[:, :, Tk - end : Tk - first_key]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=args.softmax_scale
        )
        outs.append(out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(dtype)


# ---- The kernel's self-check ---------------------------------------------------------------------
# A compiled kernel can compute wrong numbers without an error on a GPU that no test ran on, so
# every run that resolves to impl "triton" first compares it with the reference on one small problem
# shaped like the run (check_kernel), the reference in fp32 on the same rounded inputs; the errors
# are relative (_check_errors). A correct kernel differs by the roundings the reference does
# not make: with 16-bit inputs, P before P V and dS before dS K and dS^T Q are rounded to 8 bits
# (bfloat16) or 11 (float16), and the output once more. The prior's and SSMax's gradients are sums
# in fp32 (attention_kernel._own_delta). Measured by dev/check_errors.py on every registered prior,
# SSMax off, on and scaling the prior, three seeds, head_dim 32 and 64, the largest errors were:
#   float32: output 2.3e-6, q k v 3.7e-6, parameters 2.9e-5
#   float16: output 4.2e-4, q k v 1.2e-3, parameters 4.9e-5
#   bfloat16: output 8.7e-3, q k v 3.3e-2, parameters 2.8e-5
# The tolerances leave 3x to 40x over those; a misread table moves scores by a distance's worth of
# prior, and the gradients of its parameters by far more than 1e-3 (tests/test_kernel.py's
# test_self_check_catches_a_misread_table). (output, q k v, parameters) per dtype:
CHECK_TOLERANCE = {
    torch.float32: (1e-4, 1e-4, 1e-3),
    torch.float16: (4e-3, 1e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-1, 1e-3),
}
CHECK_HEADS = 2  # head 0 with a positive SSMax scale, head 1 with a negative one


class KernelMismatch(RuntimeError):
    """The Triton kernel disagrees with the reference on check_kernel's problem."""


def check_kind(name):
    """The kind of one of check_kernel's results, each kind with its tolerance: the output, the
    inputs' gradients (q, k, v) or the parameters' (the prior's, SSMax's s)."""
    if name == "output":
        return "output"
    return "inputs" if name in ("q", "k", "v") else "parameters"


def _check_errors(kernel, reference, family):
    """{name: max |kernel - reference| / scale} of check_kernel's results, the scale max |reference|
    (floored at 1e-3, so that a gradient that is 0 is compared absolutely), for the prior's
    parameters taken over all of them together: each is a sum over every score of dS times a table
    of like size, so their errors are alike, while one of them may be near 0 by chance."""
    params = [n for n in reference if family is not None and n in family.params]
    scale = {n: reference[n].double().abs().max() for n in reference}
    for name in params:
        scale[name] = max(scale[p] for p in params)

    errors = {}
    for name in reference:
        difference = (kernel[name].double() - reference[name].double()).abs().max()
        errors[name] = (difference / scale[name].clamp_min(1e-3)).item()
    return errors


def _check_inputs(family, head_dim, dtype, ssmax, documents, seed=0):
    """check_kernel's problem, on the CPU and from its own generator (the run's RNG is untouched):
    q, k, v (B, H, T, D) of dtype in the model's (B, T, H, D) layout, dout, doc_start or None, the
    prior's parameters (its default init moved at random: a constant prior hides misreads) and
    SSMax's s, one sign per head, whose row scales s log n are -0.0 where n = 1."""
    gen = torch.Generator().manual_seed(seed)
    B, H, T, D = 2, CHECK_HEADS, check_length(head_dim, dtype), head_dim
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2) for _ in range(3))
    # the output's gradient in its dtype, as autograd hands it to the kernel's backward
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)

    # three documents per row, starting at random positions
    doc_start = None
    if documents:
        doc_start = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            for start in sorted((torch.randperm(T - 1, generator=gen)[:2] + 1).tolist()):
                doc_start[b, start:] = start

    params = ()
    if family is not None:
        # some inits draw from the global RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            params = tuple(t.float() for t in family.initial("default", H))
        if family.trainable:
            params = tuple(t + 0.5 * torch.randn(t.shape, generator=gen) for t in params)

    s = torch.tensor([1.0, -0.6]) if ssmax else None
    return q, k, v, dout, doc_start, params, s


def _check_run(impl, inputs, family, trained, scale_prior, device, training):
    """impl's output and, when training, its gradients {name: tensor}, on check_kernel's inputs
    (the reference takes fp32 copies of the same rounded q, k, v)."""
    q, k, v, dout, doc_start, params, s = inputs
    if impl == "torch":
        q, k, v = q.float(), k.float(), v.float()

    leaves = dict(q=q, k=k, v=v)
    if family is not None:
        leaves |= {n: t for n, t in zip(family.params, params) if n in trained}
    if s is not None:
        leaves["s"] = s
    leaves = {n: t.to(device, copy=True).requires_grad_(training) for n, t in leaves.items()}
    prior = None
    if family is not None:
        values = [leaves.get(n, t.to(device)) for n, t in zip(family.params, params)]
        prior = BoundPrior(family, tuple(values))

    # the model's SSMax: s_h log n_i, n_i the keys visible to query i
    row_scale = None
    if s is not None:
        log_n = ssmax_log_n(torch.arange(q.shape[2]), doc_start).to(device)
        row_scale = leaves["s"][None, :, None] * log_n[:, None, :]
    with torch.set_grad_enabled(training):
        out = attention(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            doc_start=doc_start.to(device) if doc_start is not None else None,
            prior=prior,
            row_scale=row_scale,
            scale_prior=scale_prior,
            impl=impl,
        )
        results = {"output": out.detach().float().cpu()}
        if training:
            (out.float() * dout.to(device)).sum().backward()
            results |= {n: t.grad.float().cpu() for n, t in leaves.items()}
    return results


def _check_line(errors, dtype, head_dim, family, ssmax, scale_prior, documents, length):
    """check_kernel's line: the problem, and the largest error of each kind against its tolerance.
    Also returns whether every error is within its tolerance."""
    tolerances = dict(zip(("output", "inputs", "parameters"), CHECK_TOLERANCE[dtype]))
    kinds = {name: check_kind(name) for name in errors}
    # kind: the name of its largest error (NaN counts as the largest)
    worst = {}
    for name, kind in kinds.items():
        if kind not in worst or not errors[name] <= errors[worst[kind]]:
            worst[kind] = name

    what = family.name if family is not None else "no prior"
    if ssmax:
        what += " + SSMax" + (" scaling the prior" if scale_prior and family is not None else "")
    if documents:
        what += ", documents"

    parts = []
    for kind, name in worst.items():
        which = "" if kind == "output" else f" ({name})"
        parts.append(f"{kind} {errors[name]:.1e}{which} (tolerance {tolerances[kind]:.0e})")
    line = (
        f"attention kernel check ({str(dtype).removeprefix('torch.')}, head_dim {head_dim}, "
        f"{what}, {length} tokens): {', '.join(parts)}"
    )
    # NaN is not <=
    ok = all(errors[name] <= tolerances[kinds[name]] for name in errors)
    return line, ok


def check_kernel(
    *, impl, family, trained, head_dim, dtype, device, ssmax, scale_prior, training, documents
):
    """Compare the Triton kernel with the reference on one small problem shaped like a run: its
    dtype, head_dim, prior family (a Prior or None; `trained`: the names of its parameters that the
    run trains), SSMax and its placement (scale_prior), documents, and gradients when training.
    Returns the line to print, or None where `impl` does not resolve to the kernel; raises
    KernelMismatch (the same line) where an error is over CHECK_TOLERANCE."""
    if pick_impl(impl, family, device, training, dtype, head_dim) != "triton":
        return None

    started = time.time()
    inputs = _check_inputs(family, head_dim, dtype, ssmax, documents)
    run = (family, trained if training else (), scale_prior, device, training)
    kernel = _check_run("triton", inputs, *run)
    reference = _check_run("torch", inputs, *run)
    errors = _check_errors(kernel, reference, family)

    length = inputs[0].shape[2]
    line, ok = _check_line(errors, dtype, head_dim, family, ssmax, scale_prior, documents, length)
    if not ok:
        raise KernelMismatch(f"the Triton kernel disagrees with the reference: {line}")
    return f"{line}: ok in {time.time() - started:.1f} s"
