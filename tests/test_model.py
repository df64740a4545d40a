"""Model core: the attention() contract, the 10 positional-encoding variants, checkpoints,
configurator."""

import math

import pytest
import torch

from attention import (
    AttentionArgs,
    attention,
    attention_sdpa,
    attention_torch,
    dense_attention,
)
from configurator import ConfigError, configure
from infra.runtime import save_checkpoint
from model import (
    GPT,
    POS_ENCODINGS,
    CheckpointError,
    GPTConfig,
    KVCache,
    load_model,
    load_state,
)
from priors import BoundPrior, alibi_slopes, get_prior, ggd_prior

VARIANTS = [(pe, ss) for pe in POS_ENCODINGS for ss in (False, True)]


def resolved(qkv, keywords):
    """The AttentionArgs that attention() hands its implementations, for q, k, v and keywords."""
    return AttentionArgs(**keywords).resolve(*qkv[:3])


def tiny(pe="bam", ssmax=True, **kw):
    kw = dict(
        dict(vocab_size=257, n_layer=2, n_head=4, n_embd=32, block_size=16, tokenizer="byte"), **kw
    )
    return GPTConfig(pos_encoding=pe, ssmax=ssmax, **kw)


def make(cfg, seed=0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    # move the priors off their trivial init so that every test exercises a non-degenerate prior and
    # SSMax
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            a = block.attn
            if hasattr(a, "theta_beta"):
                a.theta_beta.copy_(torch.linspace(-0.8, 1.5, cfg.n_head) + 0.1 * i)
                a.theta_alpha.copy_(torch.linspace(-1.0, 0.5, cfg.n_head))
            if a.ssmax_s is not None:
                a.ssmax_s.copy_(torch.linspace(0.6, 1.4, cfg.n_head))
    return model


# --------------------------------------------------------------------------------------------------
# attention(): dense_attention (the specification) against a per-element computation written here,
# and every impl against dense_attention
# --------------------------------------------------------------------------------------------------
def test_dense_attention_is_the_formula_element_by_element():
    """out_i = sum_j softmax_j(s_ij) v_j with s_ij = (l_ij + B(j - i)) r_i or l_ij r_i + B(j - i),
    the GGD prior B(d) = -exp(a) (|d - 2 sinh(m)| + 1e-5)^b and the keys doc_start[i] <= j <= i, one
    scalar at a time."""
    gen = torch.Generator().manual_seed(4)
    B, H, Tq, Tk, D, q_offset = 2, 2, 4, 7, 3, 2
    q, k, v = (torch.randn(B, H, t, D, generator=gen, dtype=torch.float64) for t in (Tq, Tk, Tk))
    prior = (torch.tensor([-0.5, 0.3]), torch.tensor([-0.7, 1.2]), torch.tensor([0.4, 0.0]))
    row_scale = torch.rand(B, H, Tq, generator=gen, dtype=torch.float64) + 0.5
    doc_start = torch.tensor([[0, 0, 0, 3, 3, 3, 3], [0, 1, 1, 1, 1, 5, 5]])
    for scale_prior in (False, True):
        got = dense_attention(
            q,
            k,
            v,
            doc_start=doc_start,
            prior=prior,
            row_scale=row_scale,
            scale_prior=scale_prior,
            q_offset=q_offset,
            softmax_scale=0.7,
        )
        for b in range(B):
            for h in range(H):
                a, be, m = (float(t[h]) for t in prior)
                for t in range(Tq):
                    i, r = q_offset + t, float(row_scale[b, h, t])
                    scores = {}
                    for j in range(int(doc_start[b, i]), i + 1):
                        content = 0.7 * sum(float(q[b, h, t, x] * k[b, h, j, x]) for x in range(D))
                        prior_ij = -math.exp(a) * (abs(j - i - 2 * math.sinh(m)) + 1e-5) ** be
                        if scale_prior:
                            scores[j] = (content + prior_ij) * r
                        else:
                            scores[j] = content * r + prior_ij
                    z = sum(math.exp(s - max(scores.values())) for s in scores.values())
                    want = [
                        sum(
                            math.exp(s - max(scores.values())) / z * float(v[b, h, j, x])
                            for j, s in scores.items()
                        )
                        for x in range(D)
                    ]
                    torch.testing.assert_close(
                        got[b, h, t], torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5
                    )


def random_doc_start(B, T, gen):
    starts = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        bounds = sorted(torch.randperm(T - 1, generator=gen)[:3].add(1).tolist())
        for s in bounds:
            starts[b, s:] = s
    return starts


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "prior",
        "prior_neg_beta_mu",
        "ssmax",
        "ssmax_scale_prior",
        "docs",
        "q_offset",
        "everything",
    ],
)
def test_attention_matches_dense_formula(case, impl):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    B, H, Tk, D = 2, 3, 23, 8
    Tq = 9 if case in ("q_offset", "everything") else Tk
    q_offset = 7 if case in ("q_offset", "everything") else Tk - Tq
    q = torch.randn(B, H, Tq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, Tk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, Tk, D, generator=gen, dtype=torch.float64)
    prior = row_scale = doc_start = None
    scale_prior = False
    if case != "plain" and case not in ("ssmax", "docs", "q_offset"):
        prior = (torch.tensor([-0.5, 0.3, 0.0]), torch.tensor([1.0, 0.4, 2.0]), torch.zeros(3))
    if case in ("prior_neg_beta_mu", "everything"):
        prior = (
            torch.tensor([-0.5, 0.3, -2.0]),
            torch.tensor([-1.5, -0.3, 0.7]),
            torch.tensor([0.4, -0.2, 0.8]),
        )
    if case in ("ssmax", "ssmax_scale_prior", "everything"):
        row_scale = torch.rand(B, H, Tq, generator=gen, dtype=torch.float64) * 2
        scale_prior = case != "ssmax"
    if case in ("docs", "everything"):
        doc_start = random_doc_start(B, Tk, gen)
    ref = dense_attention(
        q,
        k,
        v,
        doc_start=doc_start,
        prior=prior,
        row_scale=row_scale,
        scale_prior=scale_prior,
        q_offset=q_offset,
    )
    out = attention(
        q.float(),
        k.float(),
        v.float(),
        doc_start=doc_start,
        prior=prior,
        row_scale=None if row_scale is None else row_scale.float(),
        scale_prior=scale_prior,
        q_offset=q_offset,
        impl=impl,
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scale_prior", [False, True])
@pytest.mark.parametrize("prior_name", ["ggd", "cauchy"])
def test_reference_gradients_match_dense_formula_for_every_chunking(scale_prior, prior_name):
    """impl='torch' against autograd through dense_attention: the output and the gradient of q, k,
    v, every prior parameter and row_scale, with documents, queries at an offset, a row scale per
    batch row (0 or negative on some rows) and one broadcast over the batch, and query chunks of 1,
    7 and all rows."""
    gen = torch.Generator().manual_seed(11)
    B, H, Tq, Tk, D = 3, 4, 30, 41, 8
    q, dout = (torch.randn(B, H, Tq, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, H, Tk, D, generator=gen) for _ in range(2))
    doc_start = random_doc_start(B, Tk, gen)
    family = get_prior(prior_name)
    params = [torch.randn(H, generator=gen) * 0.7 for _ in family.params]
    names = ["out", "q", "k", "v", *family.params, "row_scale"]
    for rs_batch in (B, 1):
        row_scale = torch.rand(rs_batch, H, Tq, generator=gen) * 2 - 0.2
        row_scale[:, :, 3] = 0.0
        results = {}
        for chunk in ("dense", 1, 7, None):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, *params, row_scale)]
            kw = dict(
                doc_start=doc_start,
                prior=BoundPrior(family, tuple(leaves[3:-1])),
                row_scale=leaves[-1],
                scale_prior=scale_prior,
                q_offset=6,
            )
            out = (
                dense_attention(*leaves[:3], **kw)
                if chunk == "dense"
                else attention_torch(*leaves[:3], resolved(leaves, kw), chunk_size=chunk)
            )
            results[chunk] = [out] + list(torch.autograd.grad((out * dout).sum(), leaves))
        for chunk, got in results.items():
            for name, a, b in zip(names, got, results["dense"]):
                torch.testing.assert_close(
                    a.double(),
                    b.double(),
                    atol=2e-5,
                    rtol=1e-4,
                    msg=lambda m: f"chunk {chunk} {name}: {m}",
                )


def test_reference_in_bfloat16_computes_in_fp32():
    """bf16 inputs: computed in fp32, returned in bf16, gradients in bf16, close to the fp32
    result."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 19, 8, generator=gen) for _ in range(3))
    doc_start = random_doc_start(2, 19, gen)
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_torch(*leaves, resolved(leaves, dict(doc_start=doc_start)))
        assert out.dtype == dtype
        grads.append([out] + list(torch.autograd.grad(out.float().sum(), leaves)))
    for a, b in zip(*grads):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scale_prior", [False, True])
def test_sdpa_path_matches_reference_for_every_chunking(scale_prior):
    """The fused-SDPA path (reversed keys, Hankel mask views, one reused mask buffer) against the
    reference, with documents, a row scale broadcast over the batch that is 0 or negative on some
    rows, and queries at an offset."""
    gen = torch.Generator().manual_seed(3)
    B, H, Tq, Tk, D = 3, 4, 30, 41, 8
    q = torch.randn(B, H, Tq, D, generator=gen)
    k, v = (torch.randn(B, H, Tk, D, generator=gen) for _ in range(2))
    doc_start = random_doc_start(B, Tk, gen)
    prior = (
        torch.tensor([-1.0, 0.0, 0.5, -0.2]),
        torch.tensor([-0.7, 0.0, 1.0, 2.0]),
        torch.tensor([0.0, 0.1, 0, 0]),
    )
    row_scale = torch.rand(1, H, Tq, generator=gen) * 2 - 0.2
    row_scale[:, :, 3] = 0.0
    kw = dict(
        doc_start=doc_start, prior=prior, row_scale=row_scale, scale_prior=scale_prior, q_offset=6
    )
    with torch.no_grad():
        ref = attention_torch(q, k, v, resolved((q, k, v), kw))
        for chunk in (Tq, 7, 1):
            torch.testing.assert_close(
                attention_sdpa(q, k, v, resolved((q, k, v), kw), chunk_size=chunk),
                ref,
                atol=1e-5,
                rtol=1e-4,
            )
        offset_6 = resolved((q, k, v), dict(q_offset=6))
        torch.testing.assert_close(
            attention_sdpa(q, k, v, offset_6), attention_torch(q, k, v, offset_6)
        )
        # any registered prior: the mask comes from the prior's own fn
        kw["prior"] = BoundPrior(
            get_prior("cauchy"),
            (torch.tensor([0.0, 0.5, -1.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, -1.0])),
        )
        torch.testing.assert_close(
            attention_sdpa(q, k, v, resolved((q, k, v), kw), chunk_size=7),
            attention_torch(q, k, v, resolved((q, k, v), kw)),
            atol=1e-5,
            rtol=1e-4,
        )


@pytest.mark.parametrize("case", ["nope", "nope_ssmax", "alibi_ssmax", "fixed_ggd_ssmax_scaled"])
def test_sdpa_path_gradients_match_reference(case):
    """impl='sdpa' against dense_attention, values and gradients, for what it may train: q, k, v and
    SSMax's row_scale, also where it scales a fixed prior (the mask then carries row_scale's
    gradient). Documents."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, D = 2, 4, 33, 8
    q, k, v, dout = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))
    doc_start = random_doc_start(B, T, gen)
    rs = torch.rand(B, H, T, generator=gen) + 0.3
    kw = dict(doc_start=doc_start)
    if case != "nope":
        kw["row_scale"] = rs
    if case == "alibi_ssmax":
        kw["prior"] = BoundPrior(get_prior("alibi"), (alibi_slopes(H),))
    if case == "fixed_ggd_ssmax_scaled":
        kw.update(
            prior=(torch.linspace(-1, 0.5, H), torch.tensor([-0.5, 0.0, 1.0, 2.0]), torch.zeros(H)),
            scale_prior=True,
        )
    grads = []
    for impl in ("dense", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if "row_scale" in kw:
            kw["row_scale"] = rs.clone().requires_grad_()
            leaves.append(kw["row_scale"])
        out = (
            dense_attention(*leaves[:3], **kw)
            if impl == "dense"
            else attention(*leaves[:3], **kw, impl=impl)
        )
        grads.append([out] + list(torch.autograd.grad((out * dout).sum(), leaves)))
    for a, b in zip(*grads):
        torch.testing.assert_close(b.double(), a.double(), atol=1e-5, rtol=1e-4)
    trained = (torch.zeros(H, requires_grad=True), torch.zeros(H), torch.zeros(H))
    with pytest.raises(ValueError, match="cannot train a prior"):
        attention(q, k, v, prior=trained, impl="sdpa")


def test_prior_is_finite_for_negative_beta_at_distance_zero():
    b = ggd_prior(
        torch.arange(-5, 1), torch.tensor([0.0]), torch.tensor([-1.5]), torch.tensor([0.0])
    )
    # anti-local: d=0 is most penalised
    assert torch.isfinite(b).all() and b[0, -1] < -1e6 and b[0, 0] > -1


def test_alibi_slopes_match_reference_values():
    torch.testing.assert_close(
        alibi_slopes(16), torch.tensor([2 ** (-k / 2) for k in range(1, 17)])
    )
    torch.testing.assert_close(
        alibi_slopes(32), torch.tensor([2 ** (-k / 4) for k in range(1, 33)])
    )
    s24 = alibi_slopes(24)
    torch.testing.assert_close(s24[:16], alibi_slopes(16))
    torch.testing.assert_close(
        s24[16:], torch.tensor([2 ** (-4 * (2 * j + 1) / 16) for j in range(8)])
    )
    assert abs(s24[16].item() - 0.8409) < 1e-4 and abs(s24[-1].item() - 0.0743) < 1e-4


# --------------------------------------------------------------------------------------------------
# The model: every variant, causality, documents, special cases of the prior
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pe,ssmax", VARIANTS)
def test_variant_forward_backward_two_lengths(pe, ssmax):
    model = make(tiny(pe, ssmax))
    for T in (16, 5):
        model.zero_grad()
        idx = torch.randint(0, 257, (2, T))
        doc_start = torch.zeros(2, T, dtype=torch.long)
        doc_start[1, T // 2 :] = T // 2
        _, loss = model(idx, idx, doc_start=doc_start)
        assert torch.isfinite(loss)
        loss.backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if pe == "bam":
            g = model.blocks[0].attn.theta_beta.grad
            assert g.abs().sum() > 0 and model.blocks[0].attn.theta_alpha.grad.abs().sum() > 0
        if ssmax:
            assert model.blocks[0].attn.ssmax_s.grad.abs().sum() > 0


@pytest.mark.parametrize("pe,ssmax", VARIANTS)
def test_variant_runs_at_8x_block_size(pe, ssmax):
    cfg = tiny(pe, ssmax)
    model = make(cfg).eval()
    with torch.no_grad():
        logits, _ = model(torch.randint(0, 257, (1, 8 * cfg.block_size)), logits_at=4)
    assert logits.shape == (1, 4, cfg.padded_vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "pe,ssmax", [("rope", True), ("bam", True), ("sinusoidal", False), ("alibi", True)]
)
def test_causality(pe, ssmax):
    model = make(tiny(pe, ssmax)).eval()
    idx = torch.randint(0, 257, (1, 20))
    changed = idx.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 257
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("pe", ["bam", "nope", "alibi"])
def test_document_isolation_and_ssmax_restart(pe):
    """A document's logits depend neither on the previous document's tokens nor on where it starts
    in the window: SSMax's n restarts at the document start, and bam/alibi/nope only see relative
    distances."""
    model = make(tiny(pe, True)).eval()
    doc = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        alone, _ = model(doc)
        for prefix_len in (3, 7):
            x = torch.cat([torch.randint(0, 257, (1, prefix_len)), doc], dim=1)
            doc_start = torch.zeros_like(x)
            doc_start[:, prefix_len:] = prefix_len
            packed, _ = model(x, doc_start=doc_start)
            torch.testing.assert_close(packed[:, prefix_len:], alone, atol=1e-5, rtol=1e-5)


def test_document_isolation_with_absolute_positions():
    """rope (positions not reset, as the authors did): the previous document's *tokens* still don't
    matter."""
    model = make(tiny("rope", True)).eval()
    doc_start = torch.zeros(1, 16, dtype=torch.long)
    doc_start[:, 6:] = 6
    a = torch.randint(0, 257, (1, 16))
    b = a.clone()
    b[:, :6] = torch.randint(0, 257, (1, 6))
    with torch.no_grad():
        la, _ = model(a, doc_start=doc_start)
        lb, _ = model(b, doc_start=doc_start)
    torch.testing.assert_close(la[:, 6:], lb[:, 6:])


def _copy_weights(src, dst):
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    assert all(".theta_" in k for k in missing + unexpected)


@pytest.mark.parametrize("ssmax", [False, True])
def test_bam_with_beta_one_and_log_slope_is_alibi(ssmax):
    alibi = make(tiny("alibi", ssmax)).eval()
    # ALiBi+SSMax leaves B unscaled
    bam = GPT(tiny("bam", ssmax, bam_init="alibi", scale_prior=not ssmax)).eval()
    _copy_weights(alibi, bam)
    idx = torch.randint(0, 257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(bam(idx)[0], alibi(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ssmax", [False, True])
def test_bam_with_beta_zero_is_nope(ssmax):
    nope = make(tiny("nope", ssmax)).eval()
    bam = GPT(
        tiny("bam", ssmax, bam_init="0.7,0")
    ).eval()  # constant prior -exp(0.7): a uniform prior
    _copy_weights(nope, bam)
    idx = torch.randint(0, 257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(bam(idx)[0], nope(idx)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pe,ssmax", VARIANTS)
def test_kv_cache_decoding_equals_full_forward(pe, ssmax):
    model = make(tiny(pe, ssmax)).eval()
    idx = torch.randint(0, 257, (1, 21))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config.n_layer, 21)
        steps = [model(idx[:, :13], kv_cache=cache)[0]]  # prefill, then one token at a time
        steps += [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(13, 21)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generate_greedy_matches_argmax_of_full_forward():
    model = make(tiny("bam", True)).eval()
    prompt = torch.randint(0, 257, (1, 10))
    out = model.generate(prompt, 6)
    seq = prompt
    with torch.no_grad():
        for tok in out:
            # never a padded id
            logits = model(seq)[0][0, -1, : model.config.vocab_size]
            assert int(logits.argmax()) == tok
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)


def test_logits_at_and_per_token_loss():
    model = make(tiny("bam", True)).eval()
    idx = torch.randint(0, 257, (2, 30))
    with torch.no_grad():
        full, mean_loss = model(idx[:, :-1], idx[:, 1:])
        last, _ = model(idx[:, :-1], logits_at=3)
        picked, _ = model(idx[:, :-1], logits_at=torch.tensor([0, 5]))
        _, per_token = model(idx[:, :-1], idx[:, 1:], reduction="none")
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(picked, full[:, [0, 5]])
    assert per_token.shape == (2, 29)
    torch.testing.assert_close(per_token.mean(), mean_loss)
    torch.testing.assert_close(
        model._token_losses(model.norm(model.wte(idx[:, :-1])), idx[:, 1:], 7),
        model._token_losses(model.norm(model.wte(idx[:, :-1])), idx[:, 1:]),
    )


# --------------------------------------------------------------------------------------------------
# Sizes, parameter counts, checkpoints, inspection
# --------------------------------------------------------------------------------------------------
def test_l12_parameter_count_matches_closed_form():
    cfg = GPTConfig(n_layer=12, n_embd=768, n_head=16, vocab_size=50257)
    with torch.device("meta"):
        model = GPT(cfg)
    V = 50304  # gpt2's 50257 padded to a multiple of 64
    D = 768
    L = 12
    # 2VD + L(4D^2 + 3*D*2D + 2D) + D
    closed_form = 2 * V * D + L * (4 * D * D + 3 * D * 2 * D + 2 * D) + D
    groups = model.param_groups()
    backbone = sum(
        p.numel() for n, p in model.named_parameters() if ".theta_" not in n and "ssmax_s" not in n
    )
    assert backbone == closed_form
    assert (
        sum(p.numel() for p in groups["prior"]) == 384 == 2 * 16 * 12
    )  # theta_alpha, theta_beta trainable
    assert sum(p.numel() for p in groups["ssmax"]) == 192
    assert (
        sum(p.numel() for n, p in model.named_parameters() if n.endswith("theta_mu")) == 192
    )  # stored, frozen


def test_train_mu_makes_mu_trainable():
    model = GPT(tiny("bam", True, train_mu=True))
    assert sum(p.numel() for p in model.param_groups()["prior"]) == 3 * 4 * 2


def test_optimizer_groups_weight_decay():
    model = GPT(tiny("bam", True))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), prior_lr=1e-2)
    by_wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert by_wd[id(p)] == (0.1 if p.dim() >= 2 else 0.0), name
    prior_group = [
        g
        for g in opt.param_groups
        if any(p is model.blocks[0].attn.theta_beta for p in g["params"])
    ]
    assert prior_group[0]["lr"] == 1e-2 and prior_group[0]["base_lr"] == 1e-2


def test_checkpoint_roundtrip_and_mismatch_errors(tmp_path):
    model = make(tiny("bam", True))
    path = str(tmp_path / "run" / "ckpt_0000007.pt")
    save_checkpoint(path, model, step=7)
    assert not [f for f in (tmp_path / "run").iterdir() if ".tmp" in f.name]  # written atomically
    # a run directory resolves to its newest checkpoint
    loaded, ckpt = load_model(str(tmp_path / "run"))
    assert ckpt["step"] == 7
    idx = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], model.eval()(idx)[0])
    # how attention is computed is the caller's choice, never the checkpoint's
    assert "attn_impl" not in ckpt["model_args"]
    assert load_model(path, attn_impl="torch")[0].blocks[0].attn.attn_impl == "torch"
    assert load_model(path)[0].blocks[0].attn.attn_impl == "auto"
    other = GPT(tiny("rope", False))
    with pytest.raises(ValueError, match="pos_encoding: 'bam' vs 'rope'"):
        load_state(other, ckpt)
    # a checkpoint whose settings this code does not know is refused, not converted
    ckpt["model_args"]["attn_impl"] = "an impl of another version"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError, match=r"other model settings .* unknown \['attn_impl'\]"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="could not read checkpoint"):
        load_model(str(tmp_path / "bad.pt"))


def test_prior_record_gives_the_shape_per_layer():
    model = make(tiny("bam", True))
    record = model.prior_record()
    assert len(record["theta_beta"]) == 2 and record["theta_beta"][0][0] == pytest.approx(-0.8)
    assert all(lo <= median <= hi for lo, median, hi in record["theta_beta"])
    assert record["heads_highlighted"] == int(
        sum((b.attn.theta_beta < 0).sum() for b in model.blocks)
    )
    assert GPT(tiny("rope", False)).prior_record() == {}
    assert GPT(tiny("alibi", False)).prior_record() == {}


def test_bad_config_values_fail_clearly():
    with pytest.raises(ValueError, match="pos_encoding must be one of"):
        tiny("xpos")
    with pytest.raises(ValueError, match="bam_init must be"):
        tiny("bam", bam_init="nonsense")


@pytest.mark.parametrize(
    "pos_encoding, ssmax, setting, value",
    [
        ("rope", False, "prior", "kerple_log"),
        ("alibi", True, "bam_init", "alibi"),
        ("nope", False, "train_mu", True),
        ("bam", True, "rope_theta", 10000.0),
        ("bam", False, "scale_prior", False),
        ("alibi", True, "scale_prior", False),
    ],
)
def test_a_setting_the_model_would_not_use_is_an_error(pos_encoding, ssmax, setting, value):
    """Changed from its default and unused by this model: refused, not silently dropped. At its
    default it is no error (the paper's recipe sets them all)."""
    with pytest.raises(ValueError, match=f"{setting}={value!r} has no effect on this model"):
        tiny(pos_encoding, ssmax, **{setting: value})
    tiny(pos_encoding, ssmax)


def test_scale_prior_is_used_only_where_a_trained_prior_meets_ssmax():
    with pytest.raises(ValueError, match="scale_prior=False has no effect"):
        tiny("bam", True, prior="sandwich", scale_prior=False)  # a fixed prior keeps its scale
    assert not GPT(tiny("bam", True, prior="sandwich")).blocks[0].attn.scale_prior
    assert GPT(tiny("bam", True)).blocks[0].attn.scale_prior
    assert not GPT(tiny("bam", True, scale_prior=False)).blocks[0].attn.scale_prior


# --------------------------------------------------------------------------------------------------
# configurator
# --------------------------------------------------------------------------------------------------
DEFAULTS = dict(
    batch_size=12,
    learning_rate=1e-3,
    pos_encoding="bam",
    ssmax=True,
    prior_lr=None,
    bam_init="zero",
)


def test_configurator_applies_file_then_overrides(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("batch_size = 4\npos_encoding = 'rope'\n")
    cfg = configure(
        DEFAULTS,
        [
            str(cfg_file),
            "--learning_rate=3",
            "--ssmax=False",
            "--prior_lr=0.01",
            "--pos_encoding=alibi",
            "--bam_init=0.5,-1",
        ],
    )
    assert cfg == dict(
        batch_size=4,
        learning_rate=3.0,
        pos_encoding="alibi",
        ssmax=False,
        prior_lr=0.01,
        bam_init="0.5,-1",
    )
    assert isinstance(cfg["learning_rate"], float)


def test_configurator_rejects_unknown_key_and_wrong_type(tmp_path):
    with pytest.raises(
        ConfigError, match="unknown config key 'batch_sise'.*Did you mean batch_size"
    ):
        configure(DEFAULTS, ["--batch_sise=3"])
    with pytest.raises(ConfigError, match="'batch_size'.*expects int.*got float"):
        configure(DEFAULTS, ["--batch_size=2.5"])
    with pytest.raises(ConfigError, match="'ssmax'.*expects bool"):
        configure(DEFAULTS, ["--ssmax=1"])
    with pytest.raises(ConfigError, match="--key=value"):
        configure(DEFAULTS, ["--ssmax"])
    bad = tmp_path / "bad.py"
    bad.write_text("learning_rat = 1e-3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rat' \(in .*bad.py\)"):
        configure(DEFAULTS, [str(bad)])
    with pytest.raises(ConfigError, match="cannot read config file"):
        configure(DEFAULTS, [str(tmp_path / "missing.py")])


def test_configurator_never_executes_command_line_values():
    cfg = configure(DEFAULTS, ["--pos_encoding=__import__('os').system('echo pwned')"])
    assert cfg["pos_encoding"] == "__import__('os').system('echo pwned')"  # kept as an inert string
