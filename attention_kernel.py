"""
The single attention entry point of bam-gpt, and the positional prior it adds.

    out = attention(q, k, v, *, doc_start=None, prior=None, row_scale=None,
                    scale_prior=False, q_offset=None, softmax_scale=None, impl="auto")

For query position i and key position j (0-based, d = j - i <= 0 under the causal mask):

    l_ij = softmax_scale * q_i . k_j                        content score, softmax_scale = 1/sqrt(head_dim)
    B(d) = -exp(theta_alpha) * (|d - mu| + 1e-5)^theta_beta   GGD log-prior, mu = 2 sinh(theta_mu), per head
    s_ij = (l_ij + B(d)) * r_i     if scale_prior             BAM + SSMax: the prior is scaled too
         =  l_ij * r_i + B(d)      otherwise                  ALiBi + SSMax, and every variant without SSMax (r = 1)
    key j is visible to query i iff doc_start[i] <= j <= i    causal AND same-document
    out_i = sum_j softmax_j(s_ij) v_j

The logit is "log likelihood of the content match + log prior of the distance", so the softmax is the
posterior over which key to read (the paper's reading). NoPE is B = 0 (uniform prior), ALiBi is
theta_beta = 1 with theta_alpha = log(slope) (Laplace prior), theta_beta = 0 gives a constant (NoPE again).

Shapes: q (B, H, Tq, D); k, v (B, H, Tk, D) with Tq <= Tk; query t sits at absolute position q_offset + t
(default Tk - Tq, i.e. the queries are the last Tq positions). doc_start is (B, Tk) int: the first position
of the document that each position belongs to. prior is (theta_alpha, theta_beta, theta_mu), each (H,).
row_scale is (B or 1, H, Tq). Everything is differentiable: q, k, v, the three prior tensors, row_scale.

impl="torch" is the plain-PyTorch reference below: it loops over query chunks and only ever materialises a
(chunk x Tk) score block, so memory is linear in the length. The Triton kernel (impl="triton") implements the
same contract without any T x T tensor; impl="auto" picks the kernel for CUDA tensors and the reference otherwise.
"""
import math

import torch
import torch.nn.functional as F

GGD_EPS = 1e-5  # keeps (|d - mu| + eps)^theta_beta finite at d = mu when theta_beta < 0 (spec §3)


# ----------------------------------------------------------------------------------------------------------
# THE PRIOR. To try your own positional prior, edit this one function (and keep its signature): it maps a
# 1-D tensor of signed distances d = j - i to the log-prior added to the logits, one row per head.
# The PyTorch attention path, the model, plot_prior.py and the evaluations all call it; the Triton kernel
# hard-codes the GGD form (and its derivatives) for speed, so a new prior runs with impl="torch".
# ----------------------------------------------------------------------------------------------------------
def ggd_prior(d, theta_alpha, theta_beta, theta_mu):
    """GGD-BAM log-prior B_h(d) = -exp(theta_alpha_h) * (|d - mu_h| + eps)^theta_beta_h, mu_h = 2 sinh(theta_mu_h).

    d: (N,) distances (any dtype); theta_*: (H,). Returns (H, N) float32. This is the log-density of a
    generalised Gaussian centred at mu with shape theta_beta (up to a constant that softmax ignores):
    theta_beta = 1 is Laplace (ALiBi), 0 is uniform (NoPE), < 0 puts the mass *far* from the query.
    """
    d = d.float()[None, :]
    alpha, beta, mu_raw = (t.float()[:, None] for t in (theta_alpha, theta_beta, theta_mu))
    mu = 2.0 * torch.sinh(mu_raw)  # exp(theta_mu) - exp(-theta_mu): an odd, unbounded reparametrisation
    return -torch.exp(alpha) * torch.pow((d - mu).abs() + GGD_EPS, beta)


def alibi_slopes(n_head):
    """ALiBi's fixed per-head slopes (Press et al.), including head counts that are not powers of two (spec §2)."""
    def power_of_2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]
    c = 2 ** int(math.floor(math.log2(n_head)))
    slopes = power_of_2(c)
    if c < n_head:  # the first n - c slopes at even indices of the 2c-head sequence
        slopes += power_of_2(2 * c)[0::2][: n_head - c]
    return torch.tensor(slopes, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Reference implementation (CPU, tests, and any custom prior)
# ----------------------------------------------------------------------------------------------------------
def _chunk_rows(batch, heads, n_keys, budget_bytes=256 * 2**20):
    # ~4 fp32 temporaries of shape (B, H, rows, n_keys) are alive at once (scores, bias, mask fill, probs)
    return max(1, budget_bytes // (16 * batch * heads * max(n_keys, 1)))


def attention_torch(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
                    q_offset=None, softmax_scale=None, chunk_size=None, prior_fn=ggd_prior):
    """Plain-PyTorch attention with the contract above, chunked over queries (peak memory O(chunk x Tk))."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    q_offset = Tk - Tq if q_offset is None else int(q_offset)
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    chunk = chunk_size or _chunk_rows(B, H, Tk)
    outs = []
    for a in range(0, Tq, chunk):
        b = min(a + chunk, Tq)
        i0, i1 = q_offset + a, q_offset + b  # absolute positions of this chunk's queries: [i0, i1)
        # keys that any query of the chunk can see: [lo, i1). lo skips keys before the earliest document start.
        lo = int(doc_start[:, i0:i1].min()) if doc_start is not None else 0
        qpos = torch.arange(i0, i1, device=q.device)
        kpos = torch.arange(lo, i1, device=q.device)
        s = torch.matmul(q[:, :, a:b].float(), k[:, :, lo:i1].float().transpose(-1, -2)) * softmax_scale
        if prior is not None:
            # the prior depends only on d = j - i: evaluate it once per distinct distance, then gather
            dmin = lo - (i1 - 1)
            table = prior_fn(torch.arange(dmin, i1 - i0, device=q.device), *prior)  # (H, n_dist)
            bias = table[:, kpos[None, :] - qpos[:, None] - dmin]  # (H, rows, keys)
        if row_scale is not None:
            r = row_scale[:, :, a:b, None].float()
            if prior is not None:
                s = (s + bias) * r if scale_prior else s * r + bias
            else:
                s = s * r
        elif prior is not None:
            s = s + bias
        visible = kpos[None, :] <= qpos[:, None]  # causal, (rows, keys)
        if doc_start is not None:  # same document, (B, 1, rows, keys)
            visible = (visible & (kpos[None, None, :] >= doc_start[:, i0:i1, None]))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, v[:, :, lo:i1].float()).to(q.dtype))
    return torch.cat(outs, dim=2)


def attention(q, k, v, *, doc_start=None, prior=None, row_scale=None, scale_prior=False,
              q_offset=None, softmax_scale=None, impl="auto"):
    """The one attention function the model calls. See the module docstring for the math and shapes."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    Tq, Tk = q.shape[2], k.shape[2]
    if Tq > Tk:
        raise ValueError(f"attention: Tq={Tq} queries but only Tk={Tk} keys; queries must be the last positions")
    if q_offset is not None and not 0 <= q_offset <= Tk - Tq:
        raise ValueError(f"attention: q_offset={q_offset} puts queries outside the {Tk} keys (Tq={Tq})")
    use_triton = impl == "triton" or (impl == "auto" and q.is_cuda and _triton_available())
    if use_triton:
        return attention_triton(q, k, v, doc_start=doc_start, prior=prior, row_scale=row_scale,
                                scale_prior=scale_prior, q_offset=q_offset, softmax_scale=softmax_scale)
    return attention_torch(q, k, v, doc_start=doc_start, prior=prior, row_scale=row_scale,
                           scale_prior=scale_prior, q_offset=q_offset, softmax_scale=softmax_scale)


def _triton_available():
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


# ----------------------------------------------------------------------------------------------------------
# Triton kernel: see issue #5. Until it lands, impl="triton" is an explicit error rather than a silent fallback.
# ----------------------------------------------------------------------------------------------------------
def attention_triton(q, k, v, **kwargs):
    raise NotImplementedError("the Triton attention kernel is not implemented yet; use impl='torch'")
