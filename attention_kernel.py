"""
The Triton kernel of bam-gpt's attention (impl "triton"): flash attention with any registered prior and SSMax,
forward and backward, registered as torch.library custom ops. attention.py holds the contract, the formula and
the one decision point (impl_error); it checks and resolves the arguments before calling attention_triton.
"""
import contextlib
import os
from typing import Optional

import torch
import torch.nn.functional as F

from priors import BoundPrior

# ----------------------------------------------------------------------------------------------------------
# Triton kernel: flash attention with any registered prior and SSMax applied per tile.
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
# forward-class kernel with a prior at 0.137 clocks per score before any diagonal reduction, and what the dQ
# kernel adds for two derivative tables (GGD's or Cauchy's trained parameters) at 0.128, +0.059 for a third:
# for the shipped priors the tables cost less, need no extra pass or new reduction, and keep the exact zero.
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


def interpreting():
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): the kernels then run, slowly, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available():
    return triton is not None  # the import is tried once, above (no import inside code that torch.compile traces)


if triton is not None:
    # Triton's interpreter multiplies bfloat16 blocks as their raw uint16 storage; there (only) tl.dot gets its
    # bf16 operands upcast to fp32, which is exact, so the CPU tests still see bf16 rounding of P and dS.
    _INTERPRET_BF16_UPCAST = tl.constexpr(interpreting())
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
    # sx, px = sum dS x, sum P x (row_scale; x as in the section comment); sj, pj: tuples of K, whose entry k holds
    # sum dS J_k, sum P J_k (prior parameter k). Each "p" sum corrects its "s" sum for Delta' - Delta.
    @triton.jit
    def _bwd_dq_inner(dq, a_pdp, a_sx, a_px, a_sj, a_pj, q, do, lse, delta, r_rows, K_ptr, V_ptr, skt, skd, svt, svd,
                      offs_d, d_ok, qpos, ds_rows, tab, jtab, d0, n_dist, sm_scale, Tk, blk_lo, blk_hi,
                      MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                      SCALE_PRIOR: tl.constexpr, ACC_DPP: tl.constexpr, N_GRAD: tl.constexpr,
                      NEED_RS_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                      STAGES: tl.constexpr):
        for blk in tl.range(blk_lo, blk_hi, num_stages=STAGES):  # pipelines the tables' loads too
            offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_ok = offs_n < Tk
            kT = tl.load(K_ptr + offs_n[None, :] * skt + offs_d[:, None] * skd,
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            vT = tl.load(V_ptr + offs_n[None, :] * svt + offs_d[:, None] * svd,
                         mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
            jt = ()  # the derivative tables' tiles, issued with the K/V loads so that they are pipelined like them
            for k in tl.static_range(N_GRAD):
                jt = jt + (_prior_tile(qpos[:, None], offs_n[None, :], jtab + k * n_dist, d0),)
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
            sj, pj = (), ()
            for k in tl.static_range(N_GRAD):
                sj, pj = sj + (a_sj[k] + tl.sum(ds * jt[k], 1),), pj + (a_pj[k] + tl.sum(p * jt[k], 1),)
            a_sj, a_pj = sj, pj
        return dq, a_pdp, a_sx, a_px, a_sj, a_pj

    @triton.jit
    def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, DS, RS, PTAB, JTAB, DRS, PART,
                     sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdob, sdoh, sdot, sdod,
                     sdqb, sdqh, sdqt, sdqd, sdsb, srb, srh, srt,
                     H, Tq, Tk, q_offset, sm_scale, d0, n_dist, n_qblocks,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_DOC: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_RS: tl.constexpr,
                     SCALE_PRIOR: tl.constexpr, N_GRAD: tl.constexpr, NEED_RS_GRAD: tl.constexpr,
                     ACC_DPP: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr):
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
        zero = tl.zeros([BLOCK_M], dtype=tl.float32)
        a_pdp, a_sx, a_px, a_sj, a_pj = zero, zero, zero, (), ()
        for k in tl.static_range(N_GRAD):
            a_sj, a_pj = a_sj + (zero,), a_pj + (zero,)
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
                masked, HAS_DOC, HAS_PRIOR, HAS_RS, SCALE_PRIOR, ACC_DPP, N_GRAD, NEED_RS_GRAD,
                BLOCK_N, DOT_PREC, STAGES)
        tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :] * sdqd,
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)
        corr = a_pdp - delta  # Delta' - Delta
        if NEED_RS_GRAD:
            tl.store(DRS + bh * Tq + offs_m, a_sx - corr * a_px, mask=row_ok)
        w = tl.where(row_ok, 1.0, 0.0)
        if HAS_RS and SCALE_PRIOR:
            w = w * r_rows  # dB = dS r
        for k in tl.static_range(N_GRAD):
            tl.store(PART + (bh * n_qblocks + pid_m) * N_GRAD + k, tl.sum(w * (a_sj[k] - corr * a_pj[k]), 0))


# ------------------------------------------------------------------ launch configuration and the autograd wrapper
# Fixed tiles per (head_dim, dtype) rather than triton.autotune: the backward's tile-skipping tables depend on the
# block sizes, and under the interpreter autotuning would multiply test time. Tests may set INTERPRET_BLOCKS.
INTERPRET_BLOCKS = (32, 32)


def _configs(block_d, dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, dK/dV and dQ kernels. Chosen so that the sm_90
    builds (ptxas, all prior/SSMax/document flags on) spill no or almost no registers; not tuned on hardware."""
    if interpreting():
        bm, bn = INTERPRET_BLOCKS
        return dict(fwd=(bm, bn, 4, 1), dkdv=(bm, bn, 4, 1), dq=(bm, bn, 4, 1), pre=bm)
    if dtype == torch.float32:  # ieee dots run on FMA units: the exact path for gradient checks, not for speed
        if block_d <= 64:
            return dict(fwd=(64, 32, 8, 2), dkdv=(32, 64, 8, 2), dq=(64, 32, 8, 2), pre=64)
        return dict(fwd=(32, 32, 4, 2), dkdv=(16, 32, 4, 2), dq=(32, 16, 4, 2), pre=64)
    if block_d <= 64:
        return dict(fwd=(128, 64, 8, 3), dkdv=(32, 64, 4, 3), dq=(128, 32, 8, 2), pre=128)
    # dK/dV: 64 keys per warpgroup, or Hopper's wgmma is not used (mma.sync from ldmatrix instead: perf_model.py
    # predicts 5x the time, bound by shared-memory bandwidth)
    return dict(fwd=(128, 32, 8, 2), dkdv=(32, 64, 4, 2), dq=(64, 16, 8, 2), pre=128)


def _dq_stages(cfg, n_grad):
    """Pipeline stages of the dQ loop. tl.range pipelines all its loads, the prior's 1 + K table tiles too (the
    kernel argument num_stages only those that feed a dot: the derivative tables' tiles then went through a
    layout conversion in shared memory, 12 bytes per score each, perf_model.py); beyond 96 KB of table tiles
    per extra stage they would not fit beside K and V on an A100, and stay unpipelined."""
    bm, bn, _, stages = cfg["dq"]
    return stages if (1 + n_grad) * bm * bn * 4 * (stages - 1) <= 96 * 1024 else 1


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
    d = torch.arange(d0, d0 + n, device=device)
    future = d > 0
    params = tuple(t.detach() for t in prior.params)
    of = lambda *ps: BoundPrior(prior.prior, ps).table(d).float().expand(H, n)  # the registry's fn
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
            BLOCK_M=bm, BLOCK_N=bn, N_GRAD=n_grad, NEED_RS_GRAD=need_rs, ACC_DPP=n_grad > 0 or need_rs,
            STAGES=_dq_stages(cfg, n_grad), num_warps=warps, num_stages=stages, **common)
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


def attention_triton(q, k, v, *, doc_start, prior, row_scale, scale_prior, q_offset, softmax_scale):
    """The Triton implementation of attention() (attention.py), for every registered prior. Takes the
    arguments as attention() passes them, checked and resolved (prior a BoundPrior or None, q_offset an int,
    softmax_scale a float). Needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first imported
    (then it runs, slowly, on CPU tensors)."""
    H, Tq, D = q.shape[1:]
    Tk = k.shape[2]
    if Tq == 0:
        return q * 0.0  # nothing to attend from (still connected to autograd)
    # unit stride along head_dim keeps the loads vectorised; other strides are passed as they are
    k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tables = (None, None, None, 0) if prior is None else _prior_tables(
        prior, H, Tq, Tk, q_offset, _configs(_block_d(D), q.dtype), q.device)
    return _triton_fwd(q, k, v, doc_start, *tables[:3], row_scale, bool(scale_prior), q_offset, softmax_scale,
                       tables[3])[0]
