"""The prior registry (priors.py): every attention impl computes a registered prior exactly or
refuses it, ALiBi stays the Laplace prior, and checkpoints record their prior.

The Triton cases run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); their
test names contain "kernel" so that `pytest -k kernel` selects them with the other kernel tests.
"""

import math

import pytest
import torch

import attention as attention_mod
import attention_kernel as ak
import eval_passkey
import priors
from attention import attention, attention_probs, dense_attention, impl_error, pick_impl
from eval_common import EXPECTED_ERRORS
from infra.runtime import save_checkpoint
from model import GPT, CheckpointError, GPTConfig, load_model
from priors import (
    LOG_PRIOR_FLOOR,
    PRIORS,
    BoundPrior,
    Prior,
    alibi_slopes,
    bind,
    get_prior,
    register,
)


# ----------------------------------------------------------------------- a prior no other test uses
def tanh_prior(d, theta_p, theta_q):
    """theta_p * tanh(|d| / exp(theta_q)): local (theta_p < 0) or anti-local (theta_p > 0),
    bounded."""
    return theta_p.float()[:, None] * torch.tanh(
        d.float().abs()[None, :] / torch.exp(theta_q.float())[:, None]
    )


TANH = register(
    Prior(
        name="test_tanh",
        fn=tanh_prior,
        params=("theta_p", "theta_q"),
        init=lambda spec, n_head: (torch.zeros(n_head), torch.zeros(n_head)),
        trainable=("theta_p", "theta_q"),
        formula="θp tanh(|d| / exp(θq))",
        shape_param="theta_p",
    )
)


def dense_reference(q, k, v, doc_start, log_prior, row_scale, scale_prior, q_offset):
    """The whole (Tq x Tk) attention written out from the formula, independently of
    attention_kernel: log_prior(|j - i|) gives the (H, Tq, Tk) float64 log-prior from the (Tq, Tk)
    distances."""
    Tq, Tk, D = q.shape[2], k.shape[2], q.shape[3]
    i = q_offset + torch.arange(Tq)
    j = torch.arange(Tk)
    dist = (j[None, :] - i[:, None]).abs().double()  # (Tq, Tk)
    prior = log_prior(dist)
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    r = row_scale.double()[..., None]
    s = (logits + prior) * r if scale_prior else logits * r + prior
    visible = (j[None, None, :] <= i[None, :, None]) & (
        j[None, None, :] >= doc_start[:, i][:, :, None]
    )
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def tanh_reference(theta_p, theta_q):
    """tanh_prior's log-prior as dense_reference takes it."""

    def log_prior(dist):
        scale = theta_q.double().exp()[:, None, None]
        return theta_p.double()[:, None, None] * torch.tanh(dist[None] / scale)

    return log_prior


def impl_cases():
    """(impl, trains the prior) for every impl available here: torch; sdpa (evaluation only); the
    kernel."""
    cases = [("torch", True), ("sdpa", False)]
    if impl_error("triton", TANH, "cuda" if torch.cuda.is_available() else "cpu", True) is None:
        cases.append(("triton_kernel", True))
    return cases


@pytest.mark.parametrize("impl,trains", impl_cases())
@pytest.mark.parametrize("scale_prior", [True, False])
def test_every_kernel_matches_dense_formula(impl, trains, scale_prior):
    """Documents, SSMax in both placements and q_offset (the queries are not the last positions)."""
    dev = "cuda" if torch.cuda.is_available() and impl != "sdpa" else "cpu"
    gen = torch.Generator().manual_seed(7)
    B, H, Tq, Tk, D, q_offset = 2, 3, 24, 40, 16, 10
    q, k, v = (torch.randn(B, H, t, D, generator=gen) for t in (Tq, Tk, Tk))
    ds = torch.zeros(B, Tk, dtype=torch.long)
    ds[0, 13:], ds[0, 27:], ds[1, 20:] = 13, 27, 20
    theta_p, theta_q = torch.tensor([-2.0, 1.5, 0.3]), torch.tensor([0.0, 1.0, 2.5])
    pos = torch.arange(Tk)
    rs = (
        0.8
        * torch.log((pos - ds + 1).float())[:, None, q_offset : q_offset + Tq]
        .expand(B, H, Tq)
        .contiguous()
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, theta_p, theta_q, rs)]
    log_prior = tanh_reference(*leaves[3:5])
    ref = dense_reference(*leaves[:3], ds, log_prior, leaves[5], scale_prior, q_offset)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)

    mine = [t.detach().to(dev).requires_grad_(True) for t in leaves]

    def call():
        return attention(
            *mine[:3],
            doc_start=ds.to(dev),
            prior=BoundPrior(TANH, tuple(mine[3:5])),
            row_scale=mine[5],
            scale_prior=scale_prior,
            q_offset=q_offset,
            impl=impl.replace("_kernel", ""),
        )

    if not trains:  # sdpa: the forward, and impl_error's refusal where the prior needs a gradient
        with torch.no_grad():
            out = call()
        torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="cannot train a prior"):
            call()
        return
    out = call()
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad((out.double() * dout.to(dev)).sum(), mine)
    for name, g, r in zip(("q", "k", "v", "theta_p", "theta_q", "row_scale"), grads, ref_grads):
        torch.testing.assert_close(
            g.double().cpu(), r.double(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )


def test_attention_probs_are_the_reference_weights():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, t, 8, generator=gen) for t in (5, 30, 30))
    ds = torch.zeros(1, 30, dtype=torch.long)
    ds[0, 12:] = 12
    prior = BoundPrior(TANH, (torch.tensor([-1.0, 0.5, 2.0]), torch.tensor([0.0, 1.0, 2.0])))
    rs = torch.rand(1, 3, 5) + 0.5
    kw = dict(doc_start=ds, prior=prior, row_scale=rs, scale_prior=True, q_offset=20)
    p = attention_probs(q, k, **kw)
    assert p.shape == (1, 3, 5, 30) and torch.allclose(p.sum(-1), torch.ones(1, 3, 5))
    assert (p[..., :12] == 0).all() and (p[..., 25:] == 0).all()  # another document; the future
    torch.testing.assert_close(p @ v, attention(q, k, v, **kw, impl="torch"))


# ------------------------------------------------------------------------------------- the registry
def test_registry_names_and_errors():
    assert {"ggd", "alibi", "cauchy"} <= set(PRIORS) and get_prior("ggd") is PRIORS["ggd"]
    with pytest.raises(ValueError, match="unknown prior 'nope'.*ggd, alibi, cauchy"):
        get_prior("nope")
    with pytest.raises(ValueError, match="already registered"):
        register(
            Prior(
                name="ggd",
                fn=tanh_prior,
                params=("theta_p", "theta_q"),
                init=TANH.init,
                trainable=(),
            )
        )
    assert register(TANH) is TANH  # registering the same prior twice is harmless
    with pytest.raises(ValueError, match="trainable"):
        register(Prior(name="bad", fn=tanh_prior, params=("a",), init=TANH.init, trainable=("b",)))
    # the five required fields make a full prior: the figure fields get defaults derived from it
    minimal = Prior(
        name="test_minimal",
        fn=tanh_prior,
        params=("theta_p", "theta_q"),
        init=TANH.init,
        trainable=("theta_q",),
    )
    assert (
        minimal.formula == "B(d) = tanh_prior(d, theta_p, theta_q)"
        and minimal.shape_param == "theta_q"
    )
    assert (
        minimal.highlight is None
        and Prior("x", tanh_prior, ("a",), TANH.init, ()).shape_param == "a"
    )
    triple = tuple(torch.zeros(2) for _ in range(3))
    assert bind(triple).family.name == "ggd" and bind(None) is None
    with pytest.raises(TypeError):
        bind((torch.zeros(2), torch.zeros(2)))


def test_cauchy_prior_formula():
    d = torch.arange(-6, 1)
    table = get_prior("cauchy").fn(d, torch.tensor([1.0, 0.7, 0.0]), torch.tensor([0.0, 1.2, 0.5]))
    expect = torch.stack(
        [
            -torch.log(1 + d.float() ** 2),
            -0.7 * torch.log(1 + (d.float() / math.exp(1.2)) ** 2),
            torch.zeros(len(d)),
        ]
    )  # theta_a = 0 is flat: the 'zero' init starts as NoPE
    torch.testing.assert_close(table, expect)
    assert get_prior("cauchy").highlight(torch.tensor([-0.1, 0.2]), torch.zeros(2)).tolist() == [
        True,
        False,
    ]


def test_alibi_prior_is_ggd_with_theta_beta_one():
    """ALiBi -m|d| is GGD with theta_beta = 1 and theta_alpha = log m, up to GGD's eps (a constant
    per head, which softmax ignores): equal tables up to that constant and equal attention, in both
    SSMax placements."""
    H = 6
    slope = alibi_slopes(H)
    alibi = BoundPrior(get_prior("alibi"), (slope,))
    ggd = (slope.log(), torch.ones(H), torch.zeros(H))
    d = torch.arange(-300, 1)
    torch.testing.assert_close(
        alibi.table(d) - bind(ggd).table(d), (slope * 1e-5)[:, None].expand(H, len(d))
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 64, 16, generator=gen) for _ in range(3))
    rs = torch.rand(1, H, 64, generator=gen) + 0.5
    for scale_prior in (False, True):
        a = attention(q, k, v, prior=alibi, row_scale=rs, scale_prior=scale_prior, impl="torch")
        b = attention(q, k, v, prior=ggd, row_scale=rs, scale_prior=scale_prior, impl="torch")
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_alibi_prior_matches_reference():
    """The kernel reads ALiBi's table like any prior's and agrees with the reference's -m|d|."""
    if not (ak.triton_available() and (torch.cuda.is_available() or ak.interpreting())):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() and not ak.interpreting() else "cpu"
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 48, 16, generator=gen).to(dev) for _ in range(3))
    ds = torch.zeros(1, 48, dtype=torch.long)
    ds[0, 30:] = 30
    alibi = BoundPrior(get_prior("alibi"), (alibi_slopes(4).to(dev),))
    kw = dict(
        doc_start=ds.to(dev),
        prior=alibi,
        row_scale=torch.rand(1, 4, 48, generator=gen).to(dev) + 0.5,
    )
    old, ak.INTERPRET_BLOCKS = ak.INTERPRET_BLOCKS, (16, 16)
    try:
        out = attention(q, k, v, **kw, impl="triton")
    finally:
        ak.INTERPRET_BLOCKS = old
    torch.testing.assert_close(out, attention(q, k, v, **kw, impl="torch"), rtol=1e-4, atol=1e-5)


def test_auto_never_substitutes_a_prior():
    q = torch.randn(1, 2, 8, 16)
    cauchy = BoundPrior(get_prior("cauchy"), (torch.ones(2), torch.zeros(2)))
    ref = attention(q, q, q, prior=cauchy, impl="torch")
    torch.testing.assert_close(attention(q, q, q, prior=cauchy, impl="auto"), ref)
    assert not torch.allclose(ref, attention(q, q, q, prior=(torch.zeros(2),) * 3, impl="torch"))


# -------------------------------------------------------------------------------------- checkpoints
def tiny(**kw):
    return GPTConfig(
        vocab_size=257, tokenizer="byte", n_layer=2, n_head=2, n_embd=16, block_size=16, **kw
    )


def test_checkpoint_records_its_prior_and_unknown_priors_fail_to_load(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(tiny(prior="test_tanh"), attn_impl="torch")
    save_checkpoint(str(tmp_path / "run" / "ckpt_0000001.pt"), model, step=1)
    loaded, ckpt = load_model(str(tmp_path / "run"), attn_impl="auto")
    assert ckpt["model_args"]["prior"] == "test_tanh" and loaded.blocks[0].attn.attn_impl == "auto"
    assert loaded.blocks[1].attn.bound_prior().family is TANH
    ckpt = torch.load(tmp_path / "run" / "ckpt_0000001.pt", weights_only=True)
    ckpt["model_args"]["prior"] = "my_unregistered_prior"
    torch.save(ckpt, tmp_path / "run" / "ckpt_0000001.pt")
    with pytest.raises(
        CheckpointError,
        match="makes no model of this code: unknown prior 'my_unregistered_prior'; registered",
    ):
        load_model(str(tmp_path / "run"))
    # what the script prints as one line `error: ...`
    with pytest.raises(EXPECTED_ERRORS) as e:
        eval_passkey.main(
            ["--ckpt", str(tmp_path / "run"), "--template", "demo", "--out", str(tmp_path / "pk")]
        )
    msg = str(e.value)
    assert "my_unregistered_prior" in msg and "\n" not in msg


def test_one_decision_point_says_which_impl_computes_what(monkeypatch):
    """impl_error: torch computes everything; sdpa is CPU-only and does not train a prior; triton
    needs CUDA (or the interpreter) and the triton package. pick_impl: "auto" is the fastest that
    can, others raise its message."""
    ggd, cauchy = get_prior("ggd"), get_prior("cauchy")
    trained = bind(tuple(torch.zeros(2, requires_grad=True) for _ in range(3)))
    fixed = BoundPrior(get_prior("alibi"), (torch.ones(2),))
    for prior in (None, ggd, cauchy, trained, fixed, TANH):
        for dev in ("cpu", "cuda", torch.device("cpu")):
            assert impl_error("torch", prior, dev, True) is None
    assert (
        impl_error("sdpa", None, "cpu", True) is None
        and impl_error("sdpa", fixed, "cpu", True) is None
    )
    assert (
        impl_error("sdpa", ggd, "cpu", False) is None
        and impl_error("sdpa", trained, "cpu", False) is None
    )
    assert "cannot train a prior" in impl_error("sdpa", ggd, "cpu", True)
    assert "cannot train a prior" in impl_error("sdpa", trained, "cpu", True)
    assert "CPU evaluation path" in impl_error("sdpa", None, "cuda", False)
    assert "unknown attention impl 'flex'" in impl_error("flex", None, "cpu", False)
    assert (
        pick_impl("auto", ggd, "cpu", False) == "sdpa"
        and pick_impl("auto", None, "cpu", True) == "torch"
    )
    with pytest.raises(ValueError, match="cannot train a prior"):
        pick_impl("sdpa", cauchy, "cpu", True)
    monkeypatch.setattr(attention_mod, "interpreting", lambda: False)
    if ak.triton_available():
        for prior in (None, ggd, cauchy, TANH):  # every registered prior
            assert impl_error("triton", prior, "cuda", True) is None
        assert pick_impl("auto", cauchy, "cuda", True) == "triton"
    assert "needs a CUDA device" in impl_error("triton", ggd, "cpu", False)
    if ak.triton_available():  # a Triton older than the kernel's: named, "auto" on a GPU too
        with monkeypatch.context() as old:
            old.setattr(ak.triton, "__version__", "3.3.1")
            for impl in ("triton", "auto"):
                assert "needs Triton 3.4 or newer, not 3.3.1" in impl_error(impl, ggd, "cuda", True)
            with pytest.raises(ValueError, match="needs Triton 3.4 or newer"):
                pick_impl("auto", ggd, "cuda", True)
            assert pick_impl("auto", ggd, "cpu", True) == "torch"
    monkeypatch.setattr(ak, "triton", None)
    assert "needs the triton package" in impl_error("triton", ggd, "cuda", False)
    assert pick_impl("auto", ggd, "cuda", True) == "torch"
    with pytest.raises(ValueError, match="needs the triton package"):
        attention(
            torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), impl="triton"
        )


# ---------------------------------------------------------------------- the floor of the log-prior
def test_floor_clamps_the_table_with_zero_derivative_below():
    """BoundPrior.table is the registry's formula clamped at LOG_PRIOR_FLOOR: a GGD prior of
    theta_beta < 0 is about -3e7 at d = mu = 0; there the table holds the floor and its derivative
    is 0, elsewhere the formula."""
    params = tuple(
        torch.tensor(x, requires_grad=True) for x in ([0.0, 0.5], [-1.5, 1.0], [0.0, 0.0])
    )
    prior = BoundPrior(get_prior("ggd"), params)
    d = torch.arange(-20000, 1)
    table = prior.table(d)
    raw = get_prior("ggd").fn(d, *params)
    below = raw < LOG_PRIOR_FLOOR
    assert below[0, -1] and below[1, :10].all() and not below[1, -1]  # d = 0; far keys
    assert torch.equal(table[below], torch.full_like(table[below], LOG_PRIOR_FLOOR))
    assert torch.equal(table[~below], raw[~below])
    grads = torch.autograd.grad(table.sum(), params[:2], retain_graph=True)
    assert all(torch.isfinite(g).all() for g in grads)
    # only floored entries: no gradient
    (floored,) = torch.autograd.grad(table[1, :10].sum(), params[1])
    (formula,) = torch.autograd.grad(raw[1, :10].sum(), params[1])
    assert torch.equal(floored, torch.zeros_like(floored)) and formula.abs().sum() > 0


# name: per-head (theta_alpha, theta_beta, theta_mu); every head has log-priors below the floor
FLOORED = {
    "beta_negative": ([0.0, 1.0], [-1.5, -3.0], [0.0, 0.0]),  # lp(0) = -3e7 and -2.7e15
    # 3e3 |d| and 400 (d - mu)^2: floored from |d| = 4 and 6
    "extreme_alpha": ([8.0, 6.0], [1.0, 2.0], [0.0, -0.3]),
}


@pytest.mark.parametrize("scale_prior", [True, False])
@pytest.mark.parametrize("name", list(FLOORED))
def test_floor_changes_no_value_or_gradient(name, scale_prior, monkeypatch):
    """The floor where it bites (theta_beta < 0, extreme theta_alpha, documents of length 1, SSMax's
    small row scales): the dense formula in float64 gives the same values and gradients (q, k, v,
    every prior parameter, row_scale) with the floor and without it (LOG_PRIOR_FLOOR = -inf): the
    floored keys had probability 0."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, D = 2, 2, 40, 16
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    ds = torch.zeros(B, T, dtype=torch.long)
    for b, start in ((0, 13), (0, 14), (0, 30), (1, 1), (1, 2), (1, 39)):  # 1-key documents
        ds[b, start:] = start
    rs = torch.rand(B, H, T, generator=gen, dtype=torch.float64) * 0.3 + 0.3  # s log n at n = 2
    leaves = [t.requires_grad_() for t in (q, k, v, rs)]
    params = [torch.tensor(p, requires_grad=True) for p in FLOORED[name]]
    prior = BoundPrior(get_prior("ggd"), tuple(params))
    raw = get_prior("ggd").fn(torch.arange(-T, 1), *params)
    assert (raw < LOG_PRIOR_FLOOR).any(dim=1).all()  # the floor bites in every head
    dout = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)

    def run():
        out = dense_attention(
            *leaves[:3], prior=prior, doc_start=ds, row_scale=leaves[3], scale_prior=scale_prior
        )
        return [out, *torch.autograd.grad((out * dout).sum(), leaves + params)]

    floored = run()
    monkeypatch.setattr(priors, "LOG_PRIOR_FLOOR", float("-inf"))
    unfloored = run()
    for i, (a, b) in enumerate(zip(floored, unfloored)):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), i
        atol = 1e-7 * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=1e-7, atol=atol, msg=f"output/gradient {i}")
