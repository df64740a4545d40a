"""
attention() on CPU via PyTorch's fused scaled_dot_product_attention (impl "sdpa"), prior as a float
mask, per query chunk: 4-5x faster than the reference on long passkey prompts. Evaluation only: the
mask is a constant to the fused kernel, so no prior trains (see attention.impl_error).

Per chunk, r_i moves into the queries: s_ij = ((q_i r_i) . k_j) softmax_scale + M_ij, with
M_ij = prior(j - i) r_i if scale_prior else prior(j - i), -inf where key j is hidden. With keys
reversed, M is Hankel: a strided view of the reversed prior table, no copy. Only masks depending
on more than distance (SSMax scaling the prior, documents) are written, to one buffer all chunks
reuse (fresh ones cost more in page faults than the kernel); it bounds the chunk, so memory is
linear in length.
"""

import math

import torch
import torch.nn.functional as F


def attention_sdpa(q, k, v, args, chunk_size=None):
    """attention() for resolved AttentionArgs, chunk_size query rows at a time. Under autograd each
    chunk's mask is fresh and kept for backward (training memory O(T^2))."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    dtype = q.dtype
    # fp32 inside, like the reference
    q = q.float()
    k = k.float()
    v = v.float()
    plain = args.prior is None and args.row_scale is None and args.doc_start is None
    if plain and args.q_offset == 0 and Tq == Tk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args.softmax_scale)
        return out.to(dtype)

    # one fp32 (B, H, rows, Tk) mask buffer; the fused kernel wants a few hundred rows
    budget_bytes = 128 * 2**20
    rows = chunk_size or int(min(512, max(64, budget_bytes // (4 * B * H * max(Tk, 1)))))
    scaled_prior = args.row_scale is not None and args.scale_prior and args.prior is not None
    written = args.doc_start is not None or scaled_prior
    buf = None
    if written and not args.needs_grad(q, k, v):
        buf = q.new_empty(B * H * min(rows, Tq) * Tk)
    # key j at Tk - 1 - j
    k_rev = k.flip(2)
    v_rev = v.flip(2)

    outs = []
    for start, stop, first_key in args.query_chunks(Tq, rows):
        # queries at [first_query, end); keys before first_key are hidden from all
        first_query = args.q_offset + start
        end = args.q_offset + stop
        table = _reversed_table(args.prior, first_key - (end - 1), stop - start - 1, q)
        queries = q[:, :, start:stop]
        row_scale = None
        if args.row_scale is not None:
            row_scale = args.row_scale[:, :, start:stop, None].float()
            queries = queries * row_scale

        mask_row_scale = row_scale if scaled_prior else None
        doc_rows = None
        if args.doc_start is not None:
            doc_rows = args.doc_start[:, first_query:end]
        mask = _hankel_mask(table, stop - start, mask_row_scale, doc_rows, end - 1, buf)
        keys = k_rev[:, :, Tk - end : Tk - first_key]
        values = v_rev[:, :, Tk - end : Tk - first_key]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=args.softmax_scale
        )
        outs.append(out)
    return torch.cat(outs, dim=2).to(dtype)


def _reversed_table(prior, nearest, farthest, like):
    """Log-prior at distances farthest down to nearest, (H, farthest - nearest + 1); no prior:
    zeros (1, n)."""
    if prior is None:
        return like.new_zeros(1, farthest - nearest + 1)

    distances = torch.arange(nearest, farthest + 1, device=like.device)
    return prior.table(distances).flip(1)


def _neg_inf_where(hidden):
    # 0 where visible, -inf where hidden; added in place to a mask
    return torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))


def _hankel_mask(reversed_table, rows, row_scale, doc_rows, newest_key, buf):
    """One chunk's float mask (B or 1, H or 1, rows, keys), keys reversed; if possible a view of
    reversed_table: (H or 1, rows + keys - 1), entry u at distance d = rows - 1 - u. row_scale:
    (B or 1, H, rows, 1) if it scales the prior, else None; doc_rows: (B, rows) document starts or
    None; newest_key: first (reversed) key's position; buf: reused buffer, None under autograd."""
    H, n = reversed_table.shape
    keys = n - rows + 1
    # a mask of distance alone: causality (d > 0) as -inf table entries
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
        # causal: key column c follows query row r iff r + c < rows - 1 (first rows - 1 cols)
        idx = torch.arange(rows, device=mask.device)
        future = idx[:, None] + idx[None, : rows - 1] < rows - 1
        mask[..., : rows - 1].add_(_neg_inf_where(future))

    if doc_rows is None:
        return mask

    # reversed key columns 0..shared are in every row's document; later ones may not be
    shared = int(newest_key - doc_rows.max())
    if shared < keys - 1:
        key_pos = newest_key - torch.arange(shared + 1, keys, device=mask.device)
        before_doc = key_pos[None, None, :] < doc_rows[:, :, None]
        mask[..., shared + 1 :].add_(_neg_inf_where(before_doc)[:, None])
    return mask
