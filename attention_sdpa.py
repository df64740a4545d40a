"""
attention() on CPU via PyTorch's fused scaled_dot_product_attention (impl "sdpa"), prior as a
mask, per query chunk. Evaluation only: the mask is a constant to the fused kernel, so no
prior trains (attention.impl_error). r_i moves into the queries, so with keys reversed the mask,
prior(j - i) (times r_i if scale_prior), is a strided view of the reversed table. Other masks go
to one buffer all chunks reuse (fresh ones page-fault): memory stays linear in length. Heads are
grouped by width, the keys i - F_i + 1 a row reads from its first key F_i (attention.first_keys):
a chunk reads keys from the first its group's rows need.
"""

import math

import torch
import torch.nn.functional as F


def attention_sdpa(q, k, v, args, first_key=None, chunk_size=None):
    """attention() for resolved AttentionArgs from first_key on ((B, H, Tq) or None: every key),
    chunk_size query rows at a time. Under autograd each chunk's mask is fresh and kept for backward
    (training memory O(T^2))."""
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

    if args.row_scale is not None:
        args = args._replace(row_scale=args.row_scale.expand(-1, H, -1))
    # heads permuted once (index_select: 2x [:, order]), a group per slice; keys reversed
    order, groups = _head_groups(first_key, args.q_offset, H, Tk)
    q = q.index_select(1, order)
    k_rev = k.index_select(1, order).flip(2)
    v_rev = v.index_select(1, order).flip(2)
    if first_key is not None:
        first_key = first_key.index_select(1, order)
    out = torch.empty_like(q)
    for heads, width in groups:
        group_first = None if first_key is None else first_key[:, heads]
        group = (q[:, heads], k_rev[:, heads], v_rev[:, heads], group_first)
        _attend(*group, args, order[heads], width, chunk_size, out[:, heads])
    return out.index_select(1, order.argsort()).to(dtype)


def _head_groups(first_key, q_offset, H, Tk):
    """(order, groups): heads by widest row, groups as (slice, widest row's width). A head joins
    a group within 1 % or 64 keys of its width; from Tk / 2 on, all keys."""
    if first_key is None:
        return torch.arange(H), [(slice(0, H), Tk)]

    rows = torch.arange(first_key.shape[2], device=first_key.device) + q_offset
    widths = (rows - first_key + 1).amax(dim=(0, 2))
    widths = torch.where(widths >= Tk // 2, Tk, widths)
    widths, order = widths.sort(descending=True)
    widths = widths.tolist()

    groups = []
    lead = 0
    for h in range(1, H + 1):
        if h == H or widths[h] < widths[lead] - max(64, widths[lead] // 100):
            groups.append((slice(lead, h), widths[lead]))
            lead = h
    return order, groups


def _attend(q, k_rev, v_rev, first_key, args, heads, width, chunk_size, out):
    """One group of heads into out (q, k_rev, v_rev, first_key and out hold only them; `heads`
    indexes them in args' tensors); width: the most keys any of its rows reads (Tk: every key)."""
    B, H, Tq, _ = q.shape
    Tk = k_rev.shape[2]
    # one fp32 (B, H, rows, keys) mask buffer; SDPA likes a few hundred rows, a narrow group's
    # chunks half its width (each also scores a rows^2 triangle)
    budget_bytes = 128 * 2**20
    rows = budget_bytes // (4 * B * H * width)
    if width < Tk:
        rows = width // 2
    rows = chunk_size or int(min(512, max(64, rows)))
    scaled_prior = args.row_scale is not None and args.scale_prior and args.prior is not None
    written = args.doc_start is not None or scaled_prior
    buf = None
    if written and not args.needs_grad(q, k_rev, v_rev):
        buf = q.new_empty(B * H * min(rows, Tq) * min(Tk, width + rows))

    for start, stop, first in args.query_chunks(Tq, rows):
        # queries at [first_query, end); keys before `first` are hidden or skipped for all
        first_query = args.q_offset + start
        end = args.q_offset + stop
        if first_key is not None:
            first = max(first, int(first_key[:, :, start:stop].min()))

        table = _reversed_table(args.prior, first - (end - 1), stop - start - 1, q)
        if args.prior is not None:
            table = table[heads]
        queries = q[:, :, start:stop]
        row_scale = None
        if args.row_scale is not None:
            row_scale = args.row_scale[:, heads, start:stop, None].float()
            queries = queries * row_scale

        mask_row_scale = row_scale if scaled_prior else None
        doc_rows = None
        if args.doc_start is not None:
            doc_rows = args.doc_start[:, first_query:end]
        mask = _hankel_mask(table, stop - start, mask_row_scale, doc_rows, end - 1, buf)
        keys = k_rev[:, :, Tk - end : Tk - first]
        values = v_rev[:, :, Tk - end : Tk - first]
        out[:, :, start:stop] = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=args.softmax_scale
        )


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
