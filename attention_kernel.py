"""
The Triton kernel of attention (impl "triton"): flash attention with any registered prior and
SSMax, forward and backward, as torch.library custom ops. attention.py holds the contract and
calls attention_triton; infra/kernel_check.py holds the self-check every run makes first.

The kernels see no prior's formula, only its table of log-priors by distance (and for gradients
its derivatives in the trained parameters), built from the registry's BoundPrior.table. Gradients
are deterministic: partial sums per program, reduced in a fixed order, no atomics.
"""

import contextlib
import math
import os
import re
from collections import namedtuple
from typing import Optional

import torch
from torch.nn.functional import pad

from priors import BoundPrior

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path works without triton
    triton = None


def interpreting():
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): the kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available():
    # the import is tried once, above (no import inside code that torch.compile traces)
    return triton is not None


# The oldest Triton the kernels compile with (dev/compile_check.py). requirements.txt pins the one
# that PyPI's CUDA build of the pinned torch requires.
TRITON_FLOOR = (3, 4)


def triton_too_old():
    """The line to print where the installed Triton is older than TRITON_FLOOR (it would fail to
    compile the kernels), else ""."""
    if triton is None:
        return ""
    version = triton.__version__
    major_minor = re.match(r"(\d+)\.(\d+)", version).groups()
    if tuple(map(int, major_minor)) >= TRITON_FLOOR:
        return ""
    floor = ".".join(map(str, TRITON_FLOOR))
    return (
        f"the Triton kernel needs Triton {floor} or newer, not {version}: pip install -r "
        "requirements.txt, or use impl='torch' (the reference)"
    )


FP_FUSION = True  # every launch's enable_fp_fusion

# Structure (Triton's fused-attention tutorial): the forward is one online-softmax loop over key
# blocks in base 2 (log2 e folded into the scores). The backward: a preprocess Delta = rowsum(O
# dO); a kernel per key block for dK, dV; a kernel per query block for dQ, which also sums the
# gradients of SSMax's row scale and of the prior's parameters, score by score for a few trained
# entries per head (GGD: 2), along tile diagonals for many (T5: 32; DIAGONAL_FROM). Each kernel
# visits the unmasked blocks, then the masked ones before (document starts) and after (diagonal),
# none before its query group's first key (FIRST_KEY, _group_first_keys).
#
# Layout: q, k, v (B, H, T, D) are the model's (B, T, H, D) projections seen through
# .transpose(1, 2): in each, a row is H D elements after the previous one and a head D after the
# previous head; only the batch strides of k and v may differ (a KV cache's views: Sizes).
# The outputs and gradients are laid out alike, so model.py reshapes them with no copy. The row
# scale is (B, H, Tq), the queries' doc_start (B, Tq): a program moves its pointers to its (batch,
# head) and derives offsets from the shapes. Tables (_prior_tables) are a row per head: lp(d) in
# base 2, floored at priors.LOG_PRIOR_FLOOR, and J_k(d) = d lp(d) / d theta_k for the K trained
# directions (GGD: 2, T5: 32; K a compile-time constant). A tile's log-prior depends on d = j - i
# only: a gathered load.
#
# Math, per (batch, head), query i (absolute position), key j, d = j - i, r_i the row scale (1
# without SSMax):
#     l = softmax_scale q_i.k_j ;  s = (l + lp) r  if scale_prior  else  l r + lp ;  -inf if hidden
#     P = softmax_j(s) ;  O = P V ;  LSE_i = log sum_j exp(s_ij), stored in base 2
#     dP = dO V^T ;  Delta_i = sum_j P_ij dP_ij (= rowsum(O_i * dO_i)) ;  dS = P (dP - Delta)
#     dq = softmax_scale r sum_j dS k_j ;  dk = softmax_scale sum_i dS r q_i ;  dv = P^T dO
#     dtheta_k = sum_ij w_i dS_ij J_k(d_ij),  w = r if scale_prior else 1
#     dr_i = sum_j dS_ij x_ij,  x = l + lp if scale_prior else l
#
# Numerics: every kernel computes scores alike (_tile_scores), so the backward's P is the
# forward's. Without SCALE_PRIOR a score is one explicit fma, s = fma(q.k, row_qk_scale_i, lp),
# that fp fusion cannot change. With it, s = fma(q.k, c, lp) r, which the compiler may fuse into
# the backward's LSE subtraction (an ulp of s off), and the LSE is kept as two values (_row_lse).
# A row with one visible key has P = 1: its gradients (dQ, d theta, d row_scale) are set to 0.
#
# d theta and d row_scale sum dS times a table or score over all scores, so a row's error in
# Delta reaches them times the tables' size: at most |floor| times it, not a prior of -3e7. There
# dQ takes Delta from its own P (_grad_plan's OWN_DELTA: rowsum(O dO) carries P's rounding before
# P V, 8 bits in bf16) and sums dS x in fp32, not from its 16-bit dS product.


# What a launch passes as named tuples. Sizes: heads, query and key rows, the queries' first
# position, the scores' scale, and the batch strides of k and v (of q and every output: T H D).
Sizes = namedtuple("Sizes", "H Tq Tk q_offset softmax_scale k_batch v_batch")
# The optional inputs as the kernels take them (_kernel_inputs).
Inputs = namedtuple("Inputs", "doc row_scale table dtable table_len")
# Compile-time (_flags); SCALE_PRIOR: the row scale multiplies the prior too.
Flags = namedtuple("Flags", "HEAD_DIM BLOCK_D HAS_DOC HAS_PRIOR HAS_ROW_SCALE SCALE_PRIOR DOT_PREC")
# Compile-time, what dQ sums besides dQ (_grad_plan).
GradPlan = namedtuple("GradPlan", "N_GRAD NEED_ROW_SCALE_GRAD BY_DIAGONAL K_POW2 OWN_DELTA")
# Triton before 3.8 reads a field of these compile-time tuples as a plain int, and before 3.7 a
# plain str: a shape or a static_range takes one through tl.constexpr(...), and _dot takes F.
# Inside the kernels: a tile's query rows (_query_rows), and the blocks a program visits: [start,
# end) every one it reads, [clean_start, clean_end) those that need no mask (_stage_blocks).
Rows = namedtuple("Rows", "index ok pos doc scale qk_scale")
Blocks = namedtuple("Blocks", "start clean_start clean_end end")


if triton is not None:
    # Triton's interpreter multiplies bf16 blocks as raw uint16; there only, tl.dot upcasts bf16
    # operands to fp32 (exact), so CPU tests still see the bf16 rounding of P and dS.
    _INTERPRET_BF16_UPCAST = tl.constexpr(interpreting())
    _LN2 = tl.constexpr(0.6931471805599453)
    _LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _dot(a, b, acc, F: tl.constexpr):
        if _INTERPRET_BF16_UPCAST:
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
            if b.dtype == tl.bfloat16:
                b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=F.DOT_PREC)

    @triton.jit
    def _tile(base, row0, T, H, ROWS: tl.constexpr, F: tl.constexpr, TRANSPOSED: tl.constexpr):
        """Pointers to rows row0 .. row0 + ROWS - 1 of one head (base: its row 0) of a (T, H,
        HEAD_DIM) layout as a (ROWS, BLOCK_D) tile, or TRANSPOSED, and the mask of rows < T and
        columns < HEAD_DIM (BLOCK_D: a power of two). The row offset is 64-bit (a tensor may pass
        2^31 elements)."""
        row_stride = H * F.HEAD_DIM
        base = base + tl.cast(row0, tl.int64) * row_stride
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, F.BLOCK_D)
        if TRANSPOSED:
            ptrs = base + rows[None, :] * row_stride + cols[:, None]
            mask = (cols < F.HEAD_DIM)[:, None] & (row0 + rows < T)[None, :]
        else:  # one return: the compiler types all returns alike
            ptrs = base + rows[:, None] * row_stride + cols[None, :]
            mask = (row0 + rows < T)[:, None] & (cols < F.HEAD_DIM)[None, :]
        return ptrs, mask

    @triton.jit
    def _load_tile(base, row0, T, H, ROWS: tl.constexpr, F: tl.constexpr, TRANSPOSED=False):
        """_tile's tile loaded, 0 where masked."""
        ptrs, mask = _tile(base, row0, T, H, ROWS, F, TRANSPOSED)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _table_tile(table, rows, cols):
        """A table tile (table: x = 0 of a head's row): t[col - row] for key columns cols (1, N)
        and query rows rows (M, 1), or transposed for dK/dV."""
        return tl.load(table + (cols - rows))

    @triton.jit
    def _per_row(x, TRANSPOSED: tl.constexpr):
        """Per-row values x (ROWS,) against a tile: a column (ROWS, 1), or a row (1, ROWS) where
        the tile is TRANSPOSED (keys x queries in dK/dV)."""
        if TRANSPOSED:
            x = x[None, :]
        else:
            x = x[:, None]
        return x

    @triton.jit
    def _query_rows(row0, DOC, ROW_SCALE, sizes, ROWS: tl.constexpr, LOAD_DOC, F: tl.constexpr):
        """Query rows row0 .. row0 + ROWS - 1 (Rows): doc_start (0 unless LOAD_DOC), row scale r
        (1 without SSMax) and the scores' qk scale: softmax_scale log2(e), times r unless
        SCALE_PRIOR (r then scales l + lp). DOC and ROW_SCALE point at this (batch, head)'s rows."""
        rows = row0 + tl.arange(0, ROWS)
        row_ok = rows < sizes.Tq
        doc = tl.zeros_like(rows)
        if LOAD_DOC:
            doc = tl.load(DOC + rows, mask=row_ok, other=0)

        row_scale = tl.full(rows.shape, 1.0, tl.float32)
        if F.HAS_ROW_SCALE:
            row_scale = tl.load(ROW_SCALE + rows, mask=row_ok, other=0.0)

        qk_scale = sizes.softmax_scale * _LOG2E
        if F.SCALE_PRIOR:
            row_qk_scale = qk_scale + tl.zeros_like(row_scale)
        else:
            row_qk_scale = qk_scale * row_scale
        return Rows(rows, row_ok, sizes.q_offset + rows, doc, row_scale, row_qk_scale)

    @triton.jit
    def _tile_scores(qk, lp, cols, rows, MASKED, F: tl.constexpr, TRANSPOSED=False):
        """A tile's scores in base 2 from q.k and the log-prior tile lp, for key columns cols and
        query rows (Rows), alike in every kernel, -inf where hidden."""
        if F.HAS_PRIOR:
            s = tl.fma(qk, _per_row(rows.qk_scale, TRANSPOSED), lp)
        else:
            s = qk * _per_row(rows.qk_scale, TRANSPOSED)
        if F.SCALE_PRIOR:
            s = s * _per_row(rows.scale, TRANSPOSED)

        if MASKED:
            kpos = _per_row(cols, not TRANSPOSED)
            visible = kpos <= _per_row(rows.pos, TRANSPOSED)
            if F.HAS_DOC:
                visible = visible & (kpos >= _per_row(rows.doc, TRANSPOSED))
            s = tl.where(visible, s, float("-inf"))
        return s

    @triton.jit
    def _row_lse(LSE, rows, Tq, SCALE_PRIOR: tl.constexpr):
        """The rows' forward LSE as (hi, lo): their max and log2 of their sum (+inf and 0 when
        padded: P = 0). Without SCALE_PRIOR hi is the sum. With it r (l + lp) reaches |r| 1e4
        where the prior is floored: one fp32 LSE would move each P by half an ulp of hi."""
        hi = tl.load(LSE + rows.index, mask=rows.ok, other=float("inf"))
        lo = tl.load(LSE + Tq + rows.index, mask=rows.ok, other=0.0)
        if not SCALE_PRIOR:
            hi = hi + lo
        return hi, lo

    @triton.jit
    def _tile_probs(s, lse, SCALE_PRIOR: tl.constexpr, TRANSPOSED=False):
        """The backward's P, exactly the forward's: exp2(s - LSE), or exp2((s - hi) - lo)."""
        hi, lo = lse
        x = s - _per_row(hi, TRANSPOSED)
        if SCALE_PRIOR:
            x = x - _per_row(lo, TRANSPOSED)
        return tl.exp2(x)

    @triton.jit
    def _stage_blocks(stage: tl.constexpr, blocks):
        """The blocks [lo, hi) of a stage: 0 unmasked, 1 and 2 the masked ones before and after."""
        if stage == 0:
            return blocks.clean_start, blocks.clean_end
        elif stage == 1:
            return blocks.start, blocks.clean_start
        else:
            return blocks.clean_end, blocks.end

    @triton.jit
    def _key_blocks(row0, rows, FIRST_KEY, sizes, BLOCK_M, BLOCK_N: tl.constexpr, GROUP_M, F):
        """Key blocks of the query block from row0 (Blocks): [start, end) holds every key it reads
        (from its group of GROUP_M rows' FIRST_KEY on), and [clean_start, clean_end) needs no mask
        (before it: document starts; after: the diagonal)."""
        q_first = sizes.q_offset + row0
        q_last = sizes.q_offset + tl.minimum(row0 + BLOCK_M, sizes.Tq) - 1
        end = q_last // BLOCK_N + 1  # the last key needed is the last valid query's own (causal)
        causal_clean = (q_first + 1) // BLOCK_N  # blocks before it lie at or below every diagonal

        if F.HAS_DOC:
            first_doc = tl.min(tl.where(rows.ok, rows.doc, sizes.Tk), 0)  # the earliest doc start
            last_doc = tl.max(tl.where(rows.ok, rows.doc, 0), 0)
            start = tl.minimum(first_doc // BLOCK_N, end)
            doc_clean = (last_doc + BLOCK_N - 1) // BLOCK_N  # from here: after every doc start
        else:
            start = tl.full([], 0, tl.int32)
            doc_clean = tl.full([], 0, tl.int32)
        start = tl.maximum(start, tl.load(FIRST_KEY + row0 // GROUP_M) // BLOCK_N)

        clean_end = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_start = tl.minimum(tl.maximum(doc_clean, start), clean_end)
        return Blocks(start, clean_start, clean_end, end)

    @triton.jit
    def _query_blocks(pid_n, Q_END, Q_CLEAN, sizes, BLOCK_M: tl.constexpr, BLOCK_N, F):
        """Query blocks of key block pid_n (Blocks), before Q_END's (_query_ends): from the first
        query at or after its first key; from Q_CLEAN's on, doc starts mask none of its keys."""
        n0 = pid_n * BLOCK_N
        end = tl.load(Q_END + pid_n)
        doc_clean = end
        if F.HAS_DOC:
            doc_clean = tl.load(Q_CLEAN + pid_n)  # before it: every doc_start <= n0
        start = tl.minimum(tl.maximum(n0 - sizes.q_offset, 0) // BLOCK_M, end)
        # the first query block wholly at or after the block's last key (a ragged last key block
        # is always masked: keys >= Tk count as after every query)
        causal_last = tl.maximum(n0 + BLOCK_N - 1 - sizes.q_offset, 0)
        causal_clean = (causal_last + BLOCK_M - 1) // BLOCK_M
        clean_start = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_end = tl.minimum(tl.maximum(doc_clean, clean_start), end)
        return Blocks(start, clean_start, clean_end, end)

    # ---- forward
    @triton.jit
    def _attn_fwd(
        Q,
        K,
        V,
        OUT,
        LSE,
        FIRST_KEY,
        inputs,
        sizes,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        F: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)  # 64-bit: B T H D may pass 2^31
        H, Tq, Tk = sizes.H, sizes.Tq, sizes.Tk
        # this program's (batch, head)
        b = bh // H
        head = (bh % H) * F.HEAD_DIM
        Q += b * Tq * H * F.HEAD_DIM + head
        K += b * sizes.k_batch + head
        V += b * sizes.v_batch + head
        OUT += b * Tq * H * F.HEAD_DIM + head
        table = inputs.table + (bh % H) * inputs.table_len

        row0 = pid_m * BLOCK_M
        doc, row_scale = inputs.doc + b * Tq, inputs.row_scale + bh * Tq
        rows = _query_rows(row0, doc, row_scale, sizes, BLOCK_M, F.HAS_DOC, F)
        q = _load_tile(Q, row0, Tq, H, BLOCK_M, F)
        first_key = FIRST_KEY + bh * tl.cdiv(Tq, GROUP_M)
        blocks = _key_blocks(row0, rows, first_key, sizes, BLOCK_M, BLOCK_N, GROUP_M, F)

        # the online softmax; row_max is -inf while a row sees nothing
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, tl.constexpr(F.BLOCK_D)], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, blocks)
            for blk in range(blk_lo, blk_hi):
                n0 = blk * BLOCK_N
                cols = n0 + tl.arange(0, BLOCK_N)
                kT = _load_tile(K, n0, Tk, H, BLOCK_N, F, TRANSPOSED=True)
                lp = 0.0
                if F.HAS_PRIOR:
                    lp = _table_tile(table, rows.index[:, None], cols[None, :])

                qk = _dot(q, kT, None, F)
                s = _tile_scores(qk, lp, cols, rows, MASKED=stage > 0, F=F)

                # a row with nothing visible yet subtracts 0 instead (no -inf - -inf)
                new_max = tl.maximum(row_max, tl.max(s, 1))
                ref = tl.where(new_max == float("-inf"), 0.0, new_max)
                p = tl.exp2(s - ref[:, None])
                alpha = tl.exp2(row_max - ref)
                row_sum = row_sum * alpha + tl.sum(p, 1)

                v = _load_tile(V, n0, Tk, H, BLOCK_N, F)
                acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], F)
                row_max = new_max

        # max and log2(sum) apart (_row_lse); a row that sees nothing stores +inf: backward P = 0
        has_mass = row_sum > 0.0
        safe_sum = tl.where(has_mass, row_sum, 1.0)
        LSE += bh * 2 * Tq
        tl.store(LSE + rows.index, tl.where(has_mass, row_max, float("inf")), mask=rows.ok)
        tl.store(LSE + Tq + rows.index, tl.log2(safe_sum), mask=rows.ok)
        out_ptrs, out_mask = _tile(OUT, row0, Tq, H, BLOCK_M, F, False)
        tl.store(out_ptrs, (acc / safe_sum[:, None]).to(OUT.dtype.element_ty), mask=out_mask)

    # ---- backward
    @triton.jit
    def _attn_bwd_preprocess(OUT, DO, DELTA, sizes, BLOCK_M: tl.constexpr, F: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        H, Tq = sizes.H, sizes.Tq
        head = (bh // H) * Tq * H * F.HEAD_DIM + (bh % H) * F.HEAD_DIM
        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        o = _load_tile(OUT + head, row0, Tq, H, BLOCK_M, F)
        do = _load_tile(DO + head, row0, Tq, H, BLOCK_M, F)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * Tq + rows, delta, mask=rows < Tq)

    @triton.jit
    def _attn_bwd_dkdv(
        Q,
        K,
        V,
        DO,
        DK,
        DV,
        LSE,
        DELTA,
        Q_END,
        Q_CLEAN,
        inputs,
        sizes,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        F: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        H, Tq, Tk = sizes.H, sizes.Tq, sizes.Tk
        # this program's (batch, head)
        b = bh // H
        head = (bh % H) * F.HEAD_DIM
        Q += b * Tq * H * F.HEAD_DIM + head
        DO += b * Tq * H * F.HEAD_DIM + head
        K += b * sizes.k_batch + head
        V += b * sizes.v_batch + head
        DK += b * Tk * H * F.HEAD_DIM + head
        DV += b * Tk * H * F.HEAD_DIM + head
        LSE += bh * 2 * Tq
        DELTA += bh * Tq
        row_scale = inputs.row_scale + bh * Tq
        doc = inputs.doc + b * Tq
        table = inputs.table + (bh % H) * inputs.table_len

        n0 = pid_n * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _load_tile(K, n0, Tk, H, BLOCK_N, F)
        v = _load_tile(V, n0, Tk, H, BLOCK_N, F)
        n_kblocks = tl.cdiv(Tk, BLOCK_N)
        q_end, q_clean = Q_END + bh * n_kblocks, Q_CLEAN + b * n_kblocks
        blocks = _query_blocks(pid_n, q_end, q_clean, sizes, BLOCK_M, BLOCK_N, F)

        dk = tl.zeros([BLOCK_N, tl.constexpr(F.BLOCK_D)], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, tl.constexpr(F.BLOCK_D)], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, blocks)
            for blk in range(blk_lo, blk_hi):
                m0 = blk * BLOCK_M
                qT = _load_tile(Q, m0, Tq, H, BLOCK_M, F, TRANSPOSED=True)
                # doc_start is only needed (and loaded) for the masked tiles
                rows = _query_rows(m0, doc, row_scale, sizes, BLOCK_M, stage > 0 and F.HAS_DOC, F)
                # padded query rows: P = 0, and dO = 0, so they add nothing
                lse = _row_lse(LSE, rows, Tq, F.SCALE_PRIOR)
                delta = tl.load(DELTA + rows.index, mask=rows.ok, other=0.0)
                lpT = 0.0
                if F.HAS_PRIOR:  # the transposed tile: entry (key, query)
                    lpT = _table_tile(table, rows.index[None, :], cols[:, None])

                qkT = _dot(k, qT, None, F)  # (BLOCK_N, BLOCK_M): keys x queries
                sT = _tile_scores(qkT, lpT, cols, rows, MASKED=stage > 0, F=F, TRANSPOSED=True)
                pT = _tile_probs(sT, lse, F.SCALE_PRIOR, TRANSPOSED=True)

                do = _load_tile(DO, m0, Tq, H, BLOCK_M, F)
                dv = _dot(pT.to(do.dtype), do, dv, F)
                dpT = _dot(v, tl.trans(do), None, F)
                if F.HAS_ROW_SCALE:  # the gradient of l: dS r = P (dP r - Delta r)
                    r = rows.scale
                    dscoreT = pT * tl.fma(dpT, r[None, :], -(delta * r)[None, :])
                else:
                    dscoreT = pT * (dpT - delta[None, :])
                dk = _dot(dscoreT.to(qT.dtype), tl.trans(qT), dk, F)

        dk_ptrs, kv_mask = _tile(DK, n0, Tk, H, BLOCK_N, F, False)
        tl.store(dk_ptrs, (dk * sizes.softmax_scale).to(DK.dtype.element_ty), mask=kv_mask)
        dv_ptrs, kv_mask = _tile(DV, n0, Tk, H, BLOCK_N, F, False)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _dq_tile(q, K, V, table, n0, rows, lse, sizes, F, MASKED, BLOCK_N: tl.constexpr):
        """What both of dQ's passes compute of key block n0: K^T, V^T, lp, q.k and P."""
        cols = n0 + tl.arange(0, BLOCK_N)
        kT = _load_tile(K, n0, sizes.Tk, sizes.H, BLOCK_N, F, TRANSPOSED=True)
        vT = _load_tile(V, n0, sizes.Tk, sizes.H, BLOCK_N, F, TRANSPOSED=True)
        lp = 0.0
        if F.HAS_PRIOR:
            lp = _table_tile(table, rows.index[:, None], cols[None, :])

        qk = _dot(q, kT, None, F)
        s = _tile_scores(qk, lp, cols, rows, MASKED=MASKED, F=F)
        return kT, vT, lp, qk, _tile_probs(s, lse, F.SCALE_PRIOR)

    @triton.jit
    def _diagonal_sums(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A (BLOCK_M, BLOCK_N) tile as BLOCK_M / BLOCK_N square blocks, each summed along its
        diagonals: (q, u) sums x[q BLOCK_N + r, c] over c - r = u - (BLOCK_N - 1) (0 at u = 2
        BLOCK_N - 1). Row r is gathered shifted by r, so each diagonal becomes a column."""
        N_SUB: tl.constexpr = BLOCK_M // BLOCK_N
        blocks = tl.reshape(x, (N_SUB, BLOCK_N, BLOCK_N))
        u = tl.arange(0, 2 * BLOCK_N)[None, None, :]
        col = u - (BLOCK_N - 1) + tl.arange(0, BLOCK_N)[None, :, None]
        col = tl.broadcast_to(col, (N_SUB, BLOCK_N, 2 * BLOCK_N))
        inside = (col >= 0) & (col < BLOCK_N)
        skewed = tl.gather(blocks, tl.where(inside, col, 0), 2)
        return tl.sum(tl.where(inside, skewed, 0.0), 1)

    @triton.jit
    def _prior_grad(dj_acc, g_acc, dscore, w, dtable, table_len, row0, n0, G: tl.constexpr):
        """A tile's share of the prior's gradient: per row sum_j dS J_k into dj_acc[k] (times w
        per row later), or BY_DIAGONAL w dS summed along the tile's diagonals (d is constant on
        each) times each table's entries there, into g_acc: 2 BLOCK_N loads per table.
        The tile (dscore) has rows row0 .. row0 + BLOCK_M - 1 and keys n0 .. n0 + BLOCK_N - 1."""
        BLOCK_M: tl.constexpr = dscore.shape[0]
        BLOCK_N: tl.constexpr = dscore.shape[1]
        if G.BY_DIAGONAL:
            diag = _diagonal_sums(dscore * w[:, None], BLOCK_M, BLOCK_N)  # (N_SUB, 2 BLOCK_N)
            u = tl.arange(0, 2 * BLOCK_N)[None, :]
            first_row = row0 + tl.arange(0, BLOCK_M // BLOCK_N)[:, None] * BLOCK_N
            x = n0 - first_row - (BLOCK_N - 1) + u  # the tables' index of each diagonal
            kk = tl.arange(0, G.K_POW2)[:, None, None]
            on_diagonal = u[None, :, :] < 2 * BLOCK_N - 1
            entries = tl.load(
                dtable + kk * table_len + x[None, :, :],
                mask=(kk < G.N_GRAD) & on_diagonal,
                other=0.0,
            )
            g_acc += tl.sum(tl.sum(entries * diag[None, :, :], 2), 1)
        else:
            rows = row0 + tl.arange(0, BLOCK_M)[:, None]
            cols = n0 + tl.arange(0, BLOCK_N)[None, :]
            summed = ()
            for i in tl.static_range(tl.constexpr(G.N_GRAD)):
                dtile = _table_tile(dtable + i * table_len, rows, cols)
                summed = summed + (dj_acc[i] + tl.sum(dscore * dtile, 1),)
            dj_acc = summed
        return dj_acc, g_acc

    # dQ sums per row what the gradients of row_scale and the prior need: dx_acc = sum_j dS x (x =
    # l + lp with scale_prior, else l), in fp32 rather than from dQ's 16-bit dS product, whose row
    # sums cancel to its rounding; dj_acc, the prior's. Summed per score instead (a BLOCK_M x
    # BLOCK_N accumulator each, reduced after the loop), they spilled registers on every GPU.
    @triton.jit
    def _attn_bwd_dq(
        Q,
        K,
        V,
        DO,
        DQ,
        LSE,
        DELTA,
        DROW_SCALE,
        PART,
        FIRST_KEY,
        inputs,
        sizes,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        F: tl.constexpr,
        G: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        H, Tq = sizes.H, sizes.Tq
        # this program's (batch, head)
        b = bh // H
        head = (bh % H) * F.HEAD_DIM
        Q += b * Tq * H * F.HEAD_DIM + head
        DO += b * Tq * H * F.HEAD_DIM + head
        DQ += b * Tq * H * F.HEAD_DIM + head
        K += b * sizes.k_batch + head
        V += b * sizes.v_batch + head
        table = inputs.table + (bh % H) * inputs.table_len
        dtable = inputs.dtable + (bh % H) * G.N_GRAD * inputs.table_len

        row0 = pid_m * BLOCK_M
        doc, row_scale = inputs.doc + b * Tq, inputs.row_scale + bh * Tq
        rows = _query_rows(row0, doc, row_scale, sizes, BLOCK_M, F.HAS_DOC, F)
        q = _load_tile(Q, row0, Tq, H, BLOCK_M, F)
        do = _load_tile(DO, row0, Tq, H, BLOCK_M, F)
        lse = _row_lse(LSE + bh * 2 * Tq, rows, Tq, F.SCALE_PRIOR)
        first_key = FIRST_KEY + bh * tl.cdiv(Tq, GROUP_M)
        blocks = _key_blocks(row0, rows, first_key, sizes, BLOCK_M, BLOCK_N, GROUP_M, F)
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

        if G.OWN_DELTA:  # Delta_i = sum_j P_ij dP_ij from this kernel's P, not the forward's O
            delta_acc = zero
            for stage in tl.static_range(3):
                blk_lo, blk_hi = _stage_blocks(stage, blocks)
                for blk in range(blk_lo, blk_hi):
                    n0 = blk * BLOCK_N
                    kT, vT, lp, qk, p = _dq_tile(
                        q, K, V, table, n0, rows, lse, sizes, F, MASKED=stage > 0, BLOCK_N=BLOCK_N
                    )
                    delta_acc += p * _dot(do, vT, None, F)
            delta = tl.sum(delta_acc, 1)
        else:
            delta = tl.load(DELTA + bh * Tq + rows.index, mask=rows.ok, other=0.0)

        dq = tl.zeros([BLOCK_M, tl.constexpr(F.BLOCK_D)], dtype=tl.float32)
        dx_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        dj_acc = ()
        if not G.BY_DIAGONAL:
            for i in tl.static_range(tl.constexpr(G.N_GRAD)):
                dj_acc = dj_acc + (dx_acc,)
        g_acc = tl.zeros([tl.constexpr(G.K_POW2)], dtype=tl.float32)
        # a row with one visible key has P = 1 whatever its scores: its gradients are exactly 0
        multi = tl.where(rows.ok & (rows.pos > rows.doc), 1.0, 0.0)
        w = multi
        # d lp = dS r
        if F.SCALE_PRIOR:
            w = w * rows.scale
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, blocks)
            for blk in range(blk_lo, blk_hi):
                n0 = blk * BLOCK_N
                kT, vT, lp, qk, p = _dq_tile(
                    q, K, V, table, n0, rows, lse, sizes, F, MASKED=stage > 0, BLOCK_N=BLOCK_N
                )
                dscore = p * (_dot(do, vT, None, F) - delta[:, None])
                # sum_j dS k_j; r at the end
                dq = _dot(dscore.to(kT.dtype), tl.trans(kT), dq, F)
                if G.NEED_ROW_SCALE_GRAD:
                    x = qk * sizes.softmax_scale  # l; the tile lp is in base 2
                    if F.SCALE_PRIOR:
                        x = x + lp * _LN2
                    dx_acc += tl.sum(dscore * x, 1)
                if G.N_GRAD > 0:
                    dj_acc, g_acc = _prior_grad(
                        dj_acc, g_acc, dscore, w, dtable, inputs.table_len, row0, n0, G
                    )

        dq = dq * (sizes.softmax_scale * rows.scale * multi)[:, None]
        dq_ptrs, dq_mask = _tile(DQ, row0, Tq, H, BLOCK_M, F, False)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_mask)
        if G.NEED_ROW_SCALE_GRAD:
            drow_scale = dx_acc * multi
            tl.store(DROW_SCALE + bh * Tq + rows.index, drow_scale, mask=rows.ok)
        part = PART + (bh * tl.cdiv(Tq, BLOCK_M) + pid_m) * G.N_GRAD
        if G.BY_DIAGONAL:
            kk = tl.arange(0, G.K_POW2)
            tl.store(part + kk, g_acc, mask=kk < G.N_GRAD)
        else:
            for i in tl.static_range(tl.constexpr(G.N_GRAD)):
                tl.store(part + i, tl.sum(w * dj_acc[i], 0))


# ---- Launch configuration, the prior's tables, and the custom ops
# Fixed tiles per GPU, head_dim and dtype, not triton.autotune: the tile-skipping tables depend on
# the block sizes, and autotuning would multiply the interpreter's test time. The interpreter runs
# INTERPRET_BLOCKS; tests set None (a GPU's tiles, the GPU from Triton's driver) or smaller tiles.
INTERPRET_BLOCKS = (32, 32)
# No configuration's BLOCK_M or BLOCK_N is larger: the tables reach this far past the queries and
# keys whatever the GPU (_prior_tables).
LARGEST_TILE = 128


def _shared_memory(device):
    """The shared memory one block may use, in bytes, on the GPU Triton compiles for on device (a
    CUDA device made current; elsewhere the driver's own, as dev/compile_check.py's stand-ins)."""
    with _device_of(device):
        active = triton.runtime.driver.active
        return active.utils.get_device_properties(active.get_current_device())["max_shared_mem"]


def _configs(head_dim, dtype, device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, and the preprocess's BLOCK_M, for
    head_dim and dtype on device's GPU. Each fits the shared memory of the GPUs it is for, and
    training's 16-bit kernels at head_dim 32 to 128 spill no registers (dev/compile_check.py; its
    table in dev/README.md). None is timed on hardware yet."""
    if interpreting() and INTERPRET_BLOCKS is not None:
        bm, bn = INTERPRET_BLOCKS
        return dict(fwd=(bm, bn, 4, 1), dkdv=(bm, bn, 4, 1), dq=(bm, bn, 4, 1), pre=bm)

    block_d = _block_d(head_dim)
    # sm_80's 163 KiB and sm_90's 227 KiB take the forward's third pipeline stage; the 99 KiB of
    # sm_86, sm_89 and sm_120 leave room for two, the prior's table tiles (fp32, BLOCK_M x BLOCK_N
    # per stage) included. Other GPUs get two; none with less than 99 KiB is checked
    fwd_stages = 3 if _shared_memory(device) >= 160 * 1024 else 2
    # fp32: ieee dots on FMA units, for exact gradient checks, not speed; small backward tiles,
    # or they spill
    if dtype == torch.float32:
        if block_d <= 64:
            return dict(fwd=(64, 32, 8, 2), dkdv=(32, 32, 8, 2), dq=(16, 16, 4, 2), pre=64)
        return dict(fwd=(32, 32, 8, 2), dkdv=(16, 32, 8, 2), dq=(16, 16, 4, 1), pre=64)

    # dK/dV: 64 keys per warpgroup, or Hopper falls back from wgmma to mma.sync (smem-bound). dK/dV
    # and dQ hold q (or k, v), dO and their accumulators in registers: 8 warps, and 32 x 16 tiles
    # in dQ, or they spill
    if block_d <= 64:
        return dict(fwd=(128, 64, 8, fwd_stages), dkdv=(32, 64, 8, 3), dq=(32, 16, 8, 2), pre=128)
    # at head_dim 128, dQ's loop unpipelined (one stage), or it spills on sm_120
    return dict(fwd=(128, 32, 8, 2), dkdv=(32, 64, 8, 2), dq=(32, 16, 8, 1), pre=128)


def check_length(head_dim, dtype, device):
    """The length of the self-check's problem (infra/kernel_check.py): two full tiles of every
    kernel's configuration on device and a ragged third, to run unmasked, diagonal and ragged
    tiles."""
    largest = max(_tile_groups(_configs(head_dim, dtype, device)))
    return 2 * largest + largest // 2 + 3


# From this many derivative tables on, dQ sums the prior's gradient per tile diagonal: score by
# score, each table costs a gathered BLOCK_M x BLOCK_N load and a row sum per tile.
DIAGONAL_FROM = 4


def _grad_plan(n_grad, need_row_scale_grad):
    """The dQ kernel's GradPlan for K = n_grad derivative tables. OWN_DELTA: dQ recomputes Delta
    from its own P (a second pass over the row's keys) rather than reading rowsum(O * dO) whenever
    it sums d theta or d row_scale, sums over every score where each row's error in Delta adds up
    (up to 40 % in bf16 without it: dev/README.md)."""
    return GradPlan(
        N_GRAD=n_grad,
        NEED_ROW_SCALE_GRAD=need_row_scale_grad,
        BY_DIAGONAL=n_grad >= DIAGONAL_FROM,
        K_POW2=max(2, triton.next_power_of_2(n_grad)),
        OWN_DELTA=n_grad > 0 or need_row_scale_grad,
    )


def _prior_tables(prior, H, Tq, Tk, q_offset, device):
    """The prior by distance for the kernels: (table, dtable, theta, table_start). A table is
    indexed by x = j - (i - q_offset) = d + q_offset: table (H, n) fp32 holds lp(d) log2(e) at x =
    table_start + t for every x a tile touches (table_start, n: multiples of 16). dtable (H, K, n)
    holds d lp / d theta_k in _parameter_directions' K directions, by forward-mode autograd (not
    allowed below the autograd key, where the ops run); theta (H, K) the entries whose gradient the
    ops return (None, None if K = 0). d > 0 is never visible: 0 there, so no 0 * inf gradient."""
    table_start = -triton.cdiv(Tq + LARGEST_TILE, 16) * 16
    table_stop = triton.cdiv(Tk + LARGEST_TILE, 16) * 16
    d = torch.arange(table_start, table_stop, device=device) - q_offset
    future = d > 0
    params = tuple(t.detach() for t in prior.params)

    # the registry's table (with its floor), one row per head
    def table_of(*values):
        return BoundPrior(prior.family, values).table(d).float().expand(H, -1)

    table = (table_of(*params) * math.log2(math.e)).masked_fill(future, 0.0).contiguous()
    tangents, columns = _parameter_directions(prior, H)
    if not columns:
        return table, None, None, table_start

    jvps = [torch.func.jvp(table_of, params, tangent)[1] for tangent in tangents]
    dtable = torch.stack(jvps, 1).masked_fill(future, 0.0).contiguous()
    theta = torch.stack(columns, 1)
    return table, dtable, theta, table_start


def _parameter_directions(prior, H):
    """(tangents, columns): the K scalar directions of the prior's gradient, one per entry of a
    trained parameter. A per-head parameter (H, ...) has one per entry of a head's slice (that entry
    1 in every head: head h's curve moves by head h's entry only); a shared one, one per entry.
    columns[k] (H,) is the entry per head (a shared one expanded): autograd takes the ops' (H, K)
    gradient back to the parameters, summing a shared entry's over heads. None without grad."""
    tangents, columns = [], []
    if not torch.is_grad_enabled():
        return tangents, columns

    for i, (name, t) in enumerate(zip(prior.family.params, prior.params)):
        if not t.requires_grad:
            continue

        shared = name in prior.family.shared
        flat = t.reshape(-1) if shared else t.reshape(H, -1)
        for e in range(flat.shape[-1]):
            one_hot = torch.zeros_like(flat)
            one_hot[..., e] = 1.0
            tangent = [torch.zeros_like(p) for p in prior.params]
            tangent[i] = one_hot.view_as(t)
            tangents.append(tuple(tangent))
            columns.append(flat[e].float().expand(H) if shared else flat[:, e].float())
    return tangents, columns


def _tile_groups(cfg):
    """(group_m, group_n): the kernels' largest BLOCK_M, BLOCK_N. Skipping whole groups, every
    kernel keeps the same tiles, whole, with no per-score mask."""
    kernels = (cfg["fwd"], cfg["dkdv"], cfg["dq"])
    return max(c[0] for c in kernels), max(c[1] for c in kernels)


def _group_first_keys(first_key, cfg, batch, H, Tq, device):
    """(batch H, groups) int32: the first key of each group of group_m query rows, the smallest of
    its rows' first_key (attention.first_keys: (batch, H, Tq), or None: 0), a multiple of group_n
    and non-decreasing: the groups reading a key block are a prefix (_query_ends)."""
    group_m, group_n = _tile_groups(cfg)
    groups = triton.cdiv(Tq, group_m)
    if first_key is None:
        return torch.zeros(batch * H, groups, device=device, dtype=torch.int32)

    big = torch.iinfo(torch.int32).max
    rows = pad(first_key.flatten(0, 1), (0, groups * group_m - Tq), value=big)
    starts = rows.view(batch * H, groups, group_m).amin(-1) // group_n * group_n
    starts = starts.flip(-1).cummin(-1).values.flip(-1)
    return starts.to(torch.int32).contiguous()


def _query_ends(group_first_key, doc_start, H, Tq, Tk, cfg):
    """(q_end, q_clean) of dK/dV's key blocks. A key block's query blocks are those before q_end
    (batch H, key blocks): whose group's first key is at most the block's first key (a prefix:
    _group_first_keys) and whose earliest doc_start (the queries', (batch, Tq)) is at most its
    last key. Those from q_clean (batch, key blocks; None without documents) on need no document
    mask. Exact for non-decreasing doc_start, conservative otherwise."""
    bm, bn = cfg["dkdv"][:2]
    n_qb = triton.cdiv(Tq, bm)
    n0 = torch.arange(0, Tk, bn, device=group_first_key.device)
    per_head = n0.to(torch.int32).expand(group_first_key.shape[0], -1).contiguous()
    groups_kept = torch.searchsorted(group_first_key, per_head, right=True)
    q_end = (groups_kept * (_tile_groups(cfg)[0] // bm)).clamp(max=n_qb)
    if doc_start is None:
        return q_end.to(torch.int32).contiguous(), None

    batch = doc_start.shape[0]
    ragged = n_qb * bm - Tq
    big = torch.iinfo(torch.int32).max
    rows = doc_start.to(torch.int64)
    first = pad(rows, (0, ragged), value=big).view(batch, n_qb, bm).amin(-1)
    last = pad(rows, (0, ragged), value=-1).view(batch, n_qb, bm).amax(-1)
    # both non-decreasing
    suffix_min = first.flip(-1).cummin(-1).values.flip(-1).contiguous()
    prefix_max = last.cummax(-1).values.contiguous()

    n_last = torch.clamp(n0 + bn, max=Tk) - 1
    doc_end = torch.searchsorted(suffix_min, n_last.expand(batch, -1).contiguous(), right=True)
    q_clean = torch.searchsorted(prefix_max, n0.expand(batch, -1).contiguous(), right=True)
    q_end = torch.minimum(q_end.view(batch, H, -1), doc_end[:, None]).flatten(0, 1)
    return q_end.to(torch.int32).contiguous(), q_clean.to(torch.int32).contiguous()


def _block_d(head_dim):
    # head dims that are not a power of two are padded
    return max(16, triton.next_power_of_2(head_dim))


def _device_of(device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _model_layout(x, dense=True):
    """x (B, H, T, D) as the kernels read it: the model's (B, T, H, D) seen through .transpose(1,
    2), batches T H D apart where dense (else any: a KV cache's views). A copy only where x is laid
    out otherwise (a dimension of size 1 takes any stride)."""
    B, H, T, D = x.shape
    wanted = (T * H * D if dense else x.stride(0), D, H * D, 1)
    if all(n == 1 or s == w for n, s, w in zip(x.shape, x.stride(), wanted)):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_heads(x):
    """An empty tensor shaped as x (B, H, T, D) in the model's layout: what every kernel writes."""
    B, H, T, D = x.shape
    return x.new_empty(B, T, H, D).transpose(1, 2)


def _sizes(q, k, v, q_offset, softmax_scale):
    return Sizes(*q.shape[1:3], k.shape[2], q_offset, softmax_scale, k.stride(0), v.stride(0))


def _flags(q, doc_start, table, row_scale, scale_prior):
    """The compile-time Flags of every launch."""
    has_prior = table is not None
    has_row_scale = row_scale is not None
    return Flags(
        HEAD_DIM=q.shape[-1],
        BLOCK_D=_block_d(q.shape[-1]),
        HAS_DOC=doc_start is not None,
        HAS_PRIOR=has_prior,
        HAS_ROW_SCALE=has_row_scale,
        SCALE_PRIOR=has_prior and has_row_scale and scale_prior,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _dummy(q):
    """What a kernel gets for an input it does not read."""
    return torch.zeros(1, device=q.device, dtype=torch.int32)


def _kernel_inputs(q, doc_start, row_scale, table, dtable, table_start):
    """The optional inputs as the kernels take them (Inputs): a dummy where absent, the tables as
    views from x = 0 (entries before it are read too)."""
    dummy = _dummy(q)
    return Inputs(
        doc=dummy if doc_start is None else doc_start,
        row_scale=dummy if row_scale is None else row_scale,
        table=dummy if table is None else table[:, -table_start:],
        dtable=dummy if dtable is None else dtable[..., -table_start:],
        table_len=0 if table is None else table.shape[-1],
    )


# Two custom ops, forward and backward, with fake (shape-only) implementations and the autograd
# formula between them: torch.compile traces attention like any op (no graph break). The ops run
# the kernels as eager mode does, so compiled and eager results are bitwise equal.
Tensor, OptTensor = torch.Tensor, Optional[torch.Tensor]


@torch.library.custom_op("bam::triton_attention_fwd", mutates_args=())
def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: OptTensor, table: OptTensor,
                dtable: OptTensor, theta: OptTensor, row_scale: OptTensor,
                first_key: OptTensor, scale_prior: bool, q_offset: int, softmax_scale: float,
                table_start: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The forward kernel: (O, LSE), O in the model's layout, LSE (batch, H, 2, Tq) fp32 in base 2
    as two values (_row_lse). q, k, v in the model's layout (attention_triton); doc_start: the
    queries' (batch, Tq) int32; row_scale (batch, H, Tq) fp32; the tables as _prior_tables makes
    them (dtable and theta only for the backward); first_key (batch, H, Tq) or None (every key)."""
    batch, H, Tq, D = q.shape
    o = _empty_heads(q)
    lse = torch.empty((batch, H, 2, Tq), device=q.device, dtype=torch.float32)
    inputs = _kernel_inputs(q, doc_start, row_scale, table, None, table_start)
    sizes = _sizes(q, k, v, q_offset, softmax_scale)
    flags = _flags(q, doc_start, table, row_scale, scale_prior)
    cfg = _configs(D, q.dtype, q.device)
    group_first_key = _group_first_keys(first_key, cfg, batch, H, Tq, q.device)
    grid = (triton.cdiv(Tq, cfg["fwd"][0]), batch * H)
    with _device_of(q.device):
        _attn_fwd[grid](
            q, k, v, o, lse, group_first_key, inputs, sizes, F=flags, **_tiles(cfg, "fwd")
        )
    return o, lse


@_triton_fwd.register_fake
def _(q, k, v, doc_start, table, dtable, theta, row_scale, first_key, scale_prior, q_offset,
      softmax_scale, table_start):  # fmt: skip
    return _empty_heads(q), q.new_empty((*q.shape[:2], 2, q.shape[2]), dtype=torch.float32)


def _tiles(cfg, kernel):
    """A launch's tiles (BLOCK_M, BLOCK_N, and GROUP_M where it skips by query groups) and options,
    from its _configs entry."""
    bm, bn, warps, stages = cfg[kernel]
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    if kernel != "dkdv":
        tiles["GROUP_M"] = _tile_groups(cfg)[0]
    return dict(tiles, enable_fp_fusion=FP_FUSION)


def _launch_dkdv(q, k, v, do, lse, delta, inputs, sizes, group_first_key, flags, cfg):
    """dK, dV: one program per key block, looping over the query blocks that see it."""
    batch, H, Tq, D = q.shape
    dk = _empty_heads(k)
    dv = _empty_heads(v)
    doc_start = inputs.doc if flags.HAS_DOC else None
    q_end, q_clean = _query_ends(group_first_key, doc_start, H, Tq, sizes.Tk, cfg)
    if q_clean is None:
        q_clean = q_end  # not read
    grid = (triton.cdiv(sizes.Tk, cfg["dkdv"][1]), batch * H)
    tensors = (q, k, v, do, dk, dv, lse, delta, q_end, q_clean)
    _attn_bwd_dkdv[grid](*tensors, inputs, sizes, F=flags, **_tiles(cfg, "dkdv"))
    return dk, dv


def _launch_dq(q, k, v, do, lse, delta, inputs, sizes, group_first_key, flags, cfg, plan):
    """dQ, d row_scale and d theta (as GradPlan plan asks): a program per query block over its
    key blocks; partial sums of d theta reduced in a fixed order (no atomics)."""
    batch, H, Tq, D = q.shape
    dq = _empty_heads(q)
    bm, bn = cfg["dq"][:2]
    n_qb = triton.cdiv(Tq, bm)
    if plan.BY_DIAGONAL and bm % bn:
        raise ValueError(f"BY_DIAGONAL needs BLOCK_M a multiple of BLOCK_N, not {bm}, {bn}")

    drow_scale = part = _dummy(q)
    if plan.NEED_ROW_SCALE_GRAD:
        drow_scale = q.new_empty((batch, H, Tq), dtype=torch.float32)
    if plan.N_GRAD:
        part = q.new_empty((batch, H, n_qb, plan.N_GRAD), dtype=torch.float32)
    tensors = (q, k, v, do, dq, lse, delta, drow_scale, part, group_first_key)
    _attn_bwd_dq[(n_qb, batch * H)](*tensors, inputs, sizes, F=flags, G=plan, **_tiles(cfg, "dq"))

    g = part.double().sum(dim=(0, 2)) if plan.N_GRAD else q.new_empty(0, dtype=torch.float64)
    if not plan.NEED_ROW_SCALE_GRAD:
        drow_scale = q.new_empty(0, dtype=torch.float32)
    return dq, g, drow_scale


@torch.library.custom_op("bam::triton_attention_bwd", mutates_args=())
def _triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                doc_start: OptTensor, table: OptTensor, dtable: OptTensor, row_scale: OptTensor,
                first_key: OptTensor, scale_prior: bool, q_offset: int, softmax_scale: float,
                table_start: int, need_row_scale_grad: bool,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward kernels: (dQ, dK, dV in the model's layout, d theta (H, K) fp64 from the
    derivative tables dtable (H, K, n), d row_scale (batch, H, Tq) fp32), the last two empty where
    not asked for. dO and O in the model's layout, the rest as _triton_fwd takes them."""
    batch, H, Tq, D = q.shape
    n_grad = dtable.shape[1] if dtable is not None else 0
    inputs = _kernel_inputs(q, doc_start, row_scale, table, dtable, table_start)
    sizes = _sizes(q, k, v, q_offset, softmax_scale)
    flags = _flags(q, doc_start, table, row_scale, scale_prior)
    cfg = _configs(D, q.dtype, q.device)
    group_first_key = _group_first_keys(first_key, cfg, batch, H, Tq, q.device)
    with _device_of(q.device):
        # preprocess: Delta = rowsum(O * dO)
        delta = torch.empty((batch, H, Tq), device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(Tq, cfg["pre"]), batch * H)
        _attn_bwd_preprocess[grid](
            o, do, delta, sizes, cfg["pre"], flags, enable_fp_fusion=FP_FUSION
        )

        # the configuration once: it asks the driver for the GPU's shared memory
        common = (q, k, v, do, lse, delta, inputs, sizes, group_first_key, flags, cfg)
        dk, dv = _launch_dkdv(*common)
        dq, g, drow_scale = _launch_dq(*common, _grad_plan(n_grad, need_row_scale_grad))
    return dq, dk, dv, g, drow_scale


@_triton_bwd.register_fake
def _(do, q, k, v, o, lse, doc_start, table, dtable, row_scale, first_key, scale_prior,
      q_offset, softmax_scale, table_start, need_row_scale_grad):  # fmt: skip
    g = q.new_empty(dtable.shape[:2] if dtable is not None else (0,), dtype=torch.float64)
    drow_scale = q.new_empty(q.shape[:3] if need_row_scale_grad else (0,), dtype=torch.float32)
    return _empty_heads(q), _empty_heads(k), _empty_heads(v), g, drow_scale


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, doc_start, table, dtable, theta, row_scale, first_key = inputs[:9]
    ctx.save_for_backward(q, k, v, *output, doc_start, table, dtable, row_scale, first_key)
    ctx.args = inputs[9:]
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, doc_start, table, dtable, row_scale, first_key = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    need_row_scale_grad = row_scale is not None and wanted[7]
    dtable = dtable if wanted[6] else None
    # autograd hands dO in the output's layout (the model's) unless an op between changed it
    do = _model_layout(do)
    tensors = (do, q, k, v, o, lse, doc_start, table, dtable, row_scale, first_key)
    dq, dk, dv, g, drow_scale = _triton_bwd(*tensors, *ctx.args, need_row_scale_grad)
    grads = (dq, dk, dv, None, None, None, g.float(), drow_scale)
    grads = [grad if want else None for grad, want in zip(grads, wanted)]
    return (*grads, None, None, None, None, None)


_triton_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def attention_triton(q, k, v, args, first_key=None):
    """attention() with impl "triton" for any registered prior, on attention.py's resolved
    AttentionArgs, from first_key on ((B, H, Tq) or None: every key). Needs CUDA tensors, or
    TRITON_INTERPRET=1 before triton is imported (CPU)."""
    batch, H, Tq, D = q.shape
    Tk = k.shape[2]
    # nothing to attend from (still connected to autograd)
    if Tq == 0:
        return q * 0.0

    # the model's layout, as its projections and KV cache give q, k, v: copied only otherwise
    q = _model_layout(q)
    k = _model_layout(k.to(q.dtype), dense=False)
    v = _model_layout(v.to(q.dtype), dense=False)
    doc_start = None
    if args.doc_start is not None:
        # the kernels read the document starts of the queries only
        queries = args.doc_start[:, args.q_offset : args.q_offset + Tq]
        doc_start = queries.to(q.device, torch.int32).expand(batch, Tq).contiguous()
    row_scale = None
    if args.row_scale is not None:
        row_scale = args.row_scale.float().expand(batch, H, Tq).contiguous()

    tables = (None, None, None, 0)
    if args.prior is not None:
        tables = _prior_tables(args.prior, H, Tq, Tk, args.q_offset, q.device)
    table, dtable, theta, table_start = tables
    tensors = (q, k, v, doc_start, table, dtable, theta, row_scale, first_key)
    options = (args.scale_prior, args.q_offset, args.softmax_scale, table_start)
    out, _ = _triton_fwd(*tensors, *options)
    return out
