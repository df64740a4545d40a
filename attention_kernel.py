"""
The Triton kernel of bam-gpt's attention (impl "triton"): flash attention with any registered prior
and SSMax, forward and backward, registered as torch.library custom ops. attention.py holds the
contract and the formula, and calls attention_triton with its resolved arguments.

The kernels never see a prior's formula, only its table of log-priors by distance (and, for the
gradients, the table's derivatives in its trained parameters), built here from the registry's
BoundPrior.table. Their gradients are deterministic: partial sums per program, reduced in a fixed
order, no atomics. The math and the numerics are written out above the kernels.
"""

import contextlib
import math
import os
import time
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
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): the kernels then run, slowly, on CPU
    tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available():
    # the import is tried once, above (no import inside code that torch.compile traces)
    return triton is not None


FP_FUSION = True  # every launch's enable_fp_fusion (dev/perf_model.py compiles with the same)
# shifted copies per table: a tile row is then a 16-byte aligned run of fp32 entries
TABLE_COPIES = 4

# Structure (Triton's fused-attention tutorial): the forward is one online-softmax loop over key
# blocks, in base 2 (log2 e folded into the scores). The backward is a preprocess Delta = rowsum(O
# * dO), a kernel per key block that accumulates dK and dV over query blocks, and a kernel per
# query block for dQ, which also sums the gradients of SSMax's row scale and of the prior's
# parameters. A prior with a few trained entries per head (GGD: 2) has its gradient summed score
# by score; one with many (T5: 32 buckets) tile by tile, along the tile's diagonals, on which d is
# constant (DIAGONAL_FROM). Every kernel visits its blocks in three stages: the unmasked ones,
# then the masked ones before and after them (document starts, the diagonal).
#
# The tables (_prior_tables): lp(d) per head, floored at priors.LOG_PRIOR_FLOOR, and for the K
# scalar directions of the prior's trained parameters (one per entry: GGD's two per head, T5's 32
# buckets) the derivative tables J_k(d) = d lp(d) / d theta_k, K a compile-time constant. A tile's
# log-prior depends on d = j - i only (a Toeplitz tile); each table is stored as TABLE_COPIES
# copies shifted by one entry, so that every row of a tile is a 16-byte aligned run of one copy:
# vectorised loads.
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
# Numerics: the scores are one explicit fma (s = fma(q.k, row_qk_scale_i, lp)), the same in every
# kernel, so the backward recomputes the forward's scores bit for bit even with fp fusion on; a
# row with one visible key thus gets P = 1 exactly, and its gradients, exactly 0 in real
# arithmetic, are set to 0 (dQ, d theta, d row_scale) rather than left as rounding noise.
#
# With SSMax scaling the prior (SCALE_PRIOR) the row scale goes into the exponent's fma instead of
# a multiply per score: t = fma(q.k, softmax_scale log2 e, lp), P = exp2(fma(t, r, -hi) - lo). The
# forward takes the row max of sign(r) t (a row with r < 0 reads -lp from a negated copy of the
# table, so the sign costs nothing per score) and keeps hi = |r| max and lo = log2 sum apart; |r|
# (sign(r) t) is the same product as r t, so the backward's P is the forward's, normalised to one
# rounding.
#
# d theta and d row_scale sum dS times a table or a score over every score, so each row's error in
# Delta reaches them times the tables' size. The floor bounds every table, so that this is at most
# |floor| times Delta's error, not times a prior of -3e7; and where it sums them, the dQ kernel
# takes Delta from its own P (_own_delta: rowsum(O dO) is off by the rounding of P before P V, 8
# bits in bf16) and sums dS x in fp32 rather than from its 16-bit dS product.
if triton is not None:
    # Triton's interpreter multiplies bfloat16 blocks as their raw uint16 storage; there (only)
    # tl.dot gets its bf16 operands upcast to fp32, which is exact, so the CPU tests still see bf16
    # rounding of P and dS.
    _INTERPRET_BF16_UPCAST = tl.constexpr(interpreting())
    _LN2 = tl.constexpr(0.6931471805599453)
    _LOG2E = tl.constexpr(1.4426950408889634)
    _COPIES = tl.constexpr(TABLE_COPIES)

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
    def _table_tile(table, table_stride, row0, col0, row_off, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
        """A (ROWS, COLS) tile of a table by distance: entry (row, c) is t[(col0 + c) - (row0 +
        row)], read from the table's shifted copies (copy k at table + k * table_stride holds
        t[y - k] at y): row `row` reads copy row % 4 at a multiple of 4 from col0 - row0, so its
        COLS entries are one aligned run (a vector load). row_off (ROWS, 1) or 0, a multiple of
        table_stride, moves a row to another set of copies."""
        row = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, COLS)[None, :]
        copy = (row % _COPIES) * table_stride + row_off
        ptrs = table + copy + (col0 - row0) - (row // _COPIES) * _COPIES + c
        return tl.load(ptrs)

    @triton.jit
    def _tile_scores(qk, lp, qpos, kpos, doc, row_qk_scale, MASKED: tl.constexpr,
                     HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr):
        """A tile's scores in base 2 from its raw q.k products and its log-prior tile lp (base 2),
        as every kernel computes them: one fma, row_qk_scale = softmax_scale log2(e) r per row
        (r = 1 where the row scale multiplies the prior too: SCALE_PRIOR), then -inf where hidden
        (doc: the rows' doc_start). qpos, kpos, doc and row_qk_scale broadcast against qk (dK/dV
        passes them transposed)."""
        if HAS_PRIOR:
            s = tl.fma(qk, row_qk_scale, lp)
        else:
            s = qk * row_qk_scale

        if MASKED:
            visible = kpos <= qpos
            if HAS_DOC:
                visible = visible & (kpos >= doc)
            s = tl.where(visible, s, float("-inf"))
        return s

    @triton.jit
    def _row_lse(LSE, bh, offs_m, row_ok, Tq, SCALE_PRIOR: tl.constexpr):
        """The forward's LSE of a block of rows, as (hi, lo): hi = LSE and lo = 0, or with
        SCALE_PRIOR the reference hi = |r| max_j sign(r) t and lo = log2 sum_j exp2(r t - hi) kept
        apart, since rounding hi + lo to fp32 would lose up to half an ulp of hi from every P of the
        row (+inf and 0 for padded rows, whose P is then 0)."""
        if SCALE_PRIOR:
            hi = tl.load(LSE + bh * 2 * Tq + offs_m, mask=row_ok, other=float("inf"))
            lo = tl.load(LSE + bh * 2 * Tq + Tq + offs_m, mask=row_ok, other=0.0)
        else:
            hi = tl.load(LSE + bh * Tq + offs_m, mask=row_ok, other=float("inf"))
            lo = tl.zeros_like(hi)  # unused
        return hi, lo

    @triton.jit
    def _fused_exponent(t, row_scale, ref, MASKED: tl.constexpr):
        """SCALE_PRIOR's exponent of P in base 2: r t - ref in one fma, -inf where hidden
        (t = -inf), which the fma would make NaN where r = 0."""
        x = tl.fma(t, row_scale, -ref)
        if MASKED:
            x = tl.where(t == float("-inf"), float("-inf"), x)
        return x

    @triton.jit
    def _tile_probs(qk, lp, qpos, kpos, doc, row_qk_scale, row_scale, hi, lo, qk_scale,
                    MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
                    SCALE_PRIOR: tl.constexpr):
        """The backward's P of a tile, exactly as the forward took it: exp2(s - LSE), or with
        SCALE_PRIOR exp2(fma(t, r, -hi) - lo), t = fma(qk, qk_scale, lp); the forward's fma of
        sign(r) t and |r| is bit for bit the same product."""
        if SCALE_PRIOR:
            t = _tile_scores(qk, lp, qpos, kpos, doc, qk_scale, MASKED, HAS_DOC, HAS_PRIOR)
            return tl.exp2(_fused_exponent(t, row_scale, hi, MASKED) - lo)
        s = _tile_scores(qk, lp, qpos, kpos, doc, row_qk_scale, MASKED, HAS_DOC, HAS_PRIOR)
        return tl.exp2(s - hi)

    @triton.jit
    def _program_ids(H):
        """(block index, batch * head index, batch, head) of this program; bh, b and h are 64-bit
        so that base offsets such as b * stride_b and bh * Tq do not overflow (B * H * T * D may
        exceed 2^31)."""
        pid = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        return pid, bh, bh // H, bh % H

    @triton.jit
    def _tile_ptrs(base, row0, ROWS: tl.constexpr, row_stride, offs_d, d_stride,
                   TRANSPOSED: tl.constexpr):
        """Pointers to rows row0 .. row0 + ROWS - 1 of a (T, D) matrix at base, as a (ROWS, D)
        tile, or TRANSPOSED (D, ROWS). The first row's offset is 64-bit, since row0 * row_stride
        passes 2^31 at long contexts (500K tokens at a row stride of 3 n_embd = 6144); the offsets
        within the tile stay 32-bit."""
        base = base + row0.to(tl.int64) * row_stride
        rows = tl.arange(0, ROWS)
        if TRANSPOSED:
            ptrs = base + rows[None, :] * row_stride + offs_d[:, None] * d_stride
        else:  # (one return: the compiler types every return of a function alike)
            ptrs = base + rows[:, None] * row_stride + offs_d[None, :] * d_stride
        return ptrs

    @triton.jit
    def _row_state(DOC_ptr, ROW_SCALE_ptr, srt, offs_m, qpos, row_ok, softmax_scale,
                   HAS_DOC: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
        """A block of query rows' doc_start (0 without documents), row scale r (1 without SSMax) and
        per-row qk scale row_qk_scale = softmax_scale log2(e) r. DOC_ptr points at this batch's
        doc_start, ROW_SCALE_ptr at this (batch, head)'s row_scale."""
        if HAS_DOC:
            doc = tl.load(DOC_ptr + qpos, mask=row_ok, other=0)
        else:
            doc = tl.zeros([BLOCK_M], dtype=tl.int32)

        if HAS_ROW_SCALE:
            row_scale = tl.load(ROW_SCALE_ptr + offs_m * srt, mask=row_ok, other=0.0)
        else:
            row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        qk_scale = softmax_scale * _LOG2E
        return doc, row_scale, row_scale * qk_scale

    @triton.jit
    def _stage_blocks(stage: tl.constexpr, start, clean_start, clean_end, end):
        """The blocks [lo, hi) of a stage: 0 the unmasked ones, 1 and 2 the masked ones before and
        after."""
        if stage == 0:
            return clean_start, clean_end
        elif stage == 1:
            return start, clean_start
        else:
            return clean_end, end

    @triton.jit
    def _key_block_ranges(pid_m, row_ok, doc, q_offset, Tq, Tk,
                          HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Key blocks of query block pid_m (forward and dQ): [start, end) holds every visible key;
        blocks in [clean_start, clean_end) need no mask, those before hold document starts, those
        after the diagonal."""
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

        clean_end = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_start = tl.minimum(tl.maximum(doc_clean, start), clean_end)
        return start, clean_start, clean_end, end

    # -------------------------------------------------------------------------------------- forward
    @triton.jit
    def _fwd_stage(acc, row_sum, row_max, row_ref, q, K_ptr, V_ptr, skt, skd, svt, svd,
                   offs_d, d_ok, row0, qpos, doc, row_qk_scale, row_scale, table, table_stride,
                   row_off, Tk, blk_lo, blk_hi, MASKED: tl.constexpr, HAS_DOC: tl.constexpr,
                   HAS_PRIOR: tl.constexpr, SCALE_PRIOR: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
        """The online softmax over key blocks [blk_lo, blk_hi). row_max: the rows' running max of
        the scores (of t with SCALE_PRIOR); row_ref: what p was taken relative to so far (-inf while
        nothing is visible). With SCALE_PRIOR, row_qk_scale, row_scale and row_off are _attn_fwd's
        sign-folded ones."""
        for blk in range(blk_lo, blk_hi):
            n0 = blk * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < Tk
            kT = tl.load(_tile_ptrs(K_ptr, n0, BLOCK_N, skt, offs_d, skd, True),
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            lp = 0.0
            if HAS_PRIOR:
                lp = _table_tile(table, table_stride, row0, n0, row_off, BLOCK_M, BLOCK_N)

            qk = _dot(q, kT, None, DOT_PREC)
            s = _tile_scores(qk, lp, qpos[:, None], offs_n[None, :], doc[:, None],
                             row_qk_scale[:, None], MASKED, HAS_DOC, HAS_PRIOR)

            # a row with nothing visible yet has max -inf: subtract 0 instead (no -inf - -inf)
            new_max = tl.maximum(row_max, tl.max(s, 1))
            if SCALE_PRIOR:  # s holds t = l + lp, the score is |r| t
                ref = tl.where(new_max == float("-inf"), 0.0, new_max * row_scale)
                x = _fused_exponent(s, row_scale[:, None], ref[:, None], MASKED)
            else:
                ref = tl.where(new_max == float("-inf"), 0.0, new_max)
                x = s - ref[:, None]
            p = tl.exp2(x)
            alpha = tl.exp2(row_ref - ref)
            row_sum = row_sum * alpha + tl.sum(p, 1)

            v = tl.load(_tile_ptrs(V_ptr, n0, BLOCK_N, svt, offs_d, svd, False),
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
            row_max = new_max
            row_ref = tl.where(new_max == float("-inf"), float("-inf"), ref)
        return acc, row_sum, row_max, row_ref

    @triton.jit
    def _attn_fwd(Q, K, V, OUT, LSE, DOC, ROW_SCALE, TABLE,
                  sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
                  sdocb, srb, srh, srt,
                  H, Tq, Tk, q_offset, softmax_scale, table_stride,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
                  HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                  DOT_PREC: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        row0 = pid_m * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Tq
        qpos = q_offset + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM  # head dims that are not a power of two are padded with zeros
        q = tl.load(_tile_ptrs(Q + b * sqb + h * sqh, row0, BLOCK_M, sqt, offs_d, sqd, False),
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + h * svh
        DOC_ptr = DOC + b * sdocb
        ROW_SCALE_ptr = ROW_SCALE + b * srb + h * srh
        doc, row_scale, row_qk_scale = _row_state(DOC_ptr, ROW_SCALE_ptr, srt, offs_m, qpos, row_ok,
                                                  softmax_scale, HAS_DOC, HAS_ROW_SCALE, BLOCK_M)
        # this head's prior table (unused without a prior)
        head_tables = _COPIES * table_stride
        row_off = 0
        if SCALE_PRIOR:
            # score r t = |r| (sign(r) t): the row max is taken of sign(r) t, whose lp a row with
            # r < 0 reads from the negated table's copies, stored after the table's
            head_tables = 2 * head_tables
            negative = row_scale < 0.0
            row_off = tl.where(negative, _COPIES * table_stride, 0)[:, None]
            row_qk_scale = tl.where(negative, -softmax_scale * _LOG2E, softmax_scale * _LOG2E)
            row_scale = tl.abs(row_scale)
        table = TABLE + h * head_tables
        start, clean_start, clean_end, end = _key_block_ranges(pid_m, row_ok, doc, q_offset, Tq, Tk,
                                                               HAS_DOC, BLOCK_M, BLOCK_N)

        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_ref = row_max
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            acc, row_sum, row_max, row_ref = _fwd_stage(
                acc, row_sum, row_max, row_ref, q, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok,
                row0, qpos, doc, row_qk_scale, row_scale, table, table_stride, row_off, Tk, blk_lo,
                blk_hi, stage > 0, HAS_DOC, HAS_PRIOR, SCALE_PRIOR, BLOCK_M, BLOCK_N, DOT_PREC)

        # rows with no visible key give 0 and LSE = +inf (so that the backward's P is exactly 0)
        has_mass = row_sum > 0.0
        safe_sum = tl.where(has_mass, row_sum, 1.0)
        o = acc / safe_sum[:, None]
        finite_ref = tl.where(row_ref == float("-inf"), 0.0, row_ref)
        if SCALE_PRIOR:  # the reference and log2 of the sum apart (see _row_lse)
            tl.store(LSE + bh * 2 * Tq + offs_m, tl.where(has_mass, finite_ref, float("inf")),
                     mask=row_ok)
            tl.store(LSE + bh * 2 * Tq + Tq + offs_m, tl.log2(safe_sum), mask=row_ok)
        else:
            lse = tl.where(has_mass, finite_ref + tl.log2(safe_sum), float("inf"))
            tl.store(LSE + bh * Tq + offs_m, lse, mask=row_ok)
        tl.store(_tile_ptrs(OUT + b * sob + h * soh, row0, BLOCK_M, sot, offs_d, sod, False),
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    # ------------------------------------------------------------------------------------- backward
    @triton.jit
    def _attn_bwd_preprocess(OUT, DO, DELTA, sob, soh, sot, sod, sdob, sdoh, sdot, sdod, H, Tq,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        row0 = pid_m * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]
        o = tl.load(_tile_ptrs(OUT + b * sob + h * soh, row0, BLOCK_M, sot, offs_d, sod, False),
                    mask=mask, other=0.0)
        do = tl.load(_tile_ptrs(DO + b * sdob + h * sdoh, row0, BLOCK_M, sdot, offs_d, sdod, False),
                     mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * Tq + offs_m, delta, mask=offs_m < Tq)

    @triton.jit
    def _dkdv_stage(dk, dv, k, v, Q_ptr, DO_ptr, LSE, bh, DELTA_ptr, DOC_ptr, ROW_SCALE_ptr,
                    sqt, sqd, sdot, sdod, srt, n0, offs_n, offs_d, d_ok, table_rev, table_stride,
                    softmax_scale, Tq, q_offset, blk_lo, blk_hi,
                    MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
                    HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
        for blk in range(blk_lo, blk_hi):
            m0 = blk * BLOCK_M
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Tq
            qpos = q_offset + offs_m
            qT = tl.load(_tile_ptrs(Q_ptr, m0, BLOCK_M, sqt, offs_d, sqd, True),
                         mask=d_ok[:, None] & row_ok[None, :], other=0.0)
            # padded query rows: LSE = +inf makes P = 0, and dO = 0, so they add nothing
            hi, lo = _row_lse(LSE, bh, offs_m, row_ok, Tq, SCALE_PRIOR)
            delta = tl.load(DELTA_ptr + offs_m, mask=row_ok, other=0.0)
            # doc_start is only needed (and loaded) for the masked tiles
            doc, row_scale, row_qk_scale = _row_state(DOC_ptr, ROW_SCALE_ptr, srt, offs_m, qpos,
                                                      row_ok, softmax_scale, MASKED and HAS_DOC,
                                                      HAS_ROW_SCALE, BLOCK_M)
            lpT = 0.0
            if HAS_PRIOR:  # the transposed tile: entry (key, query) from the reversed table
                lpT = _table_tile(table_rev, table_stride, n0, m0, 0, BLOCK_N, BLOCK_M)

            qkT = _dot(k, qT, None, DOT_PREC)  # (BLOCK_N, BLOCK_M): keys x queries
            pT = _tile_probs(qkT, lpT, qpos[None, :], offs_n[:, None], doc[None, :],
                             row_qk_scale[None, :], row_scale[None, :], hi[None, :], lo[None, :],
                             softmax_scale * _LOG2E, MASKED, HAS_DOC, HAS_PRIOR, SCALE_PRIOR)

            do = tl.load(_tile_ptrs(DO_ptr, m0, BLOCK_M, sdot, offs_d, sdod, False),
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PREC)
            dpT = _dot(v, tl.trans(do), None, DOT_PREC)
            if HAS_ROW_SCALE:  # the gradient of l: dS r = P (dP r - Delta r)
                dscoreT = pT * tl.fma(dpT, row_scale[None, :], -(delta * row_scale)[None, :])
            else:
                dscoreT = pT * (dpT - delta[None, :])
            dk = _dot(dscoreT.to(qT.dtype), tl.trans(qT), dk, DOT_PREC)
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, DOC, ROW_SCALE, TABLE_REV, QEND, QCLEAN,
                       sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                       sdob, sdoh, sdot, sdod,
                       sdkb, sdkh, sdkt, sdkd, sdvb, sdvh, sdvt, sdvd, sdocb, srb, srh, srt,
                       H, Tq, Tk, q_offset, softmax_scale, table_stride, n_kblocks,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
                       HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                       DOT_PREC: tl.constexpr):
        pid_n, bh, b, h = _program_ids(H)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < Tk
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(_tile_ptrs(K + b * skb + h * skh, n0, BLOCK_N, skt, offs_d, skd, False),
                    mask=kv_mask, other=0.0)
        v = tl.load(_tile_ptrs(V + b * svb + h * svh, n0, BLOCK_N, svt, offs_d, svd, False),
                    mask=kv_mask, other=0.0)
        # this head's reversed prior table, if any
        table_rev = TABLE_REV + h * (_COPIES * table_stride)

        # the query blocks that see this key block: [start, end), from the first query at or after
        # n0 to the last block whose earliest document start is <= the block's last key (_kv_ranges)
        n_qblocks = (Tq + BLOCK_M - 1) // BLOCK_M
        if HAS_DOC:
            end = tl.load(QEND + b * n_kblocks + pid_n)
            doc_clean = tl.load(QCLEAN + b * n_kblocks + pid_n)  # before it: every doc_start <= n0
        else:
            end = n_qblocks
            doc_clean = n_qblocks
        start = tl.minimum(tl.maximum(n0 - q_offset, 0) // BLOCK_M, end)
        # the first query block whose first query is at or after the block's last key (a ragged last
        # key block is thus always masked, where keys >= Tk are masked as being after every query)
        causal_clean = (tl.maximum(n0 + BLOCK_N - 1 - q_offset, 0) + BLOCK_M - 1) // BLOCK_M
        clean_start = tl.minimum(tl.maximum(causal_clean, start), end)
        clean_end = tl.minimum(tl.maximum(doc_clean, clean_start), end)

        Q_ptr = Q + b * sqb + h * sqh
        DO_ptr = DO + b * sdob + h * sdoh
        DELTA_ptr = DELTA + bh * Tq
        DOC_ptr = DOC + b * sdocb
        ROW_SCALE_ptr = ROW_SCALE + b * srb + h * srh
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            dk, dv = _dkdv_stage(
                dk, dv, k, v, Q_ptr, DO_ptr, LSE, bh, DELTA_ptr, DOC_ptr, ROW_SCALE_ptr,
                sqt, sqd, sdot, sdod, srt, n0, offs_n, offs_d, d_ok, table_rev, table_stride,
                softmax_scale, Tq, q_offset, blk_lo, blk_hi,
                stage > 0, HAS_DOC, HAS_PRIOR, HAS_ROW_SCALE, SCALE_PRIOR, BLOCK_M, BLOCK_N,
                DOT_PREC)

        tl.store(_tile_ptrs(DK + b * sdkb + h * sdkh, n0, BLOCK_N, sdkt, offs_d, sdkd, False),
                 (dk * softmax_scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(_tile_ptrs(DV + b * sdvb + h * sdvh, n0, BLOCK_N, sdvt, offs_d, sdvd, False),
                 dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _diagonal_sums(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A (BLOCK_M, BLOCK_N) tile (BLOCK_M a multiple of BLOCK_N) as BLOCK_M / BLOCK_N square
        blocks of rows, each summed along its diagonals: entry (q, u) sums x[q BLOCK_N + r, c] over
        c - r = u - (BLOCK_N - 1), for u < 2 BLOCK_N - 1 (0 at u = 2 BLOCK_N - 1). Row r of a
        block is gathered shifted by r, so that each diagonal becomes a column."""
        N_SUB: tl.constexpr = BLOCK_M // BLOCK_N
        blocks = tl.reshape(x, (N_SUB, BLOCK_N, BLOCK_N))
        u = tl.arange(0, 2 * BLOCK_N)[None, None, :]
        col = u - (BLOCK_N - 1) + tl.arange(0, BLOCK_N)[None, :, None]
        col = tl.broadcast_to(col, (N_SUB, BLOCK_N, 2 * BLOCK_N))
        inside = (col >= 0) & (col < BLOCK_N)
        skewed = tl.gather(blocks, tl.where(inside, col, 0), 2)
        return tl.sum(tl.where(inside, skewed, 0.0), 1)

    @triton.jit
    def _key_tiles(K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, n0, Tk, table, table_stride,
                   row0, HAS_PRIOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """What dQ reads of key block n0: its positions, K^T and V^T tiles, and the prior's tile."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = offs_n < Tk
        kT = tl.load(_tile_ptrs(K_ptr, n0, BLOCK_N, skt, offs_d, skd, True),
                     mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
        vT = tl.load(_tile_ptrs(V_ptr, n0, BLOCK_N, svt, offs_d, svd, True),
                     mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
        lp = 0.0
        if HAS_PRIOR:
            lp = _table_tile(table, table_stride, row0, n0, 0, BLOCK_M, BLOCK_N)
        return offs_n, kT, vT, lp

    @triton.jit
    def _delta_stage(delta_acc, q, do, hi, lo, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok,
                     row0, qpos, doc, row_qk_scale, row_scale, qk_scale, table, table_stride, Tk,
                     blk_lo, blk_hi, MASKED: tl.constexpr, HAS_DOC: tl.constexpr,
                     HAS_PRIOR: tl.constexpr, SCALE_PRIOR: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr,
                     DOT_PREC: tl.constexpr):
        """OWN_DELTA's pass over key blocks [blk_lo, blk_hi): delta_acc += P dP per score, P this
        kernel's own (see _own_delta)."""
        for blk in range(blk_lo, blk_hi):
            n0 = blk * BLOCK_N
            offs_n, kT, vT, lp = _key_tiles(K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, n0,
                                            Tk, table, table_stride, row0, HAS_PRIOR, BLOCK_M,
                                            BLOCK_N)
            qk = _dot(q, kT, None, DOT_PREC)
            p = _tile_probs(qk, lp, qpos[:, None], offs_n[None, :], doc[:, None],
                            row_qk_scale[:, None], row_scale[:, None], hi[:, None], lo[:, None],
                            qk_scale, MASKED, HAS_DOC, HAS_PRIOR, SCALE_PRIOR)
            delta_acc += p * _dot(do, vT, None, DOT_PREC)
        return delta_acc

    # The dQ kernel's sums over a row's visible keys j, kept per score (2-D, reduced once after the
    # loop, so that the loop does no cross-lane reductions): dx_acc = dS x (d row_scale, x = l + lp
    # with scale_prior, else l: in fp32, not from dQ's product, whose dS is rounded to 16 bits for
    # the tensor cores and whose row sums would cancel to that rounding), and dj_acc, a tuple of K,
    # whose entry k holds dS J_k (prior parameter k). With BY_DIAGONAL (many parameters: T5's
    # buckets) the prior's gradient is summed per tile instead: the tile's w dS summed along its
    # diagonals (d is constant on each), times each derivative table's entries there, into g_acc
    # (K_POW2,): 2 BLOCK loads per table and tile, not one per score, and no accumulator per table.
    @triton.jit
    def _dq_stage(dq, dx_acc, dj_acc, g_acc, w, q, do, hi, lo, delta, K_ptr, V_ptr, skt, skd,
                  svt, svd, offs_d, d_ok, row0, qpos, doc, row_qk_scale, row_scale, qk_scale, table,
                  dtable, table_stride, Tk, blk_lo, blk_hi, MASKED: tl.constexpr,
                  HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                  N_GRAD: tl.constexpr, NEED_ROW_SCALE_GRAD: tl.constexpr,
                  BY_DIAGONAL: tl.constexpr, K_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
        for blk in tl.range(blk_lo, blk_hi, num_stages=STAGES):  # pipelines the tables' loads too
            n0 = blk * BLOCK_N
            offs_n, kT, vT, lp = _key_tiles(K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, n0,
                                            Tk, table, table_stride, row0, HAS_PRIOR, BLOCK_M,
                                            BLOCK_N)
            # the derivative tables' tiles
            dtiles = ()
            if not BY_DIAGONAL:
                for i in tl.static_range(N_GRAD):
                    dtiles = dtiles + (_table_tile(dtable + i * (_COPIES * table_stride),
                                                   table_stride, row0, n0, 0, BLOCK_M, BLOCK_N),)

            qk = _dot(q, kT, None, DOT_PREC)
            p = _tile_probs(qk, lp, qpos[:, None], offs_n[None, :], doc[:, None],
                            row_qk_scale[:, None], row_scale[:, None], hi[:, None], lo[:, None],
                            qk_scale, MASKED, HAS_DOC, HAS_PRIOR, SCALE_PRIOR)
            dp = _dot(do, vT, None, DOT_PREC)
            dscore = p * (dp - delta[:, None])
            dq = _dot(dscore.to(kT.dtype), tl.trans(kT), dq, DOT_PREC)  # sum_j dS k_j; r at the end

            if NEED_ROW_SCALE_GRAD:
                x = qk * (qk_scale * _LN2)  # l; the tile lp is in base 2
                if SCALE_PRIOR:
                    x = x + lp * _LN2
                dx_acc += dscore * x
            if BY_DIAGONAL:
                diag = _diagonal_sums(dscore * w[:, None], BLOCK_M, BLOCK_N)  # (N_SUB, 2 BLOCK_N)
                u = tl.arange(0, 2 * BLOCK_N)[None, :]
                first_row = row0 + tl.arange(0, BLOCK_M // BLOCK_N)[:, None] * BLOCK_N
                x = n0 - first_row - (BLOCK_N - 1) + u  # the tables' index of each diagonal
                kk = tl.arange(0, K_POW2)[:, None, None]
                rows = tl.load(dtable + kk * (_COPIES * table_stride) + x[None, :, :],
                               mask=(kk < N_GRAD) & (u[None, :, :] < 2 * BLOCK_N - 1), other=0.0)
                g_acc += tl.sum(tl.sum(rows * diag[None, :, :], 2), 1)
            else:
                summed = ()
                for i in tl.static_range(N_GRAD):
                    summed = summed + (dj_acc[i] + dscore * dtiles[i],)
                dj_acc = summed
        return dq, dx_acc, dj_acc, g_acc

    @triton.jit
    def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, DOC, ROW_SCALE, TABLE, DTABLE, DROW_SCALE, PART,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                     sdob, sdoh, sdot, sdod,
                     sdqb, sdqh, sdqt, sdqd, sdocb, srb, srh, srt,
                     H, Tq, Tk, q_offset, softmax_scale, table_stride, n_qblocks,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr,
                     HAS_ROW_SCALE: tl.constexpr, SCALE_PRIOR: tl.constexpr,
                     N_GRAD: tl.constexpr, NEED_ROW_SCALE_GRAD: tl.constexpr,
                     BY_DIAGONAL: tl.constexpr, K_POW2: tl.constexpr, OWN_DELTA: tl.constexpr,
                     DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
        pid_m, bh, b, h = _program_ids(H)
        row0 = pid_m * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Tq
        qpos = q_offset + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        qd_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(_tile_ptrs(Q + b * sqb + h * sqh, row0, BLOCK_M, sqt, offs_d, sqd, False),
                    mask=qd_mask, other=0.0)
        do = tl.load(_tile_ptrs(DO + b * sdob + h * sdoh, row0, BLOCK_M, sdot, offs_d, sdod, False),
                     mask=qd_mask, other=0.0)
        hi, lo = _row_lse(LSE, bh, offs_m, row_ok, Tq, SCALE_PRIOR)
        DOC_ptr = DOC + b * sdocb
        ROW_SCALE_ptr = ROW_SCALE + b * srb + h * srh
        doc, row_scale, row_qk_scale = _row_state(DOC_ptr, ROW_SCALE_ptr, srt, offs_m, qpos, row_ok,
                                                  softmax_scale, HAS_DOC, HAS_ROW_SCALE, BLOCK_M)
        # this head's prior table (unused without a prior), and its derivative tables, if any
        table = TABLE + h * (_COPIES * table_stride)
        dtable = DTABLE + h * (N_GRAD * _COPIES * table_stride)
        start, clean_start, clean_end, end = _key_block_ranges(pid_m, row_ok, doc, q_offset, Tq, Tk,
                                                               HAS_DOC, BLOCK_M, BLOCK_N)
        K_ptr = K + b * skb + h * skh
        V_ptr = V + b * svb + h * svh
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

        if OWN_DELTA:  # Delta_i = sum_j P_ij dP_ij from this kernel's P, not the forward's O
            delta_acc = zero
            for stage in tl.static_range(3):
                blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
                delta_acc = _delta_stage(
                    delta_acc, q, do, hi, lo, K_ptr, V_ptr, skt, skd, svt, svd, offs_d, d_ok, row0,
                    qpos, doc, row_qk_scale, row_scale, softmax_scale * _LOG2E, table, table_stride,
                    Tk, blk_lo, blk_hi, stage > 0, HAS_DOC, HAS_PRIOR, SCALE_PRIOR, BLOCK_M,
                    BLOCK_N, DOT_PREC)
            delta = tl.sum(delta_acc, 1)
        else:
            delta = tl.load(DELTA + bh * Tq + offs_m, mask=row_ok, other=0.0)

        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dx_acc = zero
        dj_acc = ()
        if not BY_DIAGONAL:
            for i in tl.static_range(N_GRAD):
                dj_acc = dj_acc + (zero,)
        g_acc = tl.zeros([K_POW2], dtype=tl.float32)
        # a row with one visible key has P = 1 whatever its scores: its gradients are exactly 0
        multi = tl.where(row_ok & (qpos > doc), 1.0, 0.0)
        w = multi
        # d lp = dS r
        if SCALE_PRIOR:
            w = w * row_scale
        for stage in tl.static_range(3):
            blk_lo, blk_hi = _stage_blocks(stage, start, clean_start, clean_end, end)
            dq, dx_acc, dj_acc, g_acc = _dq_stage(
                dq, dx_acc, dj_acc, g_acc, w, q, do, hi, lo, delta, K_ptr, V_ptr, skt, skd, svt,
                svd, offs_d, d_ok, row0, qpos, doc, row_qk_scale, row_scale, softmax_scale * _LOG2E,
                table, dtable, table_stride, Tk, blk_lo, blk_hi, stage > 0, HAS_DOC, HAS_PRIOR,
                SCALE_PRIOR, N_GRAD, NEED_ROW_SCALE_GRAD,
                BY_DIAGONAL, K_POW2, BLOCK_M, BLOCK_N, DOT_PREC, STAGES)

        tl.store(_tile_ptrs(DQ + b * sdqb + h * sdqh, row0, BLOCK_M, sdqt, offs_d, sdqd, False),
                 (dq * (softmax_scale * row_scale * multi)[:, None]).to(DQ.dtype.element_ty),
                 mask=qd_mask)
        if NEED_ROW_SCALE_GRAD:
            tl.store(DROW_SCALE + bh * Tq + offs_m, tl.sum(dx_acc, 1) * multi, mask=row_ok)
        part = PART + (bh * n_qblocks + pid_m) * N_GRAD
        if BY_DIAGONAL:
            kk = tl.arange(0, K_POW2)
            tl.store(part + kk, g_acc, mask=kk < N_GRAD)
        else:
            for i in tl.static_range(N_GRAD):
                tl.store(part + i, tl.sum(w * tl.sum(dj_acc[i], 1), 0))
    # fmt: on


# --------------------------------------------------------------------------------------------------
# Launch configuration, the prior's tables, and the custom ops
# --------------------------------------------------------------------------------------------------
# Fixed tiles per (head_dim, dtype) rather than triton.autotune: the backward's tile-skipping
# tables depend on the block sizes, and under the interpreter autotuning would multiply test time.
# Under the interpreter every kernel takes INTERPRET_BLOCKS (small tiles: more of them per test);
# tests set it to None to run the GPU's own tiles, so that every configuration below is executed,
# and to smaller tiles where a few tokens must span several.
INTERPRET_BLOCKS = (32, 32)


def _configs(block_d, dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dK/dV and dQ kernels. Chosen so
    that the sm_90 builds (ptxas, all prior/SSMax/document flags on) spill no or almost no
    registers; not tuned on hardware."""
    if interpreting() and INTERPRET_BLOCKS is not None:
        bm, bn = INTERPRET_BLOCKS
        return dict(fwd=(bm, bn, 4, 1), dkdv=(bm, bn, 4, 1), dq=(bm, bn, 4, 1), pre=bm)

    # fp32: ieee dots run on FMA units, the exact path for gradient checks, not for speed
    if dtype == torch.float32:
        if block_d <= 64:
            return dict(fwd=(64, 32, 8, 2), dkdv=(32, 64, 8, 2), dq=(64, 32, 8, 2), pre=64)
        return dict(fwd=(32, 32, 4, 2), dkdv=(16, 32, 4, 2), dq=(32, 16, 4, 2), pre=64)

    if block_d <= 64:
        return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 3), dq=(128, 32, 8, 2), pre=128)
    # dK/dV: 64 keys per warpgroup, or Hopper's wgmma is not used (mma.sync from ldmatrix instead:
    # the performance model's shared-memory bandwidth bound, dev/README.md)
    return dict(fwd=(128, 32, 8, 2), dkdv=(32, 64, 4, 2), dq=(64, 16, 8, 2), pre=128)


def check_length(head_dim, dtype):
    """The length of attention.check_kernel's problem: two full tiles of every kernel's
    configuration and a ragged third, so that it runs unmasked, diagonal and ragged tiles."""
    cfg = _configs(_block_d(head_dim), dtype)
    largest = max(max(cfg[kernel][:2]) for kernel in ("fwd", "dkdv", "dq"))
    return 2 * largest + largest // 2 + 3


def _dq_stages(cfg, n_grad):
    """Pipeline stages of the dQ loop. tl.range pipelines all its loads, the prior's 1 + K table
    tiles too (the kernel argument num_stages only those that feed a dot); beyond 96 KB of table
    tiles per extra stage they would not fit beside K and V on an A100, and stay unpipelined."""
    bm, bn, _, stages = cfg["dq"]

    tiles = 1 if _grad_path(n_grad)["BY_DIAGONAL"] else 1 + n_grad
    return stages if tiles * bm * bn * 4 * (stages - 1) <= 96 * 1024 else 1


# From this many derivative tables on, dQ sums the prior's gradient per tile diagonal (see
# _dq_stage). dev/perf_model.py, sm_90, D = 64, backward vs no prior, per score / per diagonal:
# K = 2 (ggd_ssmax) 0.50 / 0.43, K = 3 (ggd_mu) 0.48 / 0.45, K = 24 (mlp) 0.04 / 0.27, K = 32
# (t5_bucket) 0.03 / 0.27.
DIAGONAL_FROM = 4


def _grad_path(n_grad):
    """The dQ kernel's flags for K derivative tables: BY_DIAGONAL, and K_POW2 (its accumulator)."""
    return dict(BY_DIAGONAL=n_grad >= DIAGONAL_FROM, K_POW2=max(2, triton.next_power_of_2(n_grad)))


def _own_delta(n_grad, need_row_scale_grad):
    """Whether dQ recomputes Delta from its own P (one more pass over the row's keys: two of its
    three products) rather than reading rowsum(O * dO): whenever it sums d theta or d row_scale.
    Those sum dS times the prior's tables (or the scores) over every score, and every row's dS sums
    to its error in Delta instead of 0, so these errors add up, times the tables' size. With 16-bit
    inputs rowsum(O * dO) is off by the rounding of P before P V (8 bits in bf16): on
    attention.check_kernel's bf16 problems the gradients were off by up to 40 %, and are within
    1e-4 with it. In fp32, O's rounding times a floored table (1e4) reached 2e-4. dQ, dK and dV are
    not sums over rows, and dK/dV keeps rowsum(O * dO)."""
    return n_grad > 0 or need_row_scale_grad


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def _prior_tables(prior, H, Tq, Tk, q_offset, cfg, device):
    """The prior by distance for the kernels, which never evaluate a formula: (table, dtable, theta,
    table_start). The kernels index a table by x = j - (i - q_offset) = d + q_offset, the key's
    position minus the query's row: table (H, n) fp32 holds lp(d) at x = table_start + t, for every
    x a tile touches (padded rows and keys included; table_start and table_start + n - 1 multiples
    of 16). dtable (H, K, n): the derivative tables d lp / d theta_k in the K directions of
    _parameter_directions; theta (H, K) the parameters' entries along them: the ops never read its
    values, they return its gradient sum_ij w dS J_k and autograd takes it on to the parameters
    (None, None when K = 0). The derivatives are forward-mode autograd, here because the ops run
    below the autograd key, where forward-mode AD is not allowed. d > 0 is never visible: 0 there,
    so that a prior undefined there (inf, NaN) cannot reach a gradient sum as 0 * inf."""
    pad = max(max(c[:2]) for c in (cfg["fwd"], cfg["dkdv"], cfg["dq"]))
    table_start = -_round_up(Tq + pad, 16)
    table_stop = _round_up(Tk + pad, 16)
    d = torch.arange(table_start, table_stop + 1, device=device) - q_offset
    future = d > 0
    params = tuple(t.detach() for t in prior.params)

    # the registry's table (with its floor), one row per head
    def table_of(*values):
        return BoundPrior(prior.family, values).table(d).float().expand(H, -1)

    table = table_of(*params).masked_fill(future, 0.0).contiguous()
    tangents, columns = _parameter_directions(prior, H)
    if not columns:
        return table, None, None, table_start

    jvps = [torch.func.jvp(table_of, params, tangent)[1] for tangent in tangents]
    dtable = torch.stack(jvps, 1).masked_fill(future, 0.0).contiguous()
    theta = torch.stack(columns, 1)
    return table, dtable, theta, table_start


def _parameter_directions(prior, H):
    """The K scalar directions in which the kernels sum the prior's gradient, one per entry of a
    trained parameter: (tangents, columns). A per-head parameter (H, ...) has one direction per
    entry of a head's slice (its tangent: that entry set to 1 in every head, which moves head h's
    curve by head h's parameter only); a shared one (Prior.shared) one per entry, moving every
    head. columns[k] (H,) is the parameter's entry seen per head (a shared one expanded), so that
    autograd takes the ops' (H, K) gradient back to the parameters, summing a shared entry's over
    the heads. No directions without gradients."""
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


def _shifted_copies(table, table_start):
    """The kernels' layout of tables by x (entry t at x = table_start + t, table_start a multiple
    of 16): (..., 4, L) copies, copy c holding the entry of x at y = x + c, and a view of them that
    starts at y = 0 (what _table_tile reads from), with L, the copies' stride (the kernels'
    table_stride; L and the view's offset are multiples of 16)."""
    n = table.shape[-1]

    length = _round_up(n + TABLE_COPIES - 1, 16)
    copies = torch.stack([F.pad(table, (c, length - n - c)) for c in range(TABLE_COPIES)], -2)
    return copies[..., -table_start:], length


def _kv_ranges(doc_rows, block_m, block_n, Tk):
    """Per (batch, key block): (q_end, q_clean). Query blocks >= q_end see none of the key block
    (their earliest doc_start is after its last key); query blocks < q_clean have every doc_start <=
    the block's first key, so documents need no mask there. Exact for the usual non-decreasing
    doc_start, conservative otherwise."""
    batch, Tq = doc_rows.shape
    n_qb = triton.cdiv(Tq, block_m)
    pad = n_qb * block_m - Tq
    big = torch.iinfo(torch.int32).max

    rows = doc_rows.to(torch.int64)
    first = F.pad(rows, (0, pad), value=big).view(batch, n_qb, block_m).amin(-1)
    last = F.pad(rows, (0, pad), value=-1).view(batch, n_qb, block_m).amax(-1)
    # both non-decreasing
    suffix_min = first.flip(-1).cummin(-1).values.flip(-1).contiguous()
    prefix_max = last.cummax(-1).values.contiguous()

    n0 = torch.arange(0, Tk, block_n, device=doc_rows.device)
    n_last = torch.clamp(n0 + block_n, max=Tk) - 1
    q_end = torch.searchsorted(suffix_min, n_last.expand(batch, -1).contiguous(), right=True)
    q_clean = torch.searchsorted(prefix_max, n0.expand(batch, -1).contiguous(), right=True)
    return q_end.to(torch.int32).contiguous(), q_clean.to(torch.int32).contiguous()


def _strides(t):
    return tuple(t.stride())


# The kernels are registered as two PyTorch custom ops, forward and backward, with fake-tensor
# implementations (shapes only) and the autograd formula tying them together: torch.compile then
# traces a model through attention as through any other op (no graph break) and Inductor fuses the
# code around it. The ops are opaque: they run the kernels exactly as eager mode does, so compiled
# and eager results are bitwise equal.
Tensor, OptTensor = torch.Tensor, Optional[torch.Tensor]


def _block_d(head_dim):
    # head dims that are not a power of two are padded
    return max(16, triton.next_power_of_2(head_dim))


def _launch_state(q, k, doc_start, row_scale):
    """What both ops derive from their inputs: block_d, tile configuration, dot precision, doc_start
    as (batch, Tk) int32, row_scale as (batch, H, Tq) fp32, and a dummy pointer for absent
    inputs."""
    batch, H, Tq, D = q.shape
    Tk = k.shape[2]
    block_d = _block_d(D)
    # input_precision only matters for fp32 inputs
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dummy = torch.zeros(1, device=q.device, dtype=torch.float32)

    doc = None
    if doc_start is not None:
        doc = doc_start.to(device=q.device, dtype=torch.int32).contiguous().expand(batch, Tk)
    if row_scale is not None:
        row_scale = row_scale.float().expand(batch, H, Tq)
    return block_d, _configs(block_d, q.dtype), dot_prec, dummy, doc, row_scale


def _device_of(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _scales_prior(has_prior, has_row_scale, scale_prior):
    """SCALE_PRIOR: SSMax's row scale multiplies a prior, r (l + lp) taken inside the exponent's
    fma."""
    return has_prior and has_row_scale and scale_prior


def _flags(q, has_doc, has_prior, has_row_scale, scale_prior, dot_prec, block_d):
    """The compile-time flags every kernel launch shares."""
    return dict(
        HEAD_DIM=q.shape[-1],
        BLOCK_D=block_d,
        HAS_DOC=has_doc,
        HAS_PRIOR=has_prior,
        HAS_ROW_SCALE=has_row_scale,
        SCALE_PRIOR=_scales_prior(has_prior, has_row_scale, scale_prior),
        DOT_PREC=dot_prec,
        enable_fp_fusion=FP_FUSION,
    )


@torch.library.custom_op("bam::triton_attention_fwd", mutates_args=())
def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: OptTensor, table: OptTensor,
                dtable: OptTensor, theta: OptTensor, row_scale: OptTensor, scale_prior: bool,
                q_offset: int, softmax_scale: float,
                table_start: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The forward kernel: (O, LSE). LSE (batch, H, n, Tq) fp32 is the row log-sum-exp in base 2
    (the backward needs it), n = 1, or 2 with SCALE_PRIOR (_row_lse). table, dtable, theta and
    table_start as _prior_tables makes them; dtable and theta are only kept for the backward."""
    batch, H, Tq, D = q.shape
    Tk = k.shape[2]
    has_prior = table is not None
    has_doc = doc_start is not None
    has_row_scale = row_scale is not None
    scales_prior = _scales_prior(has_prior, has_row_scale, scale_prior)
    with _device_of(q):
        block_d, cfg, dot_prec, dummy, doc, row_scale = _launch_state(q, k, doc_start, row_scale)

        # the table in base 2, as the scores; with SCALE_PRIOR the negated table after it
        table_copies, table_stride = dummy, 0
        if has_prior:
            table_base2 = table * math.log2(math.e)
            if scales_prior:
                table_base2 = torch.stack([table_base2, -table_base2], 1)
            table_copies, table_stride = _shifted_copies(table_base2, table_start)

        o = torch.empty_like(q)
        lse = torch.empty((batch, H, 1 + scales_prior, Tq), device=q.device, dtype=torch.float32)
        bm, bn, warps, stages = cfg["fwd"]
        flags = _flags(q, has_doc, has_prior, has_row_scale, scale_prior, dot_prec, block_d)
        # fmt: off
        _attn_fwd[(triton.cdiv(Tq, bm), batch * H)](
            q, k, v, o, lse, doc if has_doc else dummy, row_scale if has_row_scale else dummy,
            table_copies,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            doc.stride(0) if has_doc else 0,
            *(_strides(row_scale) if has_row_scale else (0, 0, 0)),
            H, Tq, Tk, q_offset, softmax_scale, table_stride,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages, **flags)
        # fmt: on
    return o, lse


@_triton_fwd.register_fake
def _(q, k, v, doc_start, table, dtable, theta, row_scale, scale_prior, q_offset, softmax_scale,
      table_start):  # fmt: skip
    n = 1 + _scales_prior(table is not None, row_scale is not None, scale_prior)
    return torch.empty_like(q), q.new_empty((*q.shape[:2], n, q.shape[2]), dtype=torch.float32)


def _backward_tables(table, dtable, table_start, dummy):
    """The backward's tables in the kernels' layout (_shifted_copies): (table_copies,
    table_rev_copies, dtable_copies, table_stride). The prior in base 2 for dQ's tiles, reversed
    for dK/dV's transposed tiles, and the derivative tables (dQ); dummy where absent."""
    table_copies = table_rev_copies = dtable_copies = dummy
    table_stride = 0
    if table is not None:
        table_base2 = table * math.log2(math.e)
        table_copies, table_stride = _shifted_copies(table_base2, table_start)
        table_rev_start = -(table_start + table.shape[-1] - 1)
        table_rev_copies, _ = _shifted_copies(table_base2.flip(-1), table_rev_start)
    if dtable is not None:
        dtable_copies, _ = _shifted_copies(dtable, table_start)
    return table_copies, table_rev_copies, dtable_copies, table_stride


def _launch_dkdv(q, k, v, do, lse, delta, doc, row_scale, table_rev_copies, table_stride, q_offset,
                 softmax_scale, cfg, flags, dummy_i, dummy):  # fmt: skip
    """dK, dV: one program per key block, looping over the query blocks that see it."""
    batch, H, Tq, _ = q.shape
    Tk = k.shape[2]
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bm, bn, warps, stages = cfg["dkdv"]
    n_kb = triton.cdiv(Tk, bn)

    q_end, q_clean = dummy_i, dummy_i
    if doc is not None:
        q_end, q_clean = _kv_ranges(doc[:, q_offset : q_offset + Tq], bm, bn, Tk)
    # fmt: off
    _attn_bwd_dkdv[(n_kb, batch * H)](
        q, k, v, do, dk, dv, lse, delta, doc if doc is not None else dummy_i,
        row_scale if row_scale is not None else dummy, table_rev_copies, q_end, q_clean,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        doc.stride(0) if doc is not None else 0,
        *(_strides(row_scale) if row_scale is not None else (0, 0, 0)),
        H, Tq, Tk, q_offset, softmax_scale, table_stride, n_kb,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        num_stages=stages, **flags)
    # fmt: on
    return dk, dv


def _launch_dq(q, k, v, do, lse, delta, doc, row_scale, table_copies, dtable_copies, table_stride,
               n_grad, need_row_scale_grad, q_offset, softmax_scale, cfg, flags, dummy_i,
               dummy):  # fmt: skip
    """dQ, d row_scale and d theta: one program per query block, looping over its key blocks; the
    programs' partial sums of d theta reduced in a fixed order (no atomics)."""
    batch, H, Tq, _ = q.shape
    Tk = k.shape[2]
    dev = q.device
    dq = torch.empty_like(q)
    bm, bn, warps, stages = cfg["dq"]
    n_qb = triton.cdiv(Tq, bm)

    drow_scale = dummy
    if need_row_scale_grad:
        drow_scale = torch.empty((batch, H, Tq), device=dev, dtype=torch.float32)
    part = dummy
    if n_grad:
        part = torch.empty((batch, H, n_qb, n_grad), device=dev, dtype=torch.float32)
    if _grad_path(n_grad)["BY_DIAGONAL"] and bm % bn:
        raise ValueError(
            f"the gradient by diagonal needs BLOCK_M a multiple of BLOCK_N: {bm}, {bn}"
        )

    # fmt: off
    _attn_bwd_dq[(n_qb, batch * H)](
        q, k, v, do, dq, lse, delta, doc if doc is not None else dummy_i,
        row_scale if row_scale is not None else dummy, table_copies, dtable_copies, drow_scale,
        part,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        doc.stride(0) if doc is not None else 0,
        *(_strides(row_scale) if row_scale is not None else (0, 0, 0)),
        H, Tq, Tk, q_offset, softmax_scale, table_stride, n_qb,
        BLOCK_M=bm, BLOCK_N=bn, N_GRAD=n_grad,
        NEED_ROW_SCALE_GRAD=need_row_scale_grad, **_grad_path(n_grad),
        OWN_DELTA=_own_delta(n_grad, need_row_scale_grad),
        STAGES=_dq_stages(cfg, n_grad), num_warps=warps, num_stages=stages, **flags)
    # fmt: on

    g = part.double().sum(dim=(0, 2)) if n_grad else q.new_empty(0, dtype=torch.float64)
    if not need_row_scale_grad:
        drow_scale = q.new_empty(0, dtype=torch.float32)
    return dq, g, drow_scale


@torch.library.custom_op("bam::triton_attention_bwd", mutates_args=())
def _triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                doc_start: OptTensor, table: OptTensor, dtable: OptTensor, row_scale: OptTensor,
                scale_prior: bool, q_offset: int, softmax_scale: float, table_start: int,
                need_row_scale_grad: bool,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward kernels: (dQ, dK, dV, d theta (H, K) fp64 from the derivative tables dtable
    (H, K, n), d row_scale (batch, H, Tq) fp32). The last two are empty without dtable /
    need_row_scale_grad."""
    batch, H, Tq, D = q.shape
    has_prior = table is not None
    has_doc = doc_start is not None
    has_row_scale = row_scale is not None
    n_grad = dtable.shape[1] if dtable is not None else 0
    with _device_of(q):
        block_d, cfg, dot_prec, dummy, doc, row_scale = _launch_state(q, k, doc_start, row_scale)
        dummy_i = torch.zeros(1, device=q.device, dtype=torch.int32)
        do = do.contiguous() if do.stride(-1) != 1 else do
        tables = _backward_tables(table, dtable, table_start, dummy)
        table_copies, table_rev_copies, dtable_copies, table_stride = tables
        flags = _flags(q, has_doc, has_prior, has_row_scale, scale_prior, dot_prec, block_d)

        # preprocess: Delta = rowsum(O * dO)
        delta = torch.empty((batch, H, Tq), device=q.device, dtype=torch.float32)
        pm = cfg["pre"]
        # fmt: off
        _attn_bwd_preprocess[(triton.cdiv(Tq, pm), batch * H)](
            o, do, delta, *_strides(o), *_strides(do), H, Tq,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=pm, enable_fp_fusion=FP_FUSION)
        # fmt: on

        common = (lse, delta, doc, row_scale)
        dk, dv = _launch_dkdv(q, k, v, do, *common, table_rev_copies, table_stride, q_offset,
                              softmax_scale, cfg, flags, dummy_i, dummy)  # fmt: skip
        dq, g, drow_scale = _launch_dq(q, k, v, do, *common, table_copies, dtable_copies,
                                       table_stride, n_grad, need_row_scale_grad, q_offset,
                                       softmax_scale, cfg, flags, dummy_i, dummy)  # fmt: skip
    return dq, dk, dv, g, drow_scale


# fmt: off
@_triton_bwd.register_fake
def _(do, q, k, v, o, lse, doc_start, table, dtable, row_scale, scale_prior, q_offset,
      softmax_scale, table_start, need_row_scale_grad):
    g = q.new_empty(dtable.shape[:2] if dtable is not None else (0,), dtype=torch.float64)
    drow_scale = q.new_empty(q.shape[:3] if need_row_scale_grad else (0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), g, drow_scale


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, doc_start, table, dtable, theta, row_scale = inputs[:8]
    scale_prior, q_offset, softmax_scale, table_start = inputs[8:]
    ctx.save_for_backward(q, k, v, *output, doc_start, table, dtable, row_scale)
    ctx.args = (scale_prior, q_offset, softmax_scale, table_start)
    ctx.theta_dtype = theta.dtype if theta is not None else None
    ctx.mark_non_differentiable(output[1])


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, doc_start, table, dtable, row_scale = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    need_row_scale_grad = row_scale is not None and wanted[7]
    dtable = dtable if wanted[6] else None
    dq, dk, dv, g, drow_scale = _triton_bwd(do, q, k, v, o, lse, doc_start, table, dtable,
                                            row_scale, *ctx.args, need_row_scale_grad)
    # row_scale may broadcast over the batch
    grad_row_scale = None
    if need_row_scale_grad:
        grad_row_scale = drow_scale.sum_to_size(row_scale.shape).to(row_scale.dtype)
    grad_theta = g.to(ctx.theta_dtype) if wanted[6] else None
    return (dq if wanted[0] else None, dk if wanted[1] else None, dv if wanted[2] else None,
            None, None, None, grad_theta, grad_row_scale, None, None, None, None)
# fmt: on


_triton_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def attention_triton(q, k, v, args):
    """The Triton implementation of attention() (impl "triton"), for every registered prior, for
    attention.py's resolved AttentionArgs (prior a BoundPrior or None, q_offset an int,
    softmax_scale a float). Needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first
    imported (then it runs, slowly, on CPU tensors)."""
    H, Tq, D = q.shape[1:]
    Tk = k.shape[2]
    # nothing to attend from (still connected to autograd)
    if Tq == 0:
        return q * 0.0

    # unit stride along head_dim keeps the loads vectorised; other strides are passed as they are
    k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))

    tables = (None, None, None, 0)
    if args.prior is not None:
        cfg = _configs(_block_d(D), q.dtype)
        tables = _prior_tables(args.prior, H, Tq, Tk, args.q_offset, cfg, q.device)
    table, dtable, theta, table_start = tables
    out, _ = _triton_fwd(
        q,
        k,
        v,
        args.doc_start,
        table,
        dtable,
        theta,
        args.row_scale,
        args.scale_prior,
        args.q_offset,
        args.softmax_scale,
        table_start,
    )
    return out


# ---- The self-check ------------------------------------------------------------------------------
# A compiled kernel can compute wrong numbers without an error on a GPU that no test ran on, so
# every run that resolves to impl "triton" first compares it with the reference on one small problem
# shaped like the run, the reference in fp32 on the same rounded inputs; the errors are relative
# (_check_errors). A correct kernel differs by the roundings the reference does not make: with
# 16-bit inputs, P before P V and dS before dS K and dS^T Q are rounded to 8 bits (bfloat16) or 11
# (float16), and the output once more. The prior's and SSMax's gradients are sums in fp32
# (_own_delta). Measured by dev/check_errors.py on every registered prior, SSMax off, on and scaling
# the prior, three seeds, head_dim 32 and 64, the largest errors were:
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
_checked = set()


class KernelMismatch(RuntimeError):
    """The Triton kernel disagrees with the reference on check_kernel's problem."""


def check_kernel(layer, dtype, training):
    """Compare the kernel with the reference on a problem shaped like `layer`'s attention (a
    model.Attention: its impl, prior and trained parameters, SSMax and its placement, head_dim), in
    dtype, with documents and every gradient when training. Returns the line to print, or None where
    the layer's impl is not the kernel or its configuration was checked before in this process;
    raises KernelMismatch (the same line) where an error is over CHECK_TOLERANCE."""
    from attention import pick_impl  # attention.py imports this module

    family = layer.family
    device = layer.wq.weight.device
    if pick_impl(layer.attn_impl, family, device, training, dtype, layer.head_dim) != "triton":
        return None

    trained = ()
    if family is not None and training:
        trained = tuple(n for n in family.params if getattr(layer, n).requires_grad)
    problem = (family, trained, layer.head_dim, dtype, layer.ssmax_s is not None, layer.scale_prior)
    if (problem, str(device), training) in _checked:
        return None
    _checked.add((problem, str(device), training))

    started = time.time()
    inputs = _check_problem(*problem, documents=training)
    kernel = _check_outputs("triton", inputs, device, training)
    reference = _check_outputs("torch", inputs, device, training)
    errors = _check_errors(kernel, reference, family)
    line, ok = _check_line(errors, inputs, *problem)
    if not ok:
        raise KernelMismatch(f"the Triton kernel disagrees with the reference: {line}")
    return f"{line}: ok in {time.time() - started:.1f} s"


def check_kind(name):
    """The kind of one of the self-check's results, each with its tolerance: the output, the inputs'
    gradients (q, k, v) or the parameters' (the prior's, SSMax's s)."""
    if name == "output":
        return "output"
    return "inputs" if name in ("q", "k", "v") else "parameters"


def _check_problem(family, trained, head_dim, dtype, ssmax, scale_prior, documents, seed=0):
    """The self-check's problem, on the CPU from its own generator (the run's RNG is untouched): a
    dict of q, k, v (B, H, T, D) in dtype in the model's (B, T, H, D) layout, dout, doc_start
    (three documents per row) or None, the prior (its default init moved at random: a constant
    prior hides misreads) with its trained names, and SSMax's s, one sign per head."""
    gen = torch.Generator().manual_seed(seed)
    B, H, T, D = 2, 2, check_length(head_dim, dtype), head_dim
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2) for _ in range(3))
    # the output's gradient in its dtype, as autograd hands it to the kernel's backward
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)

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

    # SSMax's s of both signs, whose row scales s log n are -0.0 where n = 1
    s = torch.tensor([1.0, -0.6]) if ssmax else None
    return dict(
        q=q, k=k, v=v, dout=dout, doc_start=doc_start, family=family, params=params,
        trained=trained, s=s, scale_prior=scale_prior,
    )  # fmt: skip


def _check_outputs(impl, problem, device, training):
    """impl's output and, when training, its gradients {name: tensor} on the problem; the
    reference takes fp32 copies of the same rounded q, k, v."""
    family = problem["family"]
    leaves = {name: problem[name] for name in ("q", "k", "v")}
    if impl == "torch":
        leaves = {name: t.float() for name, t in leaves.items()}
    if family is not None:
        named = zip(family.params, problem["params"])
        leaves |= {n: t for n, t in named if n in problem["trained"]}
    if problem["s"] is not None:
        leaves["s"] = problem["s"]
    leaves = {n: t.to(device, copy=True).requires_grad_(training) for n, t in leaves.items()}

    prior = None
    if family is not None:
        values = [leaves.get(n, t.to(device)) for n, t in zip(family.params, problem["params"])]
        prior = BoundPrior(family, tuple(values))
    doc_start = problem["doc_start"]
    if doc_start is not None:
        doc_start = doc_start.to(device)
    row_scale = None
    if problem["s"] is not None:
        from attention import ssmax_log_n

        log_n = ssmax_log_n(torch.arange(leaves["q"].shape[2], device=device), doc_start)
        row_scale = leaves["s"][None, :, None] * log_n[:, None, :]

    from attention import attention

    with torch.set_grad_enabled(training):
        out = attention(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            doc_start=doc_start,
            prior=prior,
            row_scale=row_scale,
            scale_prior=problem["scale_prior"],
            impl=impl,
        )
        results = {"output": out.detach().float().cpu()}
        if training:
            (out.float() * problem["dout"].to(device)).sum().backward()
            results |= {n: t.grad.float().cpu() for n, t in leaves.items()}
    return results


def _check_errors(kernel, reference, family):
    """{name: max |kernel - reference| / scale}, the scale max |reference| (floored at 1e-3, so that
    a gradient of 0 is compared absolutely), for the prior's parameters taken over all of them
    together: each sums dS times a table of like size, while one may be near 0 by chance."""
    params = [n for n in reference if family is not None and n in family.params]
    scale = {n: reference[n].double().abs().max() for n in reference}
    for name in params:
        scale[name] = max(scale[p] for p in params)

    errors = {}
    for name in reference:
        difference = (kernel[name].double() - reference[name].double()).abs().max()
        errors[name] = (difference / scale[name].clamp_min(1e-3)).item()
    return errors


def _check_line(errors, problem, family, trained, head_dim, dtype, ssmax, scale_prior):
    """The self-check's line, the largest error of each kind against its tolerance, and whether
    every error is within its tolerance (NaN is not)."""
    tolerances = dict(zip(("output", "inputs", "parameters"), CHECK_TOLERANCE[dtype]))
    worst = {}
    for name, error in errors.items():
        kind = check_kind(name)
        if kind not in worst or not error <= errors[worst[kind]]:
            worst[kind] = name

    what = family.name if family is not None else "no prior"
    if ssmax:
        what += " + SSMax" + (" scaling the prior" if scale_prior else "")
    if problem["doc_start"] is not None:
        what += ", documents"
    parts = []
    for kind, name in worst.items():
        which = "" if kind == "output" else f" ({name})"
        parts.append(f"{kind} {errors[name]:.1e}{which} (tolerance {tolerances[kind]:.0e})")

    dtype_name = str(dtype).removeprefix("torch.")
    length = problem["q"].shape[2]
    line = (
        f"attention kernel check ({dtype_name}, head_dim {head_dim}, {what}, {length} tokens): "
        + ", ".join(parts)
    )
    ok = all(error <= tolerances[check_kind(name)] for name, error in errors.items())
    return line, ok
