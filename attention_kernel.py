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
from typing import Optional

import torch
import torch.nn.functional as F

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


FP_FUSION = True  # every launch's enable_fp_fusion

# Structure (Triton's fused-attention tutorial): the forward is one online-softmax loop over key
# blocks in base 2 (log2 e folded into the scores). The backward: a preprocess Delta = rowsum(O
# dO); a kernel per key block for dK, dV; a kernel per query block for dQ, which also sums the
# gradients of SSMax's row scale and of the prior's parameters, score by score for a few trained
# entries per head (GGD: 2), along tile diagonals for many (T5: 32; DIAGONAL_FROM). Each kernel
# visits the unmasked blocks, then the masked ones before (document starts) and after (diagonal),
# none before its query group's KEY_START (_key_starts).
#
# Inputs are contiguous (B, H, T, D), the row scale (B, H, Tq), the queries' doc_start (B, Tq):
# a program moves its pointers to its (batch, head) and derives offsets from the shapes. Tables
# (_prior_tables) are a row per head: lp(d) in base 2, floored at priors.LOG_PRIOR_FLOOR, and
# J_k(d) = d lp(d) / d theta_k for the K trained directions (GGD: 2, T5: 32; K a compile-time
# constant). A tile's log-prior depends on d = j - i only: a gathered load.
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
# dQ takes Delta from its own P (_own_delta: rowsum(O dO) carries P's rounding before P V, 8 bits
# in bf16) and sums dS x in fp32, not from its 16-bit dS product.
if triton is not None:
    # Triton's interpreter multiplies bf16 blocks as raw uint16; there only, tl.dot upcasts bf16
    # operands to fp32 (exact), so CPU tests still see the bf16 rounding of P and dS.
    _INTERPRET_BF16_UPCAST = tl.constexpr(interpreting())
    _LN2 = tl.constexpr(0.6931471805599453)
    _LOG2E = tl.constexpr(1.4426950408889634)

    # fmt: off
    @triton.jit
    def _dot(a, b, acc, DOT_PREC: tl.constexpr):
        if _INTERPRET_BF16_UPCAST:
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
            if b.dtype == tl.bfloat16:
                b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=DOT_PREC)

    @triton.jit
    def _tile(base, row0, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              TRANSPOSED: tl.constexpr):
        """Pointers to rows row0 .. row0 + ROWS - 1 of a contiguous (T, HEAD_DIM) matrix as a
        (ROWS, BLOCK_D) tile, or TRANSPOSED, and the mask of rows < T and columns < HEAD_DIM
        (BLOCK_D: a power of two). The row offset is 64-bit (a head may pass 2^31 elements)."""
        base = base + tl.cast(row0, tl.int64) * HEAD_DIM
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        if TRANSPOSED:
            ptrs = base + rows[None, :] * HEAD_DIM + cols[:, None]
            mask = (cols < HEAD_DIM)[:, None] & (row0 + rows < T)[None, :]
        else:  # one return: the compiler types all returns alike
            ptrs = base + rows[:, None] * HEAD_DIM + cols[None, :]
            mask = (row0 + rows < T)[:, None] & (cols < HEAD_DIM)[None, :]
        return ptrs, mask

    @triton.jit
    def _load_tile(
            base, row0, T, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr):
        """_tile's tile loaded, 0 where masked."""
        ptrs, mask = _tile(base, row0, T, ROWS, HEAD_DIM, BLOCK_D, TRANSPOSED)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _table_tile(table, rows, cols):
        """A table tile (table: x = 0 of a head's row): t[col - row] for key columns cols (1, N)
        and query rows rows (M, 1), or transposed for dK/dV."""
        return tl.load(table + (cols - rows))

    @triton.jit
    def _row_state(
            DOC, ROW_SCALE, rows, row_ok, softmax_scale, HAS_DOC: tl.constexpr,
            HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr):
        """Query rows' doc_start (0 without documents), row scale r (1 without SSMax) and the
        scores' qk scale: softmax_scale log2(e), times r unless SCALE_PRIOR (r then scales l +
        lp). DOC and ROW_SCALE point at this (batch, head)'s rows."""
        doc = tl.zeros_like(rows)
        if HAS_DOC:
            doc = tl.load(DOC + rows, mask=row_ok, other=0)

        row_scale = tl.full(rows.shape, 1.0, tl.float32)
        if HAS_ROW_SCALE:
            row_scale = tl.load(ROW_SCALE + rows, mask=row_ok, other=0.0)

        qk_scale = softmax_scale * _LOG2E
        if SCALE_PRIOR:
            row_qk_scale = qk_scale + tl.zeros_like(row_scale)
        else:
            row_qk_scale = qk_scale * row_scale
        return doc, row_scale, row_qk_scale

    @triton.jit
    def _tile_scores(
            qk, lp, qpos, kpos, doc, row_qk_scale, row_scale, MASKED: tl.constexpr,
            HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, SCALE_PRIOR: tl.constexpr):
        """A tile's scores in base 2 from q.k and the log-prior tile lp, alike in every kernel,
        -inf where hidden. The arguments broadcast against qk (transposed in dK/dV)."""
        if HAS_PRIOR:
            s = tl.fma(qk, row_qk_scale, lp)
        else:
            s = qk * row_qk_scale
        if SCALE_PRIOR:
            s = s * row_scale

        if MASKED:
            visible = kpos <= qpos
            if HAS_DOC:
                visible = visible & (kpos >= doc)
            s = tl.where(visible, s, float("-inf"))
        return s

    @triton.jit
    def _row_lse(LSE, rows, row_ok, Tq, SCALE_PRIOR: tl.constexpr):
        """The rows' forward LSE as (hi, lo): their max and log2 of their sum (+inf and 0 when
        padded: P = 0). Without SCALE_PRIOR hi is the sum. With it r (l + lp) reaches |r| 1e4
        where the prior is floored: one fp32 LSE would move each P by half an ulp of hi."""
        hi = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
        lo = tl.load(LSE + Tq + rows, mask=row_ok, other=0.0)
        if not SCALE_PRIOR:
            hi = hi + lo
        return hi, lo

    @triton.jit
    def _tile_probs(s, hi, lo, SCALE_PRIOR: tl.constexpr):
        """The backward's P, exactly the forward's: exp2(s - LSE), or exp2((s - hi) - lo)."""
        x = s - hi
        if SCALE_PRIOR:
            x = x - lo
        return tl.exp2(x)

    @triton.jit
    def _stage_blocks(stage: tl.constexpr, start, clean_start, clean_end, end):
        """The blocks [lo, hi) of a stage: 0 unmasked, 1 and 2 the masked ones before and after."""
        if stage == 0:
            return clean_start, clean_end
        elif stage == 1:
            return start, clean_start
        else:
            return clean_end, end

    @triton.jit
    def _key_block_ranges(
            pid_m, row_ok, doc, q_offset, Tq, Tk, KEY_START, HAS_DOC: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Key blocks of query block pid_m: [start, end) holds every key it reads (from its
        GROUP_M rows' KEY_START on), and [clean_start, clean_end) needs no mask (before it:
        document starts; after: the diagonal)."""
        q_first = q_offset + pid_m * BLOCK_M
        q_last = q_offset + tl.minimum(pid_m * BLOCK_M + BLOCK_M, Tq) - 1
        end = q_last // BLOCK_N + 1  # the last key needed is the last valid query's own (causal)
        causal_clean = (q_first + 1) // BLOCK_N  # blocks before it lie at or below every diagonal

        if HAS_DOC:
            first_doc = tl.min(tl.where(row_ok, doc, Tk), 0)  # the rows' earliest document start
            last_doc = tl.max(tl.where(row_ok, doc, 0), 0)
            start = tl.minimum(first_doc // BLOCK_N, end)
            doc_clean = (last_doc + BLOCK_N - 1) // BLOCK_N  # from here: after every doc start
        else:
            start = tl.full([], 0, tl.int32)
            doc_clean = tl.full([], 0, tl.int32)
        start = tl.maximum(start, tl.load(KEY_START + pid_m * BLOCK_M // GROUP_M) // BLOCK_N)

        clean_end = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_start = tl.minimum(tl.maximum(doc_clean, start), clean_end)
        return start, clean_start, clean_end, end

    # ---- forward
    @triton.jit
    def _attn_fwd(
            Q, K, V, OUT, LSE, DOC, ROW_SCALE, TABLE, KEY_START,
            H, Tq, Tk, q_offset, softmax_scale, table_len,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HAS_DOC: tl.constexpr,
            HAS_PRIOR: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
            DOT_PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)  # 64-bit: B H T D may pass 2^31
        # this program's (batch, head)
        Q += bh * Tq * HEAD_DIM
        K += bh * Tk * HEAD_DIM
        V += bh * Tk * HEAD_DIM
        OUT += bh * Tq * HEAD_DIM
        table = TABLE + (bh % H) * table_len

        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < Tq
        qpos = q_offset + rows
        doc, row_scale, row_qk_scale = _row_state(
            DOC + (bh // H) * Tq, ROW_SCALE + bh * Tq, rows, row_ok, softmax_scale, HAS_DOC,
            HAS_ROW_SCALE, SCALE_PRIOR)
        q = _load_tile(Q, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        start, clean_start, clean_end, end = _key_block_ranges(
            pid_m, row_ok, doc, q_offset, Tq, Tk, KEY_START + bh * tl.cdiv(Tq, GROUP_M), HAS_DOC,
            BLOCK_M, BLOCK_N, GROUP_M)

        # the online softmax; row_max is -inf while a row sees nothing
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            for blk in range(blk_lo, blk_hi):
                n0 = blk * BLOCK_N
                cols = n0 + tl.arange(0, BLOCK_N)
                kT = _load_tile(K, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, True)
                lp = 0.0
                if HAS_PRIOR:
                    lp = _table_tile(table, rows[:, None], cols[None, :])

                qk = _dot(q, kT, None, DOT_PREC)
                s = _tile_scores(
                    qk, lp, qpos[:, None], cols[None, :], doc[:, None], row_qk_scale[:, None],
                    row_scale[:, None], stage > 0, HAS_DOC, HAS_PRIOR, SCALE_PRIOR)

                # a row with nothing visible yet subtracts 0 instead (no -inf - -inf)
                new_max = tl.maximum(row_max, tl.max(s, 1))
                ref = tl.where(new_max == float("-inf"), 0.0, new_max)
                p = tl.exp2(s - ref[:, None])
                alpha = tl.exp2(row_max - ref)
                row_sum = row_sum * alpha + tl.sum(p, 1)

                v = _load_tile(V, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, False)
                acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
                row_max = new_max

        # max and log2(sum) apart (_row_lse); a row that sees nothing stores +inf: backward P = 0
        has_mass = row_sum > 0.0
        safe_sum = tl.where(has_mass, row_sum, 1.0)
        LSE += bh * 2 * Tq
        tl.store(LSE + rows, tl.where(has_mass, row_max, float("inf")), mask=row_ok)
        tl.store(LSE + Tq + rows, tl.log2(safe_sum), mask=row_ok)
        out_ptrs, out_mask = _tile(OUT, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        tl.store(out_ptrs, (acc / safe_sum[:, None]).to(OUT.dtype.element_ty), mask=out_mask)

    # ---- backward
    @triton.jit
    def _attn_bwd_preprocess(
            OUT, DO, DELTA, Tq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        o = _load_tile(OUT + bh * Tq * HEAD_DIM, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        do = _load_tile(DO + bh * Tq * HEAD_DIM, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * Tq + rows, delta, mask=rows < Tq)

    @triton.jit
    def _attn_bwd_dkdv(
            Q, K, V, DO, DK, DV, LSE, DELTA, DOC, ROW_SCALE, TABLE, QEND, QCLEAN, QKEPT,
            H, Tq, Tk, q_offset, softmax_scale, table_len, n_kblocks,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
            HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
            DOT_PREC: tl.constexpr):
        pid_n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        # this program's (batch, head)
        Q += bh * Tq * HEAD_DIM
        DO += bh * Tq * HEAD_DIM
        K += bh * Tk * HEAD_DIM
        V += bh * Tk * HEAD_DIM
        DK += bh * Tk * HEAD_DIM
        DV += bh * Tk * HEAD_DIM
        LSE += bh * 2 * Tq
        DELTA += bh * Tq
        ROW_SCALE += bh * Tq
        DOC += b * Tq
        table = TABLE + (bh % H) * table_len

        n0 = pid_n * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _load_tile(K, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, False)
        v = _load_tile(V, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, False)

        # query blocks [start, end) read this key block: from the first query at or after n0 to
        # the last whose earliest doc start is <= its last key (_kv_ranges) and that reads it
        n_qblocks = (Tq + BLOCK_M - 1) // BLOCK_M
        if HAS_DOC:
            end = tl.load(QEND + b * n_kblocks + pid_n)
            doc_clean = tl.load(QCLEAN + b * n_kblocks + pid_n)  # before it: every doc_start <= n0
        else:
            end = n_qblocks
            doc_clean = n_qblocks
        end = tl.minimum(end, tl.load(QKEPT + bh * n_kblocks + pid_n))
        start = tl.minimum(tl.maximum(n0 - q_offset, 0) // BLOCK_M, end)
        # the first query block wholly at or after the block's last key (a ragged last key block
        # is always masked: keys >= Tk count as after every query)
        causal_clean = (tl.maximum(n0 + BLOCK_N - 1 - q_offset, 0) + BLOCK_M - 1) // BLOCK_M
        clean_start = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_end = tl.minimum(tl.maximum(doc_clean, clean_start), end)

        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            for blk in range(blk_lo, blk_hi):
                m0 = blk * BLOCK_M
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < Tq
                qT = _load_tile(Q, m0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, True)
                # padded query rows: P = 0, and dO = 0, so they add nothing
                hi, lo = _row_lse(LSE, rows, row_ok, Tq, SCALE_PRIOR)
                delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
                # doc_start is only needed (and loaded) for the masked tiles
                doc, row_scale, row_qk_scale = _row_state(
                    DOC, ROW_SCALE, rows, row_ok, softmax_scale, stage > 0 and HAS_DOC,
                    HAS_ROW_SCALE, SCALE_PRIOR)
                lpT = 0.0
                if HAS_PRIOR:  # the transposed tile: entry (key, query)
                    lpT = _table_tile(table, rows[None, :], cols[:, None])

                qkT = _dot(k, qT, None, DOT_PREC)  # (BLOCK_N, BLOCK_M): keys x queries
                sT = _tile_scores(qkT, lpT, q_offset + rows[None, :], cols[:, None], doc[None, :],
                                  row_qk_scale[None, :], row_scale[None, :], stage > 0, HAS_DOC,
                                  HAS_PRIOR, SCALE_PRIOR)
                pT = _tile_probs(sT, hi[None, :], lo[None, :], SCALE_PRIOR)

                do = _load_tile(DO, m0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
                dv = _dot(pT.to(do.dtype), do, dv, DOT_PREC)
                dpT = _dot(v, tl.trans(do), None, DOT_PREC)
                if HAS_ROW_SCALE:  # the gradient of l: dS r = P (dP r - Delta r)
                    dscoreT = pT * tl.fma(dpT, row_scale[None, :], -(delta * row_scale)[None, :])
                else:
                    dscoreT = pT * (dpT - delta[None, :])
                dk = _dot(dscoreT.to(qT.dtype), tl.trans(qT), dk, DOT_PREC)

        dk_ptrs, kv_mask = _tile(DK, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, False)
        tl.store(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_mask)
        dv_ptrs, kv_mask = _tile(DV, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, False)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _dq_tile(
            q, K, V, table, n0, rows, q_offset, doc, row_qk_scale, row_scale, hi, lo, Tk,
            MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
            SCALE_PRIOR: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
        """What both of dQ's passes compute of key block n0: K^T, V^T, lp, q.k and P."""
        cols = n0 + tl.arange(0, BLOCK_N)
        kT = _load_tile(K, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, True)
        vT = _load_tile(V, n0, Tk, BLOCK_N, HEAD_DIM, BLOCK_D, True)
        lp = 0.0
        if HAS_PRIOR:
            lp = _table_tile(table, rows[:, None], cols[None, :])

        qk = _dot(q, kT, None, DOT_PREC)
        s = _tile_scores(
            qk, lp, q_offset + rows[:, None], cols[None, :], doc[:, None], row_qk_scale[:, None],
            row_scale[:, None], MASKED, HAS_DOC, HAS_PRIOR, SCALE_PRIOR)
        return kT, vT, lp, qk, _tile_probs(s, hi[:, None], lo[:, None], SCALE_PRIOR)

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
    def _prior_grad(
            dj_acc, g_acc, dscore, w, dtable, table_len, row0, n0, N_GRAD: tl.constexpr,
            BY_DIAGONAL: tl.constexpr, K_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
        """A tile's share of the prior's gradient: per score dS J_k into dj_acc[k] (times w per
        row later), or BY_DIAGONAL w dS summed along the tile's diagonals (d is constant on each)
        times each table's entries there, into g_acc: 2 BLOCK_N loads per table, no accumulator."""
        if BY_DIAGONAL:
            diag = _diagonal_sums(dscore * w[:, None], BLOCK_M, BLOCK_N)  # (N_SUB, 2 BLOCK_N)
            u = tl.arange(0, 2 * BLOCK_N)[None, :]
            first_row = row0 + tl.arange(0, BLOCK_M // BLOCK_N)[:, None] * BLOCK_N
            x = n0 - first_row - (BLOCK_N - 1) + u  # the tables' index of each diagonal
            kk = tl.arange(0, K_POW2)[:, None, None]
            entries = tl.load(dtable + kk * table_len + x[None, :, :],
                              mask=(kk < N_GRAD) & (u[None, :, :] < 2 * BLOCK_N - 1), other=0.0)
            g_acc += tl.sum(tl.sum(entries * diag[None, :, :], 2), 1)
        else:
            rows = row0 + tl.arange(0, BLOCK_M)[:, None]
            cols = n0 + tl.arange(0, BLOCK_N)[None, :]
            summed = ()
            for i in tl.static_range(N_GRAD):
                dtile = _table_tile(dtable + i * table_len, rows, cols)
                summed = summed + (dj_acc[i] + dscore * dtile,)
            dj_acc = summed
        return dj_acc, g_acc

    # dQ keeps its row sums per score (reduced once after the loop: no cross-lane reductions in
    # it): dx_acc = dS x for d row_scale (x = l + lp with scale_prior, else l), in fp32 rather than
    # from dQ's 16-bit dS product, whose row sums cancel to its rounding; and the prior's.
    @triton.jit
    def _attn_bwd_dq(
            Q, K, V, DO, DQ, LSE, DELTA, DOC, ROW_SCALE, TABLE, DTABLE, DROW_SCALE, PART, KEY_START,
            H, Tq, Tk, q_offset, softmax_scale, table_len, n_qblocks,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, HAS_DOC: tl.constexpr,
            HAS_PRIOR: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
            N_GRAD: tl.constexpr, NEED_ROW_SCALE_GRAD: tl.constexpr,
            BY_DIAGONAL: tl.constexpr, K_POW2: tl.constexpr, OWN_DELTA: tl.constexpr,
            DOT_PREC: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        # this program's (batch, head)
        Q += bh * Tq * HEAD_DIM
        DO += bh * Tq * HEAD_DIM
        DQ += bh * Tq * HEAD_DIM
        K += bh * Tk * HEAD_DIM
        V += bh * Tk * HEAD_DIM
        table = TABLE + (bh % H) * table_len
        dtable = DTABLE + (bh % H) * N_GRAD * table_len

        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < Tq
        doc, row_scale, row_qk_scale = _row_state(
            DOC + (bh // H) * Tq, ROW_SCALE + bh * Tq, rows, row_ok, softmax_scale, HAS_DOC,
            HAS_ROW_SCALE, SCALE_PRIOR)
        q = _load_tile(Q, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        do = _load_tile(DO, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        hi, lo = _row_lse(LSE + bh * 2 * Tq, rows, row_ok, Tq, SCALE_PRIOR)
        start, clean_start, clean_end, end = _key_block_ranges(
            pid_m, row_ok, doc, q_offset, Tq, Tk, KEY_START + bh * tl.cdiv(Tq, GROUP_M), HAS_DOC,
            BLOCK_M, BLOCK_N, GROUP_M)
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

        if OWN_DELTA:  # Delta_i = sum_j P_ij dP_ij from this kernel's P, not the forward's O
            delta_acc = zero
            for stage in tl.static_range(3):
                blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
                for blk in range(blk_lo, blk_hi):
                    kT, vT, lp, qk, p = _dq_tile(
                        q, K, V, table, blk * BLOCK_N, rows, q_offset, doc, row_qk_scale, row_scale,
                        hi, lo, Tk, stage > 0, HAS_DOC, HAS_PRIOR, SCALE_PRIOR, HEAD_DIM, BLOCK_D,
                        BLOCK_N, DOT_PREC)
                    delta_acc += p * _dot(do, vT, None, DOT_PREC)
            delta = tl.sum(delta_acc, 1)
        else:
            delta = tl.load(DELTA + bh * Tq + rows, mask=row_ok, other=0.0)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dx_acc = zero
        dj_acc = ()
        if not BY_DIAGONAL:
            for i in tl.static_range(N_GRAD):
                dj_acc = dj_acc + (zero,)
        g_acc = tl.zeros([K_POW2], dtype=tl.float32)
        # a row with one visible key has P = 1 whatever its scores: its gradients are exactly 0
        multi = tl.where(row_ok & (q_offset + rows > doc), 1.0, 0.0)
        w = multi
        # d lp = dS r
        if SCALE_PRIOR:
            w = w * row_scale
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            for blk in range(blk_lo, blk_hi):
                n0 = blk * BLOCK_N
                kT, vT, lp, qk, p = _dq_tile(q, K, V, table, n0, rows, q_offset, doc, row_qk_scale,
                                             row_scale, hi, lo, Tk, stage > 0, HAS_DOC, HAS_PRIOR,
                                             SCALE_PRIOR, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PREC)
                dscore = p * (_dot(do, vT, None, DOT_PREC) - delta[:, None])
                # sum_j dS k_j; r at the end
                dq = _dot(dscore.to(kT.dtype), tl.trans(kT), dq, DOT_PREC)
                if NEED_ROW_SCALE_GRAD:
                    x = qk * softmax_scale  # l; the tile lp is in base 2
                    if SCALE_PRIOR:
                        x = x + lp * _LN2
                    dx_acc += dscore * x
                if N_GRAD > 0:
                    dj_acc, g_acc = _prior_grad(dj_acc, g_acc, dscore, w, dtable, table_len, row0,
                                                n0, N_GRAD, BY_DIAGONAL, K_POW2, BLOCK_M, BLOCK_N)

        dq = dq * (softmax_scale * row_scale * multi)[:, None]
        dq_ptrs, dq_mask = _tile(DQ, row0, Tq, BLOCK_M, HEAD_DIM, BLOCK_D, False)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_mask)
        if NEED_ROW_SCALE_GRAD:
            tl.store(DROW_SCALE + bh * Tq + rows, tl.sum(dx_acc, 1) * multi, mask=row_ok)
        part = PART + (bh * n_qblocks + pid_m) * N_GRAD
        if BY_DIAGONAL:
            kk = tl.arange(0, K_POW2)
            tl.store(part + kk, g_acc, mask=kk < N_GRAD)
        else:
            for i in tl.static_range(N_GRAD):
                tl.store(part + i, tl.sum(w * tl.sum(dj_acc[i], 1), 0))
    # fmt: on


# ---- Launch configuration, the prior's tables, and the custom ops
# Fixed tiles per (head_dim, dtype), not triton.autotune: the tile-skipping tables depend on the
# block sizes, and autotuning would multiply the interpreter's test time. The interpreter runs
# INTERPRET_BLOCKS; tests set None (the GPU's tiles) or smaller tiles.
INTERPRET_BLOCKS = (32, 32)


def _configs(block_d, dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: sm_90 builds with every flag on spill
    (almost) no registers. Not tuned on hardware."""
    if interpreting() and INTERPRET_BLOCKS is not None:
        bm, bn = INTERPRET_BLOCKS
        return dict(fwd=(bm, bn, 4, 1), dkdv=(bm, bn, 4, 1), dq=(bm, bn, 4, 1), pre=bm)

    # fp32: ieee dots on FMA units, for exact gradient checks, not speed
    if dtype == torch.float32:
        if block_d <= 64:
            return dict(fwd=(64, 32, 8, 2), dkdv=(32, 64, 8, 2), dq=(64, 32, 8, 2), pre=64)
        return dict(fwd=(32, 32, 4, 2), dkdv=(16, 32, 4, 2), dq=(32, 16, 4, 2), pre=64)

    if block_d <= 64:
        return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 3), dq=(128, 32, 8, 2), pre=128)
    # dK/dV: 64 keys per warpgroup, or Hopper falls back from wgmma to mma.sync (smem-bound)
    return dict(fwd=(128, 32, 8, 2), dkdv=(32, 64, 4, 2), dq=(64, 16, 8, 2), pre=128)


def check_length(head_dim, dtype):
    """The length of the self-check's problem (infra/kernel_check.py): two full tiles of every
    kernel's configuration and a ragged third, to run unmasked, diagonal and ragged tiles."""
    cfg = _configs(_block_d(head_dim), dtype)
    largest = max(max(cfg[kernel][:2]) for kernel in ("fwd", "dkdv", "dq"))
    return 2 * largest + largest // 2 + 3


# From this many derivative tables on, dQ sums the prior's gradient per tile diagonal: per-score
# accumulators for many tables do not fit in registers.
DIAGONAL_FROM = 4


def _grad_path(n_grad):
    """The dQ kernel's flags for K derivative tables: BY_DIAGONAL, and K_POW2 (its accumulator)."""
    return dict(BY_DIAGONAL=n_grad >= DIAGONAL_FROM, K_POW2=max(2, triton.next_power_of_2(n_grad)))


def _own_delta(n_grad, need_row_scale_grad):
    """Whether dQ recomputes Delta from its own P (a second pass over the row's keys) rather than
    reading rowsum(O * dO): whenever it sums d theta or d row_scale, sums over every score where
    each row's error in Delta adds up (up to 40 % in bf16 without it: dev/README.md)."""
    return n_grad > 0 or need_row_scale_grad


def _prior_tables(prior, H, Tq, Tk, q_offset, cfg, device):
    """The prior by distance for the kernels: (table, dtable, theta, table_start). A table is
    indexed by x = j - (i - q_offset) = d + q_offset: table (H, n) fp32 holds lp(d) log2(e) at x =
    table_start + t for every x a tile touches (table_start, n: multiples of 16). dtable (H, K, n)
    holds d lp / d theta_k in _parameter_directions' K directions, by forward-mode autograd (not
    allowed below the autograd key, where the ops run); theta (H, K) the entries whose gradient the
    ops return (None, None if K = 0). d > 0 is never visible: 0 there, so no 0 * inf gradient."""
    pad = max(max(c[:2]) for c in (cfg["fwd"], cfg["dkdv"], cfg["dq"]))
    table_start = -triton.cdiv(Tq + pad, 16) * 16
    table_stop = triton.cdiv(Tk + pad, 16) * 16
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


def _kv_ranges(doc_start, block_m, block_n, Tk):
    """(q_end, q_clean) per (batch, key block) from the queries' doc_start (batch, Tq): query
    blocks >= q_end see none of it (earliest doc_start after its last key); those < q_clean need
    no document mask. Exact for non-decreasing doc_start, conservative otherwise."""
    batch, Tq = doc_start.shape
    n_qb = triton.cdiv(Tq, block_m)
    pad = n_qb * block_m - Tq
    big = torch.iinfo(torch.int32).max

    rows = doc_start.to(torch.int64)
    first = F.pad(rows, (0, pad), value=big).view(batch, n_qb, block_m).amin(-1)
    last = F.pad(rows, (0, pad), value=-1).view(batch, n_qb, block_m).amax(-1)
    # both non-decreasing
    suffix_min = first.flip(-1).cummin(-1).values.flip(-1).contiguous()
    prefix_max = last.cummax(-1).values.contiguous()

    n0 = torch.arange(0, Tk, block_n, device=doc_start.device)
    n_last = torch.clamp(n0 + block_n, max=Tk) - 1
    q_end = torch.searchsorted(suffix_min, n_last.expand(batch, -1).contiguous(), right=True)
    q_clean = torch.searchsorted(prefix_max, n0.expand(batch, -1).contiguous(), right=True)
    return q_end.to(torch.int32).contiguous(), q_clean.to(torch.int32).contiguous()


def _tile_groups(cfg):
    """(group_m, group_n): the kernels' largest BLOCK_M, BLOCK_N. Skipping whole groups, every
    kernel keeps the same tiles, whole, with no per-score mask."""
    kernels = (cfg["fwd"], cfg["dkdv"], cfg["dq"])
    return max(c[0] for c in kernels), max(c[1] for c in kernels)


def _key_starts(first_key, cfg, batch, H, Tq, device):
    """(batch H, groups) int32: each group of group_m rows' first key (key_windows' or 0), a
    multiple of group_n, non-decreasing: the groups reading a key block are a prefix."""
    group_m, group_n = _tile_groups(cfg)
    groups = triton.cdiv(Tq, group_m)
    if first_key is None:
        return torch.zeros(batch * H, groups, device=device, dtype=torch.int32)

    big = torch.iinfo(torch.int32).max
    rows = F.pad(first_key.flatten(0, 1), (0, groups * group_m - Tq), value=big)
    starts = rows.view(batch * H, groups, group_m).amin(-1) // group_n * group_n
    starts = starts.flip(-1).cummin(-1).values.flip(-1)
    return starts.to(torch.int32).contiguous()


def _block_d(head_dim):
    # head dims that are not a power of two are padded
    return max(16, triton.next_power_of_2(head_dim))


def _device_of(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _flags(q, doc_start, table, row_scale, scale_prior):
    """The compile-time flags of every launch. SCALE_PRIOR: the row scale multiplies the prior too.
    DOT_PREC only matters for fp32 inputs."""
    has_prior = table is not None
    has_row_scale = row_scale is not None
    return dict(
        HEAD_DIM=q.shape[-1],
        BLOCK_D=_block_d(q.shape[-1]),
        HAS_DOC=doc_start is not None,
        HAS_PRIOR=has_prior,
        HAS_ROW_SCALE=has_row_scale,
        SCALE_PRIOR=has_prior and has_row_scale and scale_prior,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        enable_fp_fusion=FP_FUSION,
    )


def _kernel_inputs(q, doc_start, row_scale, table, dtable, table_start):
    """The optional inputs as the kernels take them: a dummy where absent, the tables as views from
    x = 0 (entries before it are read too), and table_len, the entries per head."""
    dummy = torch.zeros(1, device=q.device, dtype=torch.int32)
    inputs = dict(dummy=dummy, doc=dummy, row_scale=dummy, table=dummy, dtable=dummy, table_len=0)
    if doc_start is not None:
        inputs["doc"] = doc_start
    if row_scale is not None:
        inputs["row_scale"] = row_scale
    if table is not None:
        inputs["table"] = table[:, -table_start:]
        inputs["table_len"] = table.shape[-1]
    if dtable is not None:
        inputs["dtable"] = dtable[..., -table_start:]
    return inputs


# Two custom ops, forward and backward, with fake (shape-only) implementations and the autograd
# formula between them: torch.compile traces attention like any op (no graph break). The ops run
# the kernels as eager mode does, so compiled and eager results are bitwise equal.
Tensor, OptTensor = torch.Tensor, Optional[torch.Tensor]


@torch.library.custom_op("bam::triton_attention_fwd", mutates_args=())
def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: OptTensor, table: OptTensor,
                dtable: OptTensor, theta: OptTensor, row_scale: OptTensor, key_start: Tensor,
                scale_prior: bool, q_offset: int, softmax_scale: float,
                table_start: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The forward kernel: (O, LSE), LSE (batch, H, 2, Tq) fp32 in base 2 as two values
    (_row_lse). doc_start: the queries' (batch, Tq) int32; row_scale (batch, H, Tq) fp32; the
    tables as _prior_tables makes them (dtable and theta only for the backward); key_start as
    _key_starts makes it."""
    batch, H, Tq, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((batch, H, 2, Tq), device=q.device, dtype=torch.float32)
    inputs = _kernel_inputs(q, doc_start, row_scale, table, None, table_start)
    cfg = _configs(_block_d(D), q.dtype)
    bm, bn, warps, stages = cfg["fwd"]
    with _device_of(q):
        _attn_fwd[(triton.cdiv(Tq, bm), batch * H)](
            q, k, v, o, lse, inputs["doc"], inputs["row_scale"], inputs["table"], key_start,
            H, Tq, k.shape[2], q_offset, softmax_scale, inputs["table_len"],
            BLOCK_M=bm, BLOCK_N=bn, GROUP_M=_tile_groups(cfg)[0], num_warps=warps,
            num_stages=stages,
            **_flags(q, doc_start, table, row_scale, scale_prior),
        )  # fmt: skip
    return o, lse


@_triton_fwd.register_fake
def _(q, k, v, doc_start, table, dtable, theta, row_scale, key_start, scale_prior, q_offset,
      softmax_scale, table_start):  # fmt: skip
    return torch.empty_like(q), q.new_empty((*q.shape[:2], 2, q.shape[2]), dtype=torch.float32)


def _launch_dkdv(q, k, v, do, lse, delta, inputs, key_start, q_offset, softmax_scale, flags):
    """dK, dV: one program per key block, looping over the query blocks that see it."""
    batch, H, Tq, D = q.shape
    Tk = k.shape[2]
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    cfg = _configs(_block_d(D), q.dtype)
    bm, bn, warps, stages = cfg["dkdv"]
    n_kb = triton.cdiv(Tk, bn)

    q_end = q_clean = inputs["doc"]
    if flags["HAS_DOC"]:
        q_end, q_clean = _kv_ranges(inputs["doc"], bm, bn, Tk)
    # per key block, the query blocks whose group's key start is at most its first key
    n0 = torch.arange(0, Tk, bn, device=q.device).expand(batch * H, -1).contiguous()
    groups_kept = torch.searchsorted(key_start, n0.to(torch.int32), right=True)
    q_kept = (groups_kept * (_tile_groups(cfg)[0] // bm)).to(torch.int32).contiguous()
    _attn_bwd_dkdv[(n_kb, batch * H)](
        q, k, v, do, dk, dv, lse, delta, inputs["doc"], inputs["row_scale"], inputs["table"],
        q_end, q_clean, q_kept, H, Tq, Tk, q_offset, softmax_scale, inputs["table_len"], n_kb,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **flags,
    )  # fmt: skip
    return dk, dv


def _launch_dq(q, k, v, do, lse, delta, inputs, key_start, n_grad, need_row_scale_grad, q_offset,
               softmax_scale, flags):  # fmt: skip
    """dQ, d row_scale and d theta: a program per query block over its key blocks; partial sums
    of d theta reduced in a fixed order (no atomics)."""
    batch, H, Tq, D = q.shape
    dq = torch.empty_like(q)
    cfg = _configs(_block_d(D), q.dtype)
    bm, bn, warps, stages = cfg["dq"]
    n_qb = triton.cdiv(Tq, bm)
    grad_path = _grad_path(n_grad)
    if grad_path["BY_DIAGONAL"] and bm % bn:
        raise ValueError(f"BY_DIAGONAL needs BLOCK_M a multiple of BLOCK_N, not {bm}, {bn}")

    drow_scale = part = inputs["dummy"]
    if need_row_scale_grad:
        drow_scale = q.new_empty((batch, H, Tq), dtype=torch.float32)
    if n_grad:
        part = q.new_empty((batch, H, n_qb, n_grad), dtype=torch.float32)
    _attn_bwd_dq[(n_qb, batch * H)](
        q, k, v, do, dq, lse, delta, inputs["doc"], inputs["row_scale"], inputs["table"],
        inputs["dtable"], drow_scale, part, key_start, H, Tq, k.shape[2], q_offset,
        softmax_scale, inputs["table_len"], n_qb, BLOCK_M=bm, BLOCK_N=bn,
        GROUP_M=_tile_groups(cfg)[0], N_GRAD=n_grad,
        NEED_ROW_SCALE_GRAD=need_row_scale_grad, **grad_path,
        OWN_DELTA=_own_delta(n_grad, need_row_scale_grad), num_warps=warps, num_stages=stages,
        **flags,
    )  # fmt: skip

    g = part.double().sum(dim=(0, 2)) if n_grad else q.new_empty(0, dtype=torch.float64)
    if not need_row_scale_grad:
        drow_scale = q.new_empty(0, dtype=torch.float32)
    return dq, g, drow_scale


@torch.library.custom_op("bam::triton_attention_bwd", mutates_args=())
def _triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                doc_start: OptTensor, table: OptTensor, dtable: OptTensor, row_scale: OptTensor,
                key_start: Tensor, scale_prior: bool, q_offset: int, softmax_scale: float,
                table_start: int, need_row_scale_grad: bool,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward kernels: (dQ, dK, dV, d theta (H, K) fp64 from the derivative tables dtable
    (H, K, n), d row_scale (batch, H, Tq) fp32), the last two empty where not asked for."""
    batch, H, Tq, D = q.shape
    n_grad = dtable.shape[1] if dtable is not None else 0
    inputs = _kernel_inputs(q, doc_start, row_scale, table, dtable, table_start)
    flags = _flags(q, doc_start, table, row_scale, scale_prior)
    with _device_of(q):
        # preprocess: Delta = rowsum(O * dO)
        delta = torch.empty((batch, H, Tq), device=q.device, dtype=torch.float32)
        pm = _configs(_block_d(D), q.dtype)["pre"]
        _attn_bwd_preprocess[(triton.cdiv(Tq, pm), batch * H)](
            o, do, delta, Tq, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=pm,
            enable_fp_fusion=FP_FUSION,
        )  # fmt: skip

        common = (q, k, v, do, lse, delta, inputs, key_start)
        dk, dv = _launch_dkdv(*common, q_offset, softmax_scale, flags)
        dq, g, drow_scale = _launch_dq(
            *common, n_grad, need_row_scale_grad, q_offset, softmax_scale, flags)  # fmt: skip
    return dq, dk, dv, g, drow_scale


@_triton_bwd.register_fake
def _(do, q, k, v, o, lse, doc_start, table, dtable, row_scale, key_start, scale_prior, q_offset,
      softmax_scale, table_start, need_row_scale_grad):  # fmt: skip
    g = q.new_empty(dtable.shape[:2] if dtable is not None else (0,), dtype=torch.float64)
    drow_scale = q.new_empty(q.shape[:3] if need_row_scale_grad else (0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), g, drow_scale


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, doc_start, table, dtable, theta, row_scale, key_start = inputs[:9]
    ctx.save_for_backward(q, k, v, *output, doc_start, table, dtable, row_scale, key_start)
    ctx.args = inputs[9:]
    ctx.theta_dtype = theta.dtype if theta is not None else None
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, doc_start, table, dtable, row_scale, key_start = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    need_row_scale_grad = row_scale is not None and wanted[7]
    dtable = dtable if wanted[6] else None
    tensors = (do.contiguous(), q, k, v, o, lse, doc_start, table, dtable, row_scale, key_start)
    dq, dk, dv, g, drow_scale = _triton_bwd(*tensors, *ctx.args, need_row_scale_grad)
    grads = (dq, dk, dv, None, None, None, g.to(ctx.theta_dtype or g.dtype), drow_scale)
    grads = [grad if want else None for grad, want in zip(grads, wanted)]
    return (*grads, None, None, None, None, None)


_triton_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def attention_triton(q, k, v, args):
    """attention() with impl "triton" for any registered prior, on attention.py's resolved
    AttentionArgs. Needs CUDA tensors, or TRITON_INTERPRET=1 before triton is imported (CPU)."""
    batch, H, Tq, D = q.shape
    Tk = k.shape[2]
    # nothing to attend from (still connected to autograd)
    if Tq == 0:
        return q * 0.0

    # the kernels take contiguous inputs and derive their offsets from the shapes
    q = q.contiguous()
    k = k.to(q.dtype).contiguous()
    v = v.to(q.dtype).contiguous()
    doc_start = None
    if args.doc_start is not None:
        # the kernels read the document starts of the queries only
        queries = args.doc_start[:, args.q_offset : args.q_offset + Tq]
        doc_start = queries.to(q.device, torch.int32).expand(batch, Tq).contiguous()
    row_scale = None
    if args.row_scale is not None:
        row_scale = args.row_scale.float().expand(batch, H, Tq).contiguous()

    cfg = _configs(_block_d(D), q.dtype)
    tables = (None, None, None, 0)
    if args.prior is not None:
        tables = _prior_tables(args.prior, H, Tq, Tk, args.q_offset, cfg, q.device)
    table, dtable, theta, table_start = tables
    key_start = _key_starts(args.first_key, cfg, batch, H, Tq, q.device)
    tensors = (q, k, v, doc_start, table, dtable, theta, row_scale, key_start)
    options = (args.scale_prior, args.q_offset, args.softmax_scale, table_start)
    out, _ = _triton_fwd(*tensors, *options)
    return out
