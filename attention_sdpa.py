"""
attention() on CPU via PyTorch's fused scaled_dot_product_attention (impl "sdpa"), prior as a
mask, per query chunk. Evaluation only: the mask is a constant to the fused kernel, so no
prior trains (attention.impl_error). Heads are grouped by width, the keys i - F_i + 1 a row reads
from its first key F_i (attention.first_keys), and a group reads keys from the first its rows need:
- A group that reads every key, or many, goes chunk by chunk to the fused kernel. r_i moves into
  the queries, so with keys reversed the mask, prior(j - i) (times r_i if scale_prior), is a
  strided view of the reversed table. Other masks go to one buffer all chunks reuse (fresh ones
  page-fault): memory stays linear in length.
- A narrow group (a local prior's) is a band: blocks of rows, each with the same number of keys
  behind it, so one prior mask serves every block, and many blocks go to one batched product whose
  scores fit in cache. The fused kernel's per-call and per-tile costs dominate at such widths.
"""

import math

import torch
import torch.nn.functional as F

BAND_WIDTH = 512  # the widest group that goes as a band (dev/bench_skip.py measures it)


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
    out = torch.empty_like(q)
    for heads, width in _head_groups(first_key, args.q_offset, H, Tk):
        group_first = None if first_key is None else first_key[:, heads]
        attend = _attend_band if width < Tk and width <= BAND_WIDTH else _attend
        out[:, heads] = attend(q[:, heads], k, v, group_first, args, heads, width, chunk_size)
    return out.to(dtype)


def _head_groups(first_key, q_offset, H, Tk):
    """[(heads, width)]: heads (a tensor of indices) by widest row, with that row's width. A head
    joins a group within 1 % or 64 keys of its width; from Tk / 2 on, all keys."""
    if first_key is None:
        return [(torch.arange(H), Tk)]

    rows = torch.arange(first_key.shape[2], device=first_key.device) + q_offset
    widths = (rows - first_key + 1).amax(dim=(0, 2))
    widths = torch.where(widths >= Tk // 2, Tk, widths)
    widths, order = widths.sort(descending=True)
    widths = widths.tolist()

    groups = []
    lead = 0
    for h in range(1, H + 1):
        if h == H or widths[h] < widths[lead] - max(64, widths[lead] // 100):
            groups.append((order[lead:h], widths[lead]))
            lead = h
    return groups


def _attend(q, k, v, first_key, args, heads, width, chunk_size):
    """One group of heads (q and first_key hold only them; `heads` indexes them in k, v and args'
    tensors) chunk by chunk; width: the most keys any of its rows reads (Tk: every key)."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    # keys reversed from the group's first one: index u holds position Tk - 1 - u
    earliest = 0 if first_key is None else int(first_key.min())
    k_rev = k[:, :, earliest:].index_select(1, heads).flip(2)
    v_rev = v[:, :, earliest:].index_select(1, heads).flip(2)
    out = torch.empty_like(q)
    # one fp32 (B, H, rows, keys) mask buffer; SDPA likes a few hundred rows, a narrow group's
    # chunks half its width (each also scores a rows^2 triangle), a written mask 128 rows (it is
    # read back from cache)
    scaled_prior = args.row_scale is not None and args.scale_prior and args.prior is not None
    written = args.doc_start is not None or scaled_prior
    budget_bytes = 128 * 2**20
    rows = budget_bytes // (4 * B * H * width)
    if width < Tk:
        rows = width // 2
    rows = chunk_size or min(512 if not written else 128, max(64, rows))
    buf = None
    if written and not args.needs_grad(q, k, v):
        buf = q.new_empty(B * H * min(rows, Tq) * min(Tk, width + rows))
    # the prior once, at every distance a chunk may need: index u holds distance rows - 1 - u
    distances = torch.arange(earliest - Tk + 1, rows, device=q.device)
    if args.prior is None:
        all_distances = q.new_zeros(1, len(distances))
    else:
        all_distances = args.prior.table(distances).flip(1)[heads]
    for start, stop, first in args.query_chunks(Tq, rows):
        # queries at [first_query, end); keys before `first` are hidden or skipped for all
        first_query = args.q_offset + start
        end = args.q_offset + stop
        if first_key is not None:
            first = max(first, int(first_key[:, :, start:stop].min()))

        table = all_distances[:, rows - (stop - start) : rows + end - 1 - first]
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
    return out


def _attend_band(q, k, v, first_key, args, heads, width, chunk_size):
    """One narrow group of heads (as _attend's) as a band: blocks of `rows` query rows, each scoring
    the width + rows - 1 keys up to its last row, a cache's worth of blocks per product."""
    B, H, Tq, _ = q.shape
    rows = chunk_size or min(Tq, max(16, width // 8))
    keys = width + rows - 1
    blocks = -(-Tq // rows)
    padded_rows = blocks * rows - Tq

    # the band's key positions from the first block's first key; zeros (hidden) before the
    # group's first key and after the last
    first = args.q_offset - width + 1
    span = (blocks - 1) * rows + keys
    earliest = int(first_key.min())
    k_blocks = _key_band(k, heads, first, span, earliest).unfold(2, keys, rows)
    v_blocks = _key_band(v, heads, first, span, earliest).unfold(2, keys, rows)
    v_blocks = v_blocks.transpose(-1, -2)
    queries = F.pad(q * args.softmax_scale, (0, 0, 0, padded_rows))
    first_key = F.pad(first_key, (0, padded_rows), value=earliest)
    r = None
    if args.row_scale is not None:
        r = F.pad(args.row_scale[:, heads].float(), (0, padded_rows), value=1.0)
        queries = queries * r[..., None]
    scaled_prior = r is not None and args.scale_prior

    log_prior, future = _band_prior(args.prior, heads, rows, keys, width)
    if not scaled_prior:
        log_prior = log_prior.masked_fill(future, float("-inf"))

    # Only the blocks that reach before the group's first key (the band's zeros), or every block
    # where documents hide keys, mask each row from its own first key. In the others a row reads
    # all the block's keys: more than it needs, never fewer.
    masked_blocks = blocks
    if args.doc_start is None:
        masked_blocks = -(-(earliest - first) // rows)
    out = q.new_empty(B, H, blocks * rows, q.shape[-1])
    per_product = max(1, 2**19 // (B * H * rows * keys))
    # far keys' weights underflow into subnormal floats, which the CPU computes tens of times slower
    torch.set_flush_denormal(True)
    try:
        for block in range(0, blocks, per_product):
            n = min(per_product, blocks - block)
            at = slice(block * rows, (block + n) * rows)
            scores = queries[:, :, at].unflatten(2, (n, rows)) @ k_blocks[:, :, block : block + n]
            if scaled_prior:
                scores.addcmul_(log_prior, r[:, :, at].unflatten(2, (n, rows))[..., None])
                scores.masked_fill_(future, float("-inf"))
            else:
                scores.add_(log_prior)
            if block < masked_blocks:
                key_pos = first + (block + torch.arange(n)[:, None]) * rows + torch.arange(keys)
                row_first = first_key[:, :, at].unflatten(2, (n, rows))[..., None]
                scores.masked_fill_(key_pos[:, None, :] < row_first, float("-inf"))
            values = torch.softmax(scores, dim=-1) @ v_blocks[:, :, block : block + n]
            out[:, :, at] = values.flatten(2, 3)
    finally:
        torch.set_flush_denormal(False)
    return out[:, :, :Tq]


def _band_prior(prior, heads, rows, keys, width):
    """(log-prior (h, 1, rows, keys), future (rows, keys)) of one band block, the same in every
    block: block row a, key column c sit at distance d = j - i = c - a - (width - 1)."""
    col_minus_row = torch.arange(keys)[None, :] - torch.arange(rows)[:, None]
    table = prior.table(torch.arange(-(keys - 1), rows, device=heads.device))[heads]
    log_prior = table[:, col_minus_row + rows - 1].unsqueeze(1)
    return log_prior, col_minus_row > width - 1


def _key_band(k, heads, first, span, earliest):
    """k's `heads` at first .. first + span - 1, zeros off earliest..Tk-1: (B, h, span, D)."""
    Tk = k.shape[2]
    lo = max(first, earliest)
    hi = min(first + span, Tk)
    band = k[:, :, lo:hi].index_select(1, heads)
    return F.pad(band, (0, 0, lo - first, first + span - hi))


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
    head_stride = reversed_table.stride(0)
    view = reversed_table.as_strided((1, H, rows, keys), (H * head_stride, head_stride, 1, 1))
    if row_scale is None and doc_rows is None:
        return view

    batch = doc_rows.shape[0] if doc_rows is not None else row_scale.shape[0]
    shape = (batch, H if row_scale is None else row_scale.shape[1], rows, keys)
    mask = buf[: math.prod(shape)].view(shape) if buf is not None else None
    mask = torch.mul(view.expand(shape), 1.0 if row_scale is None else row_scale, out=mask)
    if row_scale is not None:
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
