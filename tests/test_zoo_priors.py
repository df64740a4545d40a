"""The published biases in priors.py (KERPLE's two kernels, T5's buckets, Sandwich, the MLP of
the distance): each against its formula written out independently here in float64, on every impl
(torch, sdpa without gradients, the kernel under Triton's interpreter), values and every gradient;
their inits and constraints as the papers give them.

The Triton cases run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); their
names contain "kernel" so that `pytest -k kernel` selects them.
"""

import functools
import math

import pytest
import torch
from test_priors import dense_reference  # the dense attention of any log-prior

from attention import attention, impl_error
from priors import BoundPrior, get_prior

ZOO = ("kerple_log", "kerple_power", "t5_bucket", "sandwich", "mlp")


# ---- the formulas, from the papers, in float64 ---------------------------------------------------
def softplus(x):
    return torch.log1p(torch.exp(x))


def t5_bucket_of(n, n_buckets=32, max_distance=128):
    """T5's unidirectional bucket of n = i - j >= 0 keys back, one integer at a time."""
    exact = n_buckets // 2
    if n < exact:
        return n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (n_buckets - exact))
    return min(far, n_buckets - 1)


def dense_log_prior(name, dist, params):
    """(H, Tq, Tk) float64 log-prior at the distances |j - i| (Tq, Tk) >= 0, differentiable in
    params."""
    if name == "kerple_log":
        r1, r2 = (softplus(t.double())[:, None, None] for t in params)
        return -r1 * torch.log(1 + r2 * dist)
    if name == "kerple_power":
        r1 = softplus(params[0].double())[:, None, None]
        r2 = 2 / (1 + torch.exp(-params[1].double()))[:, None, None]
        return torch.where(dist > 0, -r1 * dist.clamp_min(1) ** r2, 0.0 * r1)
    if name == "t5_bucket":
        (values,) = params
        buckets = torch.tensor([[t5_bucket_of(int(n)) for n in row] for row in dist])
        return values.double()[:, buckets]
    if name == "sandwich":
        (scale,) = params
        inner = sum(torch.cos(dist * 10000.0 ** (-2 * k / 128)) for k in range(1, 65)) - 64
        return inner[None] / scale.double()[:, None, None]
    if name == "mlp":
        w1, b1, w2 = (t.double() for t in params)
        u = torch.log(1 + dist)[..., None]  # (Tq, Tk, 1)
        pre = u * w1 + b1
        hidden = pre / (1 + torch.exp(-pre))  # silu
        return torch.einsum("hw,qkw->hqk", w2, hidden)
    raise KeyError(name)


def parameters(name, H, gen):
    """Values away from any special point: random per head, T5's buckets and the MLP's readout
    non-zero."""
    prior = get_prior(name)
    torch.manual_seed(3)
    values = [t.clone() for t in prior.initial("default", H)]
    if name == "t5_bucket":
        values[0] = torch.randn(values[0].shape, generator=gen)
    return values


def impl_cases():
    cases = [("torch", True), ("sdpa", False)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if impl_error("triton", None, device, True) is None:
        cases.append(("triton_kernel", True))
    return cases


@pytest.mark.parametrize("impl,trains", impl_cases())
@pytest.mark.parametrize("name", ZOO)
def test_every_impl_computes_the_formula(name, impl, trains):
    """Documents, SSMax with the prior scaled, q_offset; every gradient (the prior's trained
    parameters too: per head, T5's rows of buckets, the MLP's shared hidden layer)."""
    dev = "cuda" if torch.cuda.is_available() and impl != "sdpa" else "cpu"
    gen = torch.Generator().manual_seed(11)
    B, H, Tq, Tk, D, q_offset = 1, 2, 10, 20, 16, 10
    q, k, v = (torch.randn(B, H, t, D, generator=gen) for t in (Tq, Tk, Tk))
    ds = torch.zeros(B, Tk, dtype=torch.long)
    ds[0, 9:] = 9
    pos = torch.arange(Tk)
    rs = 0.8 * torch.log((pos - ds + 1).float())[:, None, q_offset:].expand(B, H, Tq).contiguous()
    prior = get_prior(name)
    values = parameters(name, H, gen)
    trained = [n in prior.trainable for n in prior.params]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rs)]
    param_leaves = [t.clone().requires_grad_(g) for t, g in zip(values, trained)]
    log_prior = functools.partial(dense_log_prior, name, params=param_leaves)
    ref = dense_reference(*leaves[:3], ds, log_prior, leaves[3], True, q_offset)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    wanted = leaves + [t for t in param_leaves if t.requires_grad]
    ref_grads = torch.autograd.grad((ref * dout).sum(), wanted)

    mine = [t.detach().to(dev).requires_grad_(True) for t in leaves]
    my_params = [t.detach().to(dev).requires_grad_(g) for t, g in zip(values, trained)]

    def call():
        return attention(
            *mine[:3],
            doc_start=ds.to(dev),
            prior=BoundPrior(prior, tuple(my_params)),
            row_scale=mine[3],
            scale_prior=True,
            q_offset=q_offset,
            impl=impl.replace("_kernel", ""),
        )

    if not trains or not prior.trainable:
        with torch.no_grad():
            out = call()
        torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
        if not trains and prior.trainable:
            with pytest.raises(ValueError, match="cannot train a prior"):
                call()
        if not trains:
            return
    out = call()
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    mine_wanted = mine + [t for t in my_params if t.requires_grad]
    grads = torch.autograd.grad((out.double() * dout.to(dev)).sum(), mine_wanted)
    names = ["q", "k", "v", "row_scale"] + [n for n, g in zip(prior.params, trained) if g]
    for label, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(
            g.double().cpu(), r.double(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{label}: {m}"
        )


def test_tables_match_the_formulas_far_past_the_training_length():
    """The registered fn against the formula at distances to 10^5, for random parameters."""
    d = -torch.tensor([0, 1, 2, 7, 15, 16, 17, 31, 64, 127, 128, 129, 1000, 4096, 100_000])
    gen = torch.Generator().manual_seed(5)
    for name in ZOO:
        values = parameters(name, 3, gen)
        table = get_prior(name).fn(d, *values).double()
        expect = dense_log_prior(name, d.abs().double()[None, :], values)[:, 0]
        torch.testing.assert_close(table, expect, rtol=1e-5, atol=1e-4, msg=name)


def test_t5_buckets_are_t5s():
    """Exact below 16 keys back, log-spaced to 128, one bucket for everything beyond."""
    get_prior("t5_bucket")
    from priors import t5_buckets

    n = torch.arange(0, 3000)
    assert t5_buckets(-n).tolist() == [t5_bucket_of(int(x)) for x in n]
    assert t5_buckets(-torch.tensor([0, 15, 16, 20, 127, 128, 10**6])).tolist() == [
        0,
        15,
        16,
        17,
        31,
        31,
        31,
    ]


def test_inits_and_constraints_are_the_papers():
    """KERPLE: r1 ~ U(0, 2), r2 ~ U(0, 1) (log); r1 ~ U(0, 1), r2 ~ U(0, 2) (power), at least its
    eps, positive (and r2 < 2) for any parameter value; T5's 32 buckets; Sandwich's 8h/H; the MLP's
    nn.Linear bounds, its hidden layer shared."""
    H = 64
    torch.manual_seed(0)
    r1, r2 = (softplus(t.double()) for t in get_prior("kerple_log").initial("default", H))
    assert 0.01 - 1e-6 <= r1.min() and r1.max() <= 2 and r1.max() > 1.5
    assert 0.01 - 1e-6 <= r2.min() and r2.max() <= 1 and r2.max() > 0.75
    t1, t2 = get_prior("kerple_power").initial("default", H)
    p1, p2 = softplus(t1.double()), 2 * torch.sigmoid(t2.double())
    assert 0.01 - 1e-6 <= p1.min() and p1.max() <= 1
    assert 0.01 - 1e-6 <= p2.min() and p2.max() < 2 and p2.max() > 1.5
    extreme = torch.tensor([-60.0, 60.0])
    d = -torch.arange(0, 50)
    for name in ("kerple_log", "kerple_power"):
        table = get_prior(name).fn(d, extreme, extreme)
        assert torch.isfinite(table).all() and (table <= 0).all()

    (buckets,) = get_prior("t5_bucket").initial("default", H)
    assert buckets.shape == (H, 32) and not buckets.any()
    (scale,) = get_prior("sandwich").initial("default", 8)
    assert scale.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    w1, b1, w2 = get_prior("mlp").initial("default", H)
    assert w1.shape == b1.shape == (8,) and w2.shape == (H, 8)
    assert w1.abs().max() <= 1 and w2.abs().max() <= 1 / math.sqrt(8)
    assert get_prior("mlp").shared == ("w1", "b1")
    with pytest.raises(ValueError, match="R1 > 0"):
        get_prior("kerple_log").initial("-1,1", 2)


def test_power_kernel_gradient_is_finite_at_distance_zero():
    theta = torch.zeros(2, requires_grad=True)
    table = get_prior("kerple_power").fn(torch.arange(-3, 1), theta, theta)
    (grad,) = torch.autograd.grad(table.sum(), theta)
    assert torch.isfinite(grad).all()


# ---- the kernel's gradient by diagonal (many derivative tables) ---------------------------------
def kernel_grads(prior, values, blocks, monkeypatch, doc_len=None, diagonal_from=None):
    """Output and every gradient of the kernel (under the interpreter) with tiles `blocks`."""
    ak = pytest.importorskip("attention_kernel")
    if impl_error("triton", None, "cpu", True) is not None:
        pytest.skip("the kernel needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", blocks)
    if diagonal_from is not None:
        monkeypatch.setattr(ak, "DIAGONAL_FROM", diagonal_from)
    gen = torch.Generator().manual_seed(2)
    B, H, T, D = 2, 2, 40, 16
    q, k, v, dout = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))
    pos = torch.arange(T)
    ds = torch.zeros(B, T, dtype=torch.long)
    ds[1, 17:] = 17
    if doc_len is not None:  # every document doc_len long
        ds = (pos - pos % doc_len).expand(B, T).contiguous()
    rs = (0.7 * torch.log((pos - ds + 1).float()))[:, None].expand(B, H, T).contiguous()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rs)]
    params = [t.clone().requires_grad_(n in prior.trainable) for n, t in zip(prior.params, values)]
    out = attention(
        *leaves[:3],
        doc_start=ds,
        prior=BoundPrior(prior, tuple(params)),
        row_scale=leaves[3],
        scale_prior=True,
        impl="triton",
    )
    wanted = leaves + [t for t in params if t.requires_grad]
    return out, torch.autograd.grad((out * dout).sum(), wanted)


def test_kernel_gradient_by_diagonal_matches_per_score(monkeypatch):
    """T5's 32 buckets take the per-diagonal path; forced off, the per-score path gives the same
    values and gradients (stacked tiles, BLOCK_M = 2 BLOCK_N); two backward passes are bitwise
    equal."""
    gen = torch.Generator().manual_seed(8)
    prior = get_prior("t5_bucket")
    values = [torch.randn(2, 32, generator=gen)]
    import attention_kernel as ak

    assert ak._grad_plan(32, False).BY_DIAGONAL and not ak._grad_plan(2, False).BY_DIAGONAL
    out, grads = kernel_grads(prior, values, (32, 16), monkeypatch)
    again = kernel_grads(prior, values, (32, 16), monkeypatch)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    per_score = kernel_grads(prior, values, (32, 16), monkeypatch, diagonal_from=10**6)[1]
    for a, b in zip(grads, per_score):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 16)])
def test_kernel_gradient_by_diagonal_of_ggd(blocks, monkeypatch):
    """GGD's two tables forced through the per-diagonal path: what the per-score path gives."""
    ggd = get_prior("ggd")
    values = [torch.tensor([0.3, -1.0]), torch.tensor([0.7, -0.4]), torch.zeros(2)]
    by_diagonal = kernel_grads(ggd, values, blocks, monkeypatch, diagonal_from=1)[1]
    by_score = kernel_grads(ggd, values, blocks, monkeypatch)[1]
    for a, b in zip(by_diagonal, by_score):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_gradient_by_diagonal_is_zero_where_each_query_sees_one_key(monkeypatch):
    """Documents of length 1: P = 1 whatever the prior, so the buckets' gradient is exactly 0."""
    gen = torch.Generator().manual_seed(9)
    prior = get_prior("t5_bucket")
    _, grads = kernel_grads(prior, [torch.randn(2, 32, generator=gen)], (32, 16), monkeypatch, 1)
    assert not grads[-1].any()


def test_ssmax_scales_a_learned_prior_and_leaves_a_fixed_one():
    """BAM's placement, (q.k + B) s log n, for a prior that can learn its scale back; ALiBi's,
    q.k s log n + B, for one without trained parameters (sandwich)."""
    from model import GPT, GPTConfig

    def scale_prior(name):
        cfg = GPTConfig(
            vocab_size=64, n_layer=1, n_head=2, n_embd=16, prior=name, bam_init="default"
        )
        return GPT(cfg).blocks[0].attn.scale_prior

    assert [scale_prior(n) for n in ("ggd", "kerple_log", "t5_bucket", "sandwich")] == [
        True,
        True,
        True,
        False,
    ]
