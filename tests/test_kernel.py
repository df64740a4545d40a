"""The Triton attention kernel against the PyTorch reference and the dense formula, for every
registered prior.

Runs on the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported); with TRITON_INTERPRET=0 on a CUDA machine the same tests check the compiled
kernel. Shapes are small because the interpreter is slow; each case picks its own tile sizes so that
ragged tiles, the staged (unmasked / masked) loops and block sizes with BLOCK_M != BLOCK_N are all
exercised.
"""

import ast
import functools
import inspect
import math

import pytest
import torch

import attention as attention_mod
import attention_kernel as ak
from attention import attention, dense_attention, impl_error
from infra import kernel_check
from infra.kernel_check import KernelMismatch, check_kernel
from priors import BoundPrior, Prior, alibi_slopes, get_prior, register

pytest.importorskip("triton")

DEVICE = "cuda" if (torch.cuda.is_available() and not ak.interpreting()) else "cpu"
# the reference implementation, that the kernel is held to
reference = functools.partial(attention, impl="torch")
if DEVICE == "cpu" and not ak.interpreting():
    pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)


# ------------------------------------------------------------------------------------------ helpers
def random_doc_start(batch, length, gen, p=0.08):
    """doc_start (B, T) from random document boundaries, different for every batch row."""
    ds = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        cuts = (torch.rand(length, generator=gen) < p).nonzero().flatten().tolist()
        for c in cuts:
            ds[b, c:] = c
    return ds


def doc_start_from_boundaries(length, starts):
    ds = torch.zeros(length, dtype=torch.long)
    for s in sorted(starts):
        ds[s:] = s
    return ds


def bam_prior(alpha, beta, mu):
    return tuple(torch.tensor(x, dtype=torch.float32) for x in (alpha, beta, mu))


def run(fn, q, k, v, dout, *, prior=None, row_scale=None, dtype=None, prior_grad=True, **kw):
    """Forward + backward of fn; returns (output, {name: grad}) in fp32. q/k/v are cast to dtype if
    given."""
    leaves = {}

    def leaf(name, t, grad=True):
        t = t.detach().clone().to(DEVICE)
        if dtype is not None and name in ("q", "k", "v"):
            t = t.to(dtype)
        if grad:
            t.requires_grad_(True)
            leaves[name] = t
        return t

    q_, k_, v_ = leaf("q", q), leaf("k", k), leaf("v", v)
    pr = None
    # prior_grad: one bool, or one per tensor (e.g. theta_mu frozen as in the model)
    if prior is not None:
        flags = prior_grad if isinstance(prior_grad, tuple) else (prior_grad,) * 3
        pr = tuple(
            leaf(n, t, f)
            for n, t, f in zip(("theta_alpha", "theta_beta", "theta_mu"), prior, flags)
        )
    rs = leaf("row_scale", row_scale) if row_scale is not None else None
    kw = {n: (t.to(DEVICE) if torch.is_tensor(t) else t) for n, t in kw.items()}
    out = fn(q_, k_, v_, prior=pr, row_scale=rs, **kw)
    (out.float() * dout.to(DEVICE)).sum().backward()
    return out.detach().float().cpu(), {n: t.grad.float().cpu() for n, t in leaves.items()}


def rel_err(a, b):
    """max |a - b| relative to max |b| (gradients of theta_beta < 0 heads are large: compare to
    their scale). The floor 1e-3 turns this into an absolute test for gradients that are exactly 0
    in the reference (a row with a single visible key), where the kernel leaves fp32 rounding noise
    of order 1e-7."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()


def check_against_reference(
    q, k, v, *, blocks, out_tol=1e-4, grad_tol=1e-3, param_tol=None, dtype=None, **kw
):
    """The kernel (tiles `blocks`, None: the GPU's) against the reference on values and every
    gradient: q, k, v within grad_tol, the prior's and the row scale's within param_tol (grad_tol
    when None). With a 16-bit dtype the reference is fp32 on the same rounded q, k, v and dout."""
    gen = torch.Generator().manual_seed(123)
    dout = torch.randn(q.shape, generator=gen)
    if dtype is not None:  # the kernel's backward takes dO in q's dtype
        dout = dout.to(dtype).float()
    old = ak.INTERPRET_BLOCKS
    ak.INTERPRET_BLOCKS = blocks
    try:
        o_k, g_k = run(
            functools.partial(attention, impl="triton"), q, k, v, dout, dtype=dtype, **kw
        )
    finally:
        ak.INTERPRET_BLOCKS = old
    if dtype is not None:  # reference in fp32 on the same (rounded) inputs
        q, k, v = (t.to(dtype).float() for t in (q, k, v))
    o_r, g_r = run(reference, q, k, v, dout, **kw)
    assert torch.isfinite(o_k).all()
    errs = {"out": rel_err(o_k, o_r)}
    assert errs["out"] <= out_tol, errs
    assert set(g_k) == set(g_r)
    for name in g_r:
        assert torch.isfinite(g_k[name]).all(), name
        assert g_k[name].shape == g_r[name].shape, name
        errs[name] = rel_err(g_k[name], g_r[name])
    assert max(errs[n] for n in ("q", "k", "v") if n in errs) <= grad_tol, errs
    params = [errs[n] for n in g_r if n not in ("q", "k", "v")]
    assert max(params, default=0.0) <= (grad_tol if param_tol is None else param_tol), errs
    return errs


def qkv(batch, heads, tq, tk, d, seed=0, noncontiguous=False):
    gen = torch.Generator().manual_seed(seed)

    def make(t):
        if noncontiguous:  # the model's layout: (B, T, H, D) viewed as (B, H, T, D)
            return torch.randn(batch, t, heads, d, generator=gen).transpose(1, 2)
        return torch.randn(batch, heads, t, d, generator=gen)

    return make(tq), make(tk), make(tk)


def ssmax_row_scale(s, doc_start, tq, q_offset):
    """The model's SSMax row scale s_h * log n_i, n_i = position in the document + 1. (B or 1, H,
    Tq)."""
    tk = doc_start.shape[-1] if doc_start is not None else q_offset + tq
    pos = torch.arange(tk)
    n = (pos[None, :] - doc_start + 1) if doc_start is not None else (pos + 1)[None, :]
    return s[None, :, None] * n[:, q_offset : q_offset + tq].float().log()[:, None, :]


# -------------------------------------------------------------------------------------------- cases
GEN = torch.Generator().manual_seed(7)
CASES = {
    # name: (B, H, Tq, Tk, D, blocks, kwargs builder)
    "nope_len17_d64": (2, 2, 17, 17, 64, (16, 16), lambda: {}),
    "bam_beta_-1.5_0.5_2_mu_len130_d64": (
        1,
        3,
        130,
        130,
        64,
        (32, 16),
        lambda: dict(
            prior=bam_prior([0.1, -0.5, 0.2], [-1.5, 0.5, 2.0], [0.0, 0.3, -0.2]),
            doc_start=random_doc_start(1, 130, GEN),
            noncontiguous=True,
        ),
    ),
    "bam_beta_-0.3_0_1_mu_len257_d48": (
        1,
        3,
        257,
        257,
        48,
        (64, 64),
        lambda: dict(
            prior=bam_prior([0.3, 0.0, -1.0], [-0.3, 0.0, 1.0], [0.4, 0.1, -0.25]),
            prior_grad=(False, True, False),
            doc_start=random_doc_start(1, 257, GEN, p=0.02),
        ),
    ),
    "bam_ssmax_scale_prior_docs": (
        2,
        2,
        130,
        130,
        64,
        (32, 32),
        lambda: dict(
            prior=bam_prior([0.2, -0.3], [-1.5, 0.7], [0.0, 0.2]),
            doc_start=random_doc_start(2, 130, GEN),
            row_scale=torch.rand(2, 2, 130, generator=GEN) + 0.5,
            scale_prior=True,
        ),
    ),
    "bam_ssmax_no_scale_prior_batch1_rowscale": (
        2,
        2,
        130,
        130,
        48,
        (32, 16),
        lambda: dict(
            prior=bam_prior([0.2, -0.3], [-0.3, 1.0], [0.3, 0.0]),
            row_scale=ssmax_row_scale(torch.tensor([1.0, 0.6]), None, 130, 0),
            scale_prior=False,
        ),
    ),
    "ssmax_model_rowscale_docs_scale_prior": (
        2,
        2,
        130,
        130,
        64,
        (16, 32),
        lambda: dict(
            prior=bam_prior([0.0, 0.5], [-1.5, 0.0], [0.0, 0.0]),
            **(
                lambda ds: dict(
                    doc_start=ds, row_scale=ssmax_row_scale(torch.tensor([1.0, 1.3]), ds, 130, 0)
                )
            )(random_doc_start(2, 130, GEN)),
            scale_prior=True,
        ),
    ),
    "ssmax_without_prior": (
        1,
        2,
        130,
        130,
        48,
        (32, 32),
        lambda: dict(
            row_scale=torch.rand(1, 2, 130, generator=GEN) + 0.5,
            doc_start=random_doc_start(1, 130, GEN),
        ),
    ),
    "qoffset_explicit_tq37_tk130": (
        2,
        2,
        37,
        130,
        64,
        (16, 32),
        lambda: dict(
            prior=bam_prior([0.1, -0.2], [-1.5, 0.5], [0.2, 0.0]),
            doc_start=random_doc_start(2, 130, GEN),
            row_scale=torch.rand(2, 2, 37, generator=GEN) + 0.5,
            scale_prior=True,
            q_offset=50,
        ),
    ),
    "qoffset_default_tq1_tk257": (
        1,
        2,
        1,
        257,
        48,
        (16, 64),
        lambda: dict(
            prior=bam_prior([0.1, -0.2], [-0.3, 2.0], [0.2, 0.0]),
            prior_grad=(True, True, False),
            doc_start=random_doc_start(1, 257, GEN),
        ),
    ),
    "len1": (
        2,
        2,
        1,
        1,
        64,
        (16, 16),
        lambda: dict(
            prior=bam_prior([0.1, -0.2], [-1.5, 1.0], [0.0, 0.3]),
            row_scale=torch.rand(2, 2, 1, generator=GEN),
        ),
    ),
    # SSMax scaling the prior with row scales of either sign and 0, documents of length 1 among
    # them
    "signed_row_scale_scale_prior_docs": (
        2,
        2,
        70,
        70,
        32,
        (16, 16),
        lambda: dict(
            prior=bam_prior([0.2, -0.3], [-1.5, 0.7], [0.0, 0.2]),
            doc_start=torch.stack(
                [
                    doc_start_from_boundaries(70, [3, 4, 30, 31, 50]),
                    doc_start_from_boundaries(70, [1, 17, 18, 45]),
                ]
            ),
            row_scale=torch.where(
                torch.rand(2, 2, 70, generator=GEN) < 0.15,
                0.0,
                (torch.rand(2, 2, 70, generator=GEN) * 2 - 1) * 2,
            ),
            scale_prior=True,
        ),
    ),
    # documents of length 1 (one visible key: p = 1 on a prior of about -3e7) and query tiles whose
    # first key tile is fully masked; no SSMax, so the huge bias enters the scores unscaled
    "single_key_rows_beta_negative": (
        2,
        2,
        64,
        64,
        64,
        (16, 16),
        lambda: dict(
            prior=bam_prior([0.0, 1.0], [-1.5, -1.5], [0.0, 0.0]),
            doc_start=torch.stack(
                [
                    doc_start_from_boundaries(64, [5, 6, 7, 20, 21, 40]),
                    doc_start_from_boundaries(64, [1, 2, 17, 33, 34, 63]),
                ]
            ),
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_fp32(name):
    B, H, Tq, Tk, D, blocks, build = CASES[name]
    kw = build()
    q, k, v = qkv(B, H, Tq, Tk, D, seed=len(name), noncontiguous=kw.pop("noncontiguous", False))
    check_against_reference(q, k, v, blocks=blocks, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision(dtype):
    gen = torch.Generator().manual_seed(3)
    ds = random_doc_start(2, 130, gen)
    q, k, v = qkv(2, 2, 130, 130, 48, seed=5)
    kw = dict(
        prior=bam_prior([0.2, -0.3], [-1.5, 0.7], [0.0, 0.2]),
        doc_start=ds,
        row_scale=ssmax_row_scale(torch.tensor([1.0, 0.8]), ds, 130, 0),
        scale_prior=True,
    )
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    check_against_reference(
        q, k, v, blocks=(32, 32), dtype=dtype, out_tol=tol, grad_tol=2 * tol, **kw
    )


def signed_row_scale(batch, length, doc_start, gen):
    """Row scales of every sign the model produces and more: head 0 positive, head 1 negative, head
    2 mixed at random, each row's first key (n = 1: log n = 0) a 0 of either sign, as s log n is
    for s > 0 and s < 0."""
    n = torch.arange(length)[None, :] - doc_start + 1
    log_n = n.float().log()[:, None, :]  # (B, 1, T)
    s = torch.tensor([0.9, -0.7, 1.0])[None, :, None]
    mixed = torch.where(torch.rand(batch, 1, length, generator=gen) < 0.5, -1.3, 1.3)
    rs = torch.cat([s[:, :2] * log_n, mixed * log_n], 1)
    assert (
        (rs == 0).any() and torch.signbit(rs[rs == 0]).any() and (~torch.signbit(rs[rs == 0])).any()
    )
    return rs


# each dtype and each placement of the row scale in the default run; the other two pairs in test-all
@pytest.mark.parametrize(
    "dtype, scale_prior",
    [
        (torch.bfloat16, True),
        (torch.float16, False),
        pytest.param(torch.bfloat16, False, marks=pytest.mark.slow),
        pytest.param(torch.float16, True, marks=pytest.mark.slow),
    ],
)
def test_kernel_half_precision_signed_row_scales(dtype, scale_prior):
    """16-bit inputs with SSMax row scales of both signs and -0.0 (scaling the prior or not):
    values and every gradient. The prior's and the row scale's gradients, sums over every score,
    match to fp32 rounding (see _own_delta)."""
    gen = torch.Generator().manual_seed(4)
    B, H, T, D = 2, 3, 100, 32
    ds = torch.stack(
        [doc_start_from_boundaries(T, [1, 40, 41, 77]), doc_start_from_boundaries(T, [23, 90])]
    )
    q, k, v = qkv(B, H, T, T, D, seed=9, noncontiguous=True)
    kw = dict(
        prior=bam_prior([0.2, -0.3, 0.5], [-1.5, 0.7, 0.3], [0.0, 0.2, -0.4]),
        doc_start=ds,
        row_scale=signed_row_scale(B, T, ds, gen),
        scale_prior=scale_prior,
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    check_against_reference(
        q, k, v, blocks=(32, 16), dtype=dtype, out_tol=tol, grad_tol=2 * tol, param_tol=1e-4, **kw
    )


@pytest.mark.slow  # 30 s in the interpreter
def test_kernel_offsets_past_2_31():
    """The last head's keys start past 2^31 elements (B H T D of a long context): the kernels'
    base offsets are 64-bit. Its query sees the last 64 keys only (its document), so the forward is
    that of those keys alone, bitwise. On the CPU the keys are allocated, not touched (virtual
    memory) but for those 64; on a GPU they take 13 GB."""
    H, Tk, D = 3, 2**26, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 1, D, generator=gen).half().to(DEVICE)
    k = torch.empty(1, H, Tk, D, dtype=torch.float16, device=DEVICE)
    v = torch.empty_like(k)
    for t in (k, v):
        t[:, :, -64:] = torch.randn(1, H, 64, D, generator=gen).half().to(DEVICE)
    assert 2 * Tk * D >= 2**31
    doc_start = torch.full((1, 1), Tk - 64, device=DEVICE).expand(1, Tk)
    with torch.no_grad():
        out = attention(q, k, v, doc_start=doc_start, impl="triton")
        alone = attention(q, k[:, :, -64:], v[:, :, -64:], impl="triton")
    assert torch.equal(out, alone)


def test_kernel_jit_functions_take_at_most_40_parameters():
    """Contiguous inputs with derived offsets keep every kernel and helper's signature short (the
    Triton tutorial's longest takes 29)."""
    tree = ast.parse(inspect.getsource(ak))
    counts = {
        node.name: len(node.args.args)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    }
    assert "_attn_bwd_dq" in counts and max(counts.values()) <= 40, counts


# the GPU's tile configuration of every (dtype, head_dim) class of _configs (the same tiles on every
# GPU: only the forward's pipeline stages differ), each with a prior whose gradient takes one of
# the two paths (per score; per diagonal: t5_bucket); the half-precision 128-wide tiles take 20-30
# s each in the interpreter, so they run with the slow tests
GPU_TILE_CASES = [
    (torch.bfloat16, 64, "ggd", True),
    pytest.param(torch.bfloat16, 128, "t5_bucket", False, marks=pytest.mark.slow),
    (torch.float16, 64, "kerple_power", False),
    pytest.param(torch.float16, 128, "cauchy", True, marks=pytest.mark.slow),
    (torch.float32, 64, "t5_bucket", True),
    (torch.float32, 128, "ggd", False),
]


def attention_layer(name, head_dim, scale_prior):
    """A model's attention layer with the prior `name`, SSMax and two heads of head_dim, on the
    kernel: what train.py hands check_kernel."""
    import model as model_mod

    cfg = model_mod.GPTConfig(
        n_head=2,
        n_embd=2 * head_dim,
        prior=name,
        bam_init="default",
        ssmax=True,
        scale_prior=scale_prior,
    )
    return model_mod.Attention(cfg, 0, "triton").to(DEVICE)


@pytest.mark.parametrize("dtype,head_dim,name,scale_prior", GPU_TILE_CASES)
def test_self_check_passes_on_the_gpu_tiles(
    monkeypatch, gpu_driver, dtype, head_dim, name, scale_prior
):
    """The self-check a GPU run makes before it trusts the kernel (check_kernel), with the GPU's
    own tiles (INTERPRET_BLOCKS = None), so that a CPU test executes each of them."""
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", None)
    monkeypatch.setattr(kernel_check, "_checked", set())
    line = check_kernel(attention_layer(name, head_dim, scale_prior), dtype, training=True)
    length = ak.check_length(head_dim, dtype, torch.device(DEVICE))
    assert f"{length} tokens" in line and ": ok in " in line, line
    assert check_kernel(attention_layer(name, head_dim, scale_prior), dtype, True) is None


@pytest.mark.parametrize("dtype,misread", [(torch.float32, "table"), (torch.bfloat16, "dtable")])
def test_self_check_catches_a_misread_table(monkeypatch, dtype, misread):
    """A kernel made wrong on purpose, reading its tables one distance off: the prior's (values and
    gradients wrong), or only its derivative tables' (only d theta wrong)."""
    right = ak._prior_tables

    def misreading(*args):
        table, dtable, theta, table_start = right(*args)
        if misread == "table":
            return table.roll(1, -1), dtable, theta, table_start
        # (the self-check's steep problem trains no prior: no derivative tables)
        return table, dtable.roll(1, -1) if dtable is not None else None, theta, table_start

    monkeypatch.setattr(ak, "_prior_tables", misreading)
    monkeypatch.setattr(kernel_check, "_checked", set())
    with pytest.raises(KernelMismatch, match="disagrees with the reference"):
        check_kernel(attention_layer("ggd", 32, True), dtype, training=True)


@pytest.mark.parametrize("theta_beta", [-1.5, 0.7])
def test_kernel_single_key_rows_exact_zero_prior_grad(theta_beta):
    """A row with one visible key has P = 1 whatever the prior: its prior gradient is exactly 0 in
    the reference. With theta_beta = -1.5 that key's prior is floored (-3e7 by the formula); with
    0.7 it is not, and rounding noise in dP - Delta would reach d theta unless the kernel sets such
    rows' gradients to 0."""
    q, k, v = qkv(1, 1, 4, 4, 32, seed=11)
    ds = torch.arange(4)[None, :]  # every position starts its own document
    prior = bam_prior([0.0], [theta_beta], [0.0])
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    out, g = run(
        functools.partial(attention, impl="triton"),
        q,
        k,
        v,
        dout,
        prior=prior,
        doc_start=ds,
        row_scale=torch.rand(1, 1, 4) + 0.5,
        scale_prior=False,
    )
    assert torch.equal(out, v.float())
    for name in ("theta_alpha", "theta_beta", "theta_mu", "row_scale", "q"):
        assert torch.equal(g[name], torch.zeros_like(g[name])), (name, g[name])
    # dk is 0 up to fp32 rounding of dP - Delta (not amplified: no prior factor)
    assert g["k"].abs().max() < 1e-5
    assert torch.allclose(g["v"], dout)


def test_kernel_rows_without_visible_keys_give_zero():
    """doc_start > position leaves a query with nothing to attend to: output 0 and finite gradients,
    not NaN."""
    q, k, v = qkv(1, 2, 40, 40, 32, seed=2)
    ds = doc_start_from_boundaries(40, [10, 30])[None, :].clone()
    ds[0, 12] = 13  # query 12 sees nothing
    ds[0, 35] = 39  # query 35 sees nothing
    prior = bam_prior([0.0, 0.3], [-1.5, 1.0], [0.0, 0.1])
    rs = torch.rand(1, 2, 40, generator=torch.Generator().manual_seed(0)) + 0.5
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out, g = run(
        functools.partial(attention, impl="triton"),
        q,
        k,
        v,
        dout,
        prior=prior,
        doc_start=ds,
        row_scale=rs,
        scale_prior=True,
    )
    assert torch.equal(out[:, :, [12, 35]], torch.zeros(1, 2, 2, 32))
    assert all(torch.isfinite(t).all() for t in g.values())
    assert torch.equal(g["q"][:, :, [12, 35]], torch.zeros(1, 2, 2, 32))
    # the other rows match the reference (whose rows 12 and 35 are NaN)
    ref = reference(q, k, v, prior=prior, doc_start=ds, row_scale=rs, scale_prior=True)
    assert torch.isnan(ref[:, :, [12, 35]]).all()
    keep = [i for i in range(40) if i not in (12, 35)]
    assert rel_err(out[:, :, keep], ref[:, :, keep]) < 1e-4


def test_kernel_skips_tiles_it_must_not_load():
    """Tiles before the earliest doc_start of a query block, and above the diagonal, are never
    loaded: fill those keys/values with NaN (any load would spread NaN through P V or dP) and expect
    finite, correct results."""
    Tk, Tq, q_offset = 128, 32, 64  # queries at 64..95
    q, k, v = qkv(1, 2, Tq, Tk, 32, seed=4)
    ds = doc_start_from_boundaries(Tk, [64, 80])[None, :]
    k[:, :, :64] = float("nan")
    v[:, :, :64] = float("nan")
    k[:, :, 96:] = float("nan")
    v[:, :, 96:] = float("nan")
    kw = dict(
        prior=bam_prior([0.0, 0.2], [-1.5, 1.0], [0.0, 0.0]),
        doc_start=ds,
        q_offset=q_offset,
        row_scale=torch.rand(1, 2, Tq) + 0.5,
        scale_prior=True,
    )
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    old = ak.INTERPRET_BLOCKS
    ak.INTERPRET_BLOCKS = (16, 32)
    try:
        o_k, g_k = run(functools.partial(attention, impl="triton"), q, k, v, dout, **kw)
    finally:
        ak.INTERPRET_BLOCKS = old
    o_r, g_r = run(reference, q, k, v, dout, **kw)
    assert torch.isfinite(o_k).all() and rel_err(o_k, o_r) < 1e-4
    for name in ("q", "theta_alpha", "theta_beta", "theta_mu", "row_scale"):
        assert torch.isfinite(g_k[name]).all() and rel_err(g_k[name], g_r[name]) < 1e-3, name
    for name in ("k", "v"):  # the NaN keys get exactly zero gradient; the others match
        assert torch.equal(g_k[name][:, :, :64], torch.zeros_like(g_k[name][:, :, :64]))
        assert torch.equal(g_k[name][:, :, 96:], torch.zeros_like(g_k[name][:, :, 96:]))
        assert rel_err(g_k[name][:, :, 64:96], g_r[name][:, :, 64:96]) < 1e-3, name


def test_kernel_uses_no_atomics():
    """dQ and the parameter gradients come from per-program partial sums reduced in a fixed order,
    never atomics: what makes two backward passes bitwise equal
    (test_kernel_every_prior_matches_dense_formula runs two)."""
    assert "atomic_" not in inspect.getsource(ak)


def test_kernel_optional_inputs_and_no_grad_inputs():
    """prior / row_scale / doc_start None, and tensors that do not require grad, give None
    gradients."""
    q, k, v = (t.to(DEVICE) for t in qkv(1, 2, 20, 20, 32, seed=6))
    q.requires_grad_(True)  # only q needs a gradient
    rs = torch.rand(1, 2, 20, device=DEVICE) + 0.5  # no grad
    prior = tuple(t.to(DEVICE) for t in bam_prior([0.0, 0.1], [0.5, 1.0], [0.0, 0.0]))  # no grad
    out = attention(q, k, v, prior=prior, row_scale=rs, impl="triton")
    out.square().sum().backward()
    q_ref = q.detach().clone().requires_grad_(True)
    reference(q_ref, k, v, prior=prior, row_scale=rs).square().sum().backward()
    assert k.grad is None and v.grad is None and rs.grad is None and prior[0].grad is None
    assert rel_err(q.grad, q_ref.grad) < 1e-4
    with torch.no_grad():
        out = attention(q, k, v, impl="triton")
    assert rel_err(out, reference(q, k, v)) < 1e-5


def test_kernel_dispatch(monkeypatch):
    """impl='auto' on CPU tensors: sdpa when nothing needs a gradient (evaluation), the reference
    when anything does; impl='triton' uses the kernel (here, the interpreter) for every registered
    prior."""
    calls = []
    for name in ("torch", "triton", "sdpa"):
        monkeypatch.setattr(
            attention_mod,
            f"attention_{name}",
            lambda *a, name=name, **kw: calls.append(name) or name,
        )
    q = torch.randn(1, 2, 4, 16)
    trained = (torch.zeros(2, requires_grad=True), torch.zeros(2), torch.zeros(2))
    cauchy = BoundPrior(get_prior("cauchy"), (torch.ones(2, requires_grad=True), torch.zeros(2)))
    assert [
        attention(q, q, q, impl="auto"),
        attention(q.clone().requires_grad_(), q, q, impl="auto"),
        attention(q, q, q, prior=trained, impl="auto"),
    ] == ["sdpa", "torch", "torch"]
    assert [attention(q, q, q, prior=p, impl="triton") for p in (None, trained, cauchy)] == [
        "triton"
    ] * 3
    assert impl_error("triton", TANH, "cpu", True) is None  # the interpreter takes every prior
    with pytest.raises(ValueError):
        attention(q, q, q, impl="cuda")


def test_kernel_rejects_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        attention(q, q, q, impl="triton")


@pytest.mark.parametrize("pos_encoding,ssmax", [("bam", True)])
def test_kernel_model_trains_through_kernel(monkeypatch, pos_encoding, ssmax):
    """A tiny GPT: forward + backward with attention forced onto the kernel matches the reference
    path."""
    import model as model_mod

    cfg = model_mod.GPTConfig(
        vocab_size=64,
        n_layer=2,
        n_head=2,
        n_embd=64,
        block_size=48,
        pos_encoding=pos_encoding,
        ssmax=ssmax,
        train_mu=True,
    )
    torch.manual_seed(0)
    net = model_mod.GPT(cfg).to(DEVICE)
    if pos_encoding == "bam":  # a non-trivial prior: anti-local and local heads, mu != 0
        with torch.no_grad():
            for blk in net.blocks:
                blk.attn.theta_alpha.copy_(torch.tensor([0.3, -0.5]))
                blk.attn.theta_beta.copy_(torch.tensor([-1.2, 0.8]))
                blk.attn.theta_mu.copy_(torch.tensor([0.0, 0.4]))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (2, 48), generator=gen).to(DEVICE)
    tgt = torch.randint(0, 64, (2, 48), generator=gen).to(DEVICE)
    ds = random_doc_start(2, 48, gen, p=0.1).to(DEVICE)

    def loss_and_grads():
        net.zero_grad(set_to_none=True)
        _, loss = net(idx, tgt, doc_start=ds)
        loss.backward()
        return loss.item(), {
            n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None
        }

    loss_ref, g_ref = loss_and_grads()
    used = []

    def forced(*a, **kw):
        used.append(1)
        return attention(*a, **{**kw, "impl": "triton"})

    monkeypatch.setattr(model_mod, "attention", forced)
    old = ak.INTERPRET_BLOCKS
    ak.INTERPRET_BLOCKS = (16, 16)
    try:
        loss_k, g_k = loss_and_grads()
    finally:
        ak.INTERPRET_BLOCKS = old
    assert len(used) == cfg.n_layer
    assert math.isclose(loss_k, loss_ref, rel_tol=1e-5)
    assert set(g_k) == set(g_ref)
    for n in g_ref:
        assert rel_err(g_k[n], g_ref[n]) < 2e-3, n


@pytest.mark.parametrize("pos_encoding", ["bam", "rope"])
def test_model_qkv_reach_the_kernel_without_a_copy(monkeypatch, pos_encoding):
    """The model's q, k, v (projections seen through .transpose(1, 2), RoPE's rotation, the KV
    cache's views) and autograd's dO are in the layout the kernels read: no copy."""
    import model as model_mod

    cfg = model_mod.GPTConfig(
        vocab_size=64, n_layer=1, n_head=2, n_embd=32, block_size=16, pos_encoding=pos_encoding
    )
    torch.manual_seed(0)
    net = model_mod.GPT(cfg, attn_impl="triton").to(DEVICE)
    layout = ak._model_layout
    copied = []

    def recording(x, dense=True):
        out = layout(x, dense)
        copied.append(out is not x)
        return out

    monkeypatch.setattr(ak, "_model_layout", recording)
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (16, 16))
    idx = torch.randint(0, 64, (2, 16)).to(DEVICE)
    _, loss = net(idx, idx)
    loss.backward()
    net.generate(idx[:1, :8], max_new_tokens=3)
    # q, k, v of the forward, the backward's dO, q, k, v of the prefill and of both decoding steps
    assert len(copied) >= 3 + 1 + 3 * 3 and not any(copied), copied


# --------------------------------------------------------------------------- every registered prior
def tanh_prior(d, theta_p, theta_q):
    """tests/test_priors.py's test prior, theta_p tanh(|d| / exp(theta_q)), registered here under
    its own name with the five required fields only."""
    return theta_p.float()[:, None] * torch.tanh(
        d.float().abs()[None, :] / torch.exp(theta_q.float())[:, None]
    )


TANH = register(
    Prior(
        name="test_kernel_tanh",
        fn=tanh_prior,
        params=("theta_p", "theta_q"),
        init=lambda spec, n_head: (torch.zeros(n_head), torch.zeros(n_head)),
        trainable=("theta_p", "theta_q"),
    )
)


def dense_tanh(q, k, v, prior, doc_start, row_scale, scale_prior, q_offset):
    """The tanh prior's attention written out from its formula, independently of the registry and
    attention_kernel."""
    theta_p, theta_q = prior.params
    i, j = q_offset + torch.arange(q.shape[2]), torch.arange(k.shape[2])
    dist = (j[None, :] - i[:, None]).abs().double()
    b = theta_p.double()[:, None, None] * torch.tanh(
        dist[None] / theta_q.double().exp()[:, None, None]
    )
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[3])
    r = row_scale.double()[..., None]
    s = (logits + b) * r if scale_prior else logits * r + b
    visible = (j[None, None, :] <= i[None, :, None]) & (
        j[None, None, :] >= doc_start[:, i][:, :, None]
    )
    return torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ v.double()


# name: (per-head parameters, trained); ggd with theta_beta < 0 (lp(mu) about -3e7) and mu != 0
PRIOR_PARAMS = {
    "ggd": (([0.1, -0.3], [-1.5, 0.7], [0.0, 0.3]), True),
    "alibi": ((alibi_slopes(2).tolist(),), False),  # fixed slopes: no derivative table
    "cauchy": (([1.0, -0.5], [0.0, 1.2]), True),
    "test_kernel_tanh": (([-2.0, 1.5], [0.0, 1.0]), True),
}


@pytest.mark.parametrize("scale_prior", [True, False])
@pytest.mark.parametrize("name", list(PRIOR_PARAMS))
def test_kernel_every_prior_matches_dense_formula(name, scale_prior, monkeypatch):
    """The kernel reads any prior from its tables: values and every gradient (q, k, v, each prior
    parameter, row_scale) match dense_attention in float64 (the tanh prior: its own formula), with
    documents, SSMax in both placements and q_offset; for ggd and the tanh prior a second backward
    pass is bitwise equal to the first."""
    values, trained = PRIOR_PARAMS[name]
    passes = 2 if name in ("ggd", TANH.name) else 1
    check_against_dense_formula(name, values, trained, scale_prior, passes, 1e-4, monkeypatch)


# ggd's (theta_alpha, theta_beta, theta_mu) per head, with log-priors below priors.LOG_PRIOR_FLOOR
FLOORED = {
    "beta_negative": ([0.0, 1.0], [-1.5, -3.0], [0.0, 0.0]),  # lp(0) = -3e7 and -2.7e15
    "extreme_alpha": ([8.0, 6.0], [1.0, 2.0], [0.0, -0.3]),  # 3e3 |d| and 400 (d - mu)^2
}


# extreme_alpha: the probability of most rows sits on one key whose log-prior is about -61 (head 1).
# The dense formula's dk and prior gradients are then ~0, and the kernel's are fp32 rounding of
# dS = P (dP - Delta) on such rows (P = 1 - 1e-7, not 1), times the tables' size: up to 1e-6 in dk
# and 0.5 of the floor in d theta_mu with scale_prior. A known gap. Not strict: whether that
# rounding crosses the tolerance depends on the CPU (on some it stays within and the case passes).
FLOORED_CASES = [
    pytest.param(
        n,
        marks=pytest.mark.xfail(reason="fp32 rounding of dS on rows where P is one-hot"),
    )
    if n == "extreme_alpha"
    else n
    for n in FLOORED
]


@pytest.mark.parametrize("scale_prior", [True, False])
@pytest.mark.parametrize("name", FLOORED_CASES)
def test_kernel_floored_prior_matches_dense_formula(name, scale_prior, monkeypatch):
    """Where the floor bites (theta_beta < 0, extreme theta_alpha, a document of length 1): the
    kernel's values and every gradient match the dense formula in float64, and a second backward
    pass is bitwise equal. With theta_alpha = 8 each row's own key takes all the probability: dq is
    ~0 in the dense formula, and the kernel's is fp32 rounding noise of dP - Delta (~1e-6), which
    rel_err compares absolutely (grad_tol 1e-3, as for check_against_reference)."""
    check_against_dense_formula("ggd", FLOORED[name], True, scale_prior, 2, 1e-3, monkeypatch)


def check_against_dense_formula(name, values, trained, scale_prior, passes, grad_tol, monkeypatch):
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (16, 16))
    gen = torch.Generator().manual_seed(len(name))
    B, H, Tq, Tk, D, q_offset = 2, 2, 24, 40, 16, 10
    q, k, v = (torch.randn(B, H, t, D, generator=gen) for t in (Tq, Tk, Tk))
    ds = torch.zeros(B, Tk, dtype=torch.long)
    # documents start at 13 and 27 in row 0, at 20 and 21 in row 1: query 20 there is a one-key
    # document
    for row, start in ((0, 13), (0, 27), (1, 20), (1, 21)):
        ds[row, start:] = start
    leaves = [
        t.to(DEVICE).requires_grad_() for t in (q, k, v, torch.rand(B, H, Tq, generator=gen) + 0.5)
    ]
    params = [torch.tensor(p, device=DEVICE, requires_grad=trained) for p in values]
    kw = dict(
        doc_start=ds.to(DEVICE), row_scale=leaves[3], scale_prior=scale_prior, q_offset=q_offset
    )
    prior = BoundPrior(get_prior(name), tuple(params))
    wrt = leaves + (params if trained else [])
    ref = (
        dense_tanh(*leaves[:3], prior, **kw)
        if name == TANH.name
        else dense_attention(*leaves[:3], prior=prior, **kw)
    )
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    ref_grads = torch.autograd.grad((ref * dout).sum(), wrt)
    out = attention(*leaves[:3], prior=prior, **kw, impl="triton")
    assert rel_err(out.double(), ref) < 1e-5
    grads = [
        torch.autograd.grad((out.double() * dout).sum(), wrt, retain_graph=True)
        for _ in range(passes)
    ]
    for i, (g, *again) in enumerate(zip(*grads)):
        assert all(torch.equal(g, g2) for g2 in again), i
        assert rel_err(g.double(), ref_grads[i]) < grad_tol, (i, rel_err(g.double(), ref_grads[i]))


def log_distance_prior(d, theta_c, theta_w):
    """-softplus(theta_c) log(1 + |d| exp(theta_w)): registered below with the five required fields
    only."""
    c, w = (torch.nn.functional.softplus(theta_c.float())[:, None], theta_w.float().exp()[:, None])
    return -c * torch.log1p(d.float().abs()[None, :] * w)


MINIMAL = register(
    Prior(
        name="test_kernel_log_distance",
        fn=log_distance_prior,
        params=("theta_c", "theta_w"),
        init=lambda spec, n_head: (torch.zeros(n_head), torch.zeros(n_head)),
        trainable=("theta_c", "theta_w"),
    )
)


def test_kernel_minimal_prior_trains_like_reference(monkeypatch):
    """A prior registered with only (name, fn, params, init, trainable) trains through a GPT on the
    kernel: the losses and the prior's parameters after three SGD steps are the reference's."""
    import model as model_mod

    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (16, 16))
    gen = torch.Generator().manual_seed(2)
    idx, tgt = (torch.randint(0, 64, (2, 32), generator=gen).to(DEVICE) for _ in range(2))
    ds = random_doc_start(2, 32, gen, p=0.1).to(DEVICE)
    runs = {}
    for impl in ("torch", "triton"):
        torch.manual_seed(0)
        net = model_mod.GPT(
            model_mod.GPTConfig(
                vocab_size=64,
                n_layer=1,
                n_head=2,
                n_embd=32,
                block_size=32,
                prior=MINIMAL.name,
            ),
            attn_impl=impl,
        ).to(DEVICE)
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            _, loss = net(idx, tgt, doc_start=ds)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[impl] = (
            losses,
            {n: p.detach().clone() for n, p in net.named_parameters() if ".theta_" in n},
        )
    (loss_ref, p_ref), (loss_k, p_k) = runs["torch"], runs["triton"]
    # trained
    assert len(p_ref) == 2
    assert all(not torch.equal(t, torch.zeros_like(t)) for t in p_ref.values())
    assert loss_k == pytest.approx(loss_ref, rel=1e-5)
    for n in p_ref:
        assert rel_err(p_k[n], p_ref[n]) < 1e-4, n


@pytest.mark.skipif(
    DEVICE != "cuda", reason="times the compiled kernel: a GPU only (bash dev/gpu_check.sh)"
)
def test_kernel_speed_of_every_prior_is_that_of_its_tables():
    """ggd, cauchy and the tanh prior with two trained parameters each launch the same compiled
    kernels (the prior is only tables): bf16 forward + backward within 15% of GGD's time. Prints the
    times (gpu_check.sh's log)."""
    from triton.testing import do_bench

    B, H, T, D = 4, 16, 4096, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(B, H, T, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    leaves = [
        t.requires_grad_()
        for t in (q, k, v, torch.rand(1, H, T, device="cuda", generator=gen) + 0.5)
    ]
    trained = {
        "ggd": ((0.0, True), (0.5, True), (0.0, False)),
        "cauchy": ((1.0, True), (2.0, True)),
        TANH.name: ((-1.0, True), (2.0, True)),
    }
    ms = {}
    for name, spec in trained.items():
        params = tuple(torch.full((H,), x, device="cuda", requires_grad=g) for x, g in spec)
        prior = BoundPrior(get_prior(name), params)

        def step(prior=prior):
            out = attention(
                *leaves[:3], prior=prior, row_scale=leaves[3], scale_prior=True, impl="triton"
            )
            out.backward(dout)

        ms[name] = do_bench(step, rep=300)
    print(
        "fwd+bwd ms at B4 H16 T4096 D64 bf16, BAM + SSMax:", {n: round(t, 3) for n, t in ms.items()}
    )
    assert all(t < 1.15 * ms["ggd"] for t in ms.values()), ms


def test_no_jit_kernel_takes_more_than_40_parameters():
    """Contiguous inputs and strides derived in the kernel keep every signature short."""
    import ast

    source = open(ak.__file__).read()
    counts = {
        node.name: len(node.args.args) + len(node.args.kwonlyargs)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    }
    assert len(counts) >= 4 and max(counts.values()) <= 40, counts
