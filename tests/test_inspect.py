"""analysis/inspect_attention.py: the needle's key tokens, the metrics of one attention row, a model
whose attention is known in closed form, the answer row against the model's own attention output,
and the command line end to end."""

import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import run_script_here
from test_passkey import merging_tokenizer

import eval_passkey as passkey
from analysis import inspect_attention as ia
from analysis import plot_prior
from data import get_tokenizer
from eval_common import EvalError, Evaluation
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig
from priors import Prior, alibi_slopes, register

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = passkey.TEMPLATES["demo"]
PAPER = passkey.TEMPLATES["paper"]
DIGITS = range(ord("0"), ord("9") + 1)  # the byte tokenizer's digit tokens


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer("byte")


def test_key_positions(enc):
    tokens, _, info = passkey.build_prompt(enc, DEMO, 200, 31415, 3)
    assert ia.key_positions(enc, tokens, info) == [j for j, t in enumerate(tokens) if t in DIGITS]
    assert bytes(tokens[j] for j in ia.key_positions(enc, tokens, info)) == b"31415"
    # the paper's needle states the key twice
    tokens, _, info = passkey.build_prompt(enc, PAPER, 600, 27182, 2)
    pos = ia.key_positions(enc, tokens, info)
    assert bytes(tokens[j] for j in pos) == b"2718227182" and pos == [
        j for j, t in enumerate(tokens) if t in DIGITS
    ]
    merging = merging_tokenizer()  # " 12345" -> " 123" + "45": the merged tokens carry the key
    tokens, _, info = passkey.build_prompt(merging, PAPER, 600, 12345, 2)
    assert [merging.decode([tokens[j]]) for j in ia.key_positions(merging, tokens, info)] == [
        " 123",
        "45",
    ] * 2


def test_row_metrics():
    p = torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])  # query at position 3
    mass, dist, ent = ia.row_metrics(p, 3, [0, 2])
    assert mass.tolist() == [0.75, 0.5]
    assert dist.tolist() == pytest.approx([0.5 * 3 + 0.25 * 1, 1.5])
    assert ent.tolist() == pytest.approx([-0.5 * math.log(0.5) - 0.5 * math.log(0.25), math.log(4)])


def forced_model():
    """One layer, two heads, BAM + SSMax (s = 1), whose attention at the space token is known in
    closed form. Embeddings after RMSNorm: digits sqrt(8) e0, the space sqrt(8) e2, every other byte
    sqrt(8) e1. Head 0 has content score c = 1.5 on digits and 0 elsewhere, and a flat prior
    (theta_beta = 0); head 1 has no content score and the prior -|d| (theta_alpha = 0, theta_beta =
    1). With SSMax both are multiplied by ln n, n = i + 1 keys: p_0(j) ~ n^(1.5 [j is a digit]),
    p_1(j) ~ n^-(i - j)."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=1,
        n_head=2,
        n_embd=8,
        block_size=32,
        pos_encoding="bam",
        ssmax=True,
        scale_prior=True,
    )
    model = GPT(cfg)
    r8 = math.sqrt(8)
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, 1] = r8
        for t in list(DIGITS) + [ord(" ")]:
            model.wte.weight[t] = 0.0
        model.wte.weight[list(DIGITS), 0] = r8
        model.wte.weight[ord(" "), 2] = r8
        attn = model.blocks[0].attn
        attn.wq.weight.zero_()
        attn.wk.weight.zero_()
        attn.wk.weight[0, 0] = 1 / r8  # head 0: k[0] = 1 on digits
        # head 0: q[0] = 3 at the space; l = q.k / sqrt(4) = 1.5
        attn.wq.weight[0, 2] = 1.5 * 2 / r8
        attn.theta_alpha.copy_(torch.tensor([0.7, 0.0]))
        attn.theta_beta.copy_(torch.tensor([0.0, 1.0]))
        attn.ssmax_s.fill_(1.0)
    return model.eval()


def expected_forced(tokens):
    """(needle mass, mean distance) of both heads of forced_model at the last position, from the
    closed form."""
    i = len(tokens) - 1
    n = i + 1
    d = i - np.arange(n, dtype=np.float64)
    digit = np.array([t in DIGITS for t in tokens])
    out = []
    for logp in (1.5 * math.log(n) * digit, -math.log(n) * d):
        p = np.exp(logp - logp.max())
        p /= p.sum()
        out.append((p[digit].sum(), (p * d).sum()))
    return out


def test_forced_heads_measure_the_closed_form(enc):
    model = forced_model()
    run = dict(label="forced", model=model, block_size=32)
    rows, _ = ia.inspect_length(Evaluation([run], enc, "cpu", "float32"), run, DEMO, 96, 3)
    prompts = passkey.make_samples(enc, DEMO, 96, 3, passkey.SEED)
    expected = [expected_forced(p + a[: info["n_given"]]) for p, a, info in prompts]
    # needle at 0%, 50%, 100%
    assert {info["k"] for _, _, info in prompts} == {
        0,
        passkey.filler_units(enc, DEMO, 96) // 2,
        passkey.filler_units(enc, DEMO, 96),
    }
    for h, row in enumerate(rows):
        assert (row["layer"], row["head"]) == (0, h)
        assert row["needle_mass"] == pytest.approx(
            np.mean([e[h][0] for e in expected]), rel=1e-4, abs=1e-9
        )
        assert row["mean_distance"] == pytest.approx(
            np.mean([e[h][1] for e in expected]), rel=1e-4, abs=1e-6
        )
        assert row["shape_param"] == "theta_beta" and row["shape"] == [0.0, 1.0][h]
        assert row["theta_alpha"] == pytest.approx([0.7, 0.0][h]) and row["ssmax_s"] == 1.0
        assert row["highlight"] is False and row["highlight_label"] == "θβ < 0"
    assert rows[0]["needle_mass"] > 0.95  # head 0 reads the key ...
    # ... head 1 its own position
    assert rows[1]["needle_mass"] < 1e-3 and rows[1]["mean_distance"] < 0.02
    key_distance = np.mean(
        [
            len(p) + info["n_given"] - 1 - np.mean(ia.key_positions(enc, p, info))
            for p, _, info in prompts
        ]
    )
    assert rows[0]["needle_distance"] == pytest.approx(key_distance)


@pytest.mark.parametrize(
    "pos_encoding,ssmax", [("bam", True), ("alibi", True), ("rope", True), ("nope", False)]
)
def test_answer_row_is_the_models_own_attention(pos_encoding, ssmax):
    """p @ v of the recomputed answer row equals what each layer's attention actually returned at
    that position."""
    torch.manual_seed(3)
    cfg = GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=16,
        pos_encoding=pos_encoding,
        ssmax=ssmax,
        bam_init="linear" if pos_encoding == "bam" else "zero",
    )
    model = GPT(cfg).eval()
    if pos_encoding == "bam":
        with torch.no_grad():
            model.blocks[1].attn.theta_beta[0] = -0.5  # an anti-local head
    idx = torch.randint(0, 257, (1, 53))
    # each layer's attention output at the last position (the input of wo), and v
    outputs = []
    values = []
    hooks = [
        b.attn.wo.register_forward_pre_hook(lambda m, a: outputs.append(a[0][0, -1]))
        for b in model.blocks
    ]
    hooks += [
        b.attn.register_forward_pre_hook(lambda m, a: values.append(m.wv(a[0])[0]))
        for b in model.blocks
    ]
    probs, logits = ia.answer_row_probs(model, idx)
    for h in hooks:
        h.remove()
    assert probs.shape == (2, 1, 4, 53) and logits.shape[0] == 1
    assert torch.allclose(probs.sum(-1), torch.ones(2, 1, 4))
    for layer in range(2):
        v = values[layer].view(53, 4, 8).transpose(0, 1)  # (H, T, D)
        y = torch.einsum("ht,htd->hd", probs[layer, 0], v).reshape(-1)
        torch.testing.assert_close(y, outputs[layer], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect_ckpts")
    paths = []
    for i, (name, pos) in enumerate([("bam_ssmax", "bam"), ("alibi", "alibi"), ("rope", "rope")]):
        torch.manual_seed(i)
        cfg = GPTConfig(
            vocab_size=257,
            tokenizer="byte",
            n_layer=2,
            n_head=4,
            n_embd=16,
            block_size=32,
            pos_encoding=pos,
            ssmax=pos == "bam",
            bam_init="linear" if pos == "bam" else "zero",
        )
        save_checkpoint(str(root / name / "ckpt_10.pt"), GPT(cfg), step=10)
        paths.append(str(root / name))
    return paths


@pytest.mark.parametrize("digit", [1, 3])
def test_digit_mass_is_the_attention_on_the_needle_digit_to_copy(enc, digit):
    """--digit K: the query that predicts answer digit K (digits 1 .. K-1 given); digit_mass is its
    attention on the needle's K-th digit. forced_model's head 0 has a content score only at the
    space (digit 1's query)."""
    run = dict(label="forced", model=forced_model(), block_size=32)
    ev = Evaluation([run], enc, "cpu", "float32")
    rows, _ = ia.inspect_length(ev, run, DEMO, 96, 3, digit=digit)
    expected = [[], []]
    for p, a, info in passkey.make_samples(enc, DEMO, 96, 3, passkey.SEED):
        tokens = p + a[: info["n_given"] + digit - 1]
        n = len(tokens)
        d = n - 1 - np.arange(n, dtype=np.float64)
        content = (
            1.5 * math.log(n) * np.array([t in DIGITS for t in tokens]) * (tokens[-1] == ord(" "))
        )
        for h, logp in enumerate((content, -math.log(n) * d)):
            q = np.exp(logp - logp.max())
            expected[h].append(q[ia.key_positions(enc, p, info)[digit - 1]] / q.sum())
    for h in (0, 1):
        assert rows[h]["digit"] == digit
        assert rows[h]["digit_mass"] == pytest.approx(np.mean(expected[h]), rel=1e-4, abs=1e-9)


def test_end_to_end(tmp_path, ckpts, capsys):
    out = tmp_path / "inspect"
    argv = [a for c in ckpts for a in ("--ckpt", c)] + [
        "--template",
        "demo",
        "--lengths",
        "32",
        "64",
        "128",
        "--samples",
        "2",
        "--out",
        str(out),
        "--no_progress",
    ]
    rows, summary = ia.main(argv)
    assert len(rows) == 3 * 3 * 8  # checkpoints x lengths 32, 64, 128 x (layer, head)
    table = json.loads((out / "attention_heads.json").read_text())
    assert table == json.loads(json.dumps(rows))
    assert (out / "attention_heads.csv").read_text().count("\n") == len(rows) + 1
    info = json.loads((out / "attention_summary.json").read_text())
    assert info["settings"]["lengths"] == [32, 64, 128] and info["settings"]["length"] == 128
    for s in info["checkpoints"]:
        mine = [r for r in rows if r["label"] == s["label"]]
        best = max((r for r in mine if r["target_length"] == 128), key=lambda r: r["needle_mass"])
        assert (s["top_heads"][0]["layer"], s["top_heads"][0]["head"]) == (
            best["layer"],
            best["head"],
        )
        assert len(s["readers"]) == sum(
            r["needle_mass"] >= 0.5 for r in mine if r["target_length"] == 128
        )
        assert [c["target_length"] for c in s["curve"]] == [32, 64, 128]
        for c in s["curve"]:
            assert c["max_needle_mass"] >= c["needle_mass"] and 0 <= c["first_token_accuracy"] <= 1
            assert c["uniform_mass"] == pytest.approx(5 / (c["target_length"]), rel=0.2)
    labelled = {r["label"]: r for r in rows}
    assert labelled["bam_ssmax"]["shape_param"] == "theta_beta"
    alibi = [r for r in rows if r["label"] == "alibi" and r["target_length"] == 32]
    # ALiBi: its fixed slopes
    assert [r["shape"] for r in alibi] == pytest.approx(alibi_slopes(4).tolist() * 2)
    assert all(r["shape_param"] == "slope" and "highlight" not in r for r in alibi)
    assert "shape_param" not in labelled["rope"]
    for r in rows:
        assert 0 <= r["needle_mass"] <= 1 and 0 <= r["mean_distance"] <= r["length"]
        assert 0 <= r["entropy"] <= math.log(r["length"]) + 1e-6
    for name in ("attention_heads.png", "attention_needle_vs_length.png"):
        assert (out / name).stat().st_size > 10_000
    assert "bam_ssmax: top heads at 128:" in capsys.readouterr().out


def test_errors_are_one_line(tmp_path, ckpts, capsys):
    argv = ["--ckpt", ckpts[0], "--template", "demo", "--lengths", "4", "--out", str(tmp_path)]
    with pytest.raises(EvalError, match=r"^length 4 is shorter than the demo prompt"):
        ia.main(argv)
    with pytest.raises(EvalError, match=r"^--digit must be between 1 and"):
        ia.main(argv[:-4] + ["--lengths", "64", "--digit", "6", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        ia.main(["--ckpt", ckpts[0], "--out", str(tmp_path)])
    assert "the following arguments are required: --lengths" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing written

    missing = str(tmp_path / "missing")
    script = os.path.join("analysis", "inspect_attention.py")
    r = run_script_here(script, "--ckpt", missing, "--lengths", "64", "--out", tmp_path)
    assert r.returncode == 1 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr == (
        f"inspect_attention.py: error: no checkpoint at {missing!r}: pass a .pt file or a run "
        "directory written by train.py\n"
    )


def test_a_length_out_of_memory_is_an_error_that_says_so(tmp_path, ckpts, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore")

    monkeypatch.setattr(ia, "answer_row_probs", out_of_memory)
    argv = ["--ckpt", ckpts[0], "--template", "demo", "--lengths", "64", "--samples", "1"]
    with pytest.raises(
        EvalError,
        match=r"^bam_ssmax at 64 tokens: out of memory \(CUDA out of memory\. Tried to allocate "
        r"64\.00 GiB\); drop that length$",
    ):
        ia.main(argv + ["--out", str(tmp_path / "oom"), "--no_progress"])


def test_a_prior_with_only_the_required_fields_works_in_plot_prior_and_inspect(tmp_path, capsys):
    """A forker's prior, registered with name, fn, params, init and trainable alone: a checkpoint of
    it goes through plot_prior.py and inspect_attention.py end to end, labelled by its (defaulted)
    shape parameter."""

    def power(d, theta_w):
        return -torch.exp(theta_w.float())[:, None] * d.float().abs().sqrt()[None, :]

    register(
        Prior(
            name="test_power",
            fn=power,
            params=("theta_w",),
            init=lambda spec, n: (torch.linspace(-1, 1, n),),
            trainable=("theta_w",),
        )
    )
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=32,
        pos_encoding="bam",
        prior="test_power",
    )
    save_checkpoint(str(tmp_path / "power" / "ckpt_1.pt"), GPT(cfg), step=1)
    ckpt = str(tmp_path / "power")
    plot_prior.main(["--ckpt", ckpt, "--out", str(tmp_path / "prior.png")])
    info = json.loads((tmp_path / "prior.json").read_text())
    assert info["prior"] == "test_power" and info["formula"] == "B(d) = power(d, theta_w)"
    assert info["heads"] == 2 and info["heads_highlighted"] == 0
    head = info["layers"][0]["heads"][1]
    np.testing.assert_allclose(head["bias"], -math.e * np.sqrt(info["distances"]), rtol=1e-5)
    assert (tmp_path / "prior.png").stat().st_size > 10_000
    argv = ["--ckpt", ckpt, "--template", "demo", "--lengths", "64", "--samples", "2"]
    rows, summary = ia.main(argv + ["--out", str(tmp_path / "inspect"), "--no_progress"])
    assert {(r["shape_param"], r["prior"]) for r in rows} == {("theta_w", "test_power")}
    assert [r["shape"] for r in rows if r["target_length"] == 64] == pytest.approx([-1.0, 1.0])
    assert "θw=" in capsys.readouterr().out
    assert (tmp_path / "inspect" / "attention_heads.png").exists()


def test_prior_summary_reports_every_layer():
    sizes = dict(vocab_size=257, n_layer=2, n_head=4, n_embd=32, block_size=16, tokenizer="byte")
    bam = GPT(GPTConfig(**sizes))
    with torch.no_grad():
        bam.blocks[0].attn.theta_beta[0] = -0.8
    rows = plot_prior.prior_summary(bam)
    assert len(rows) == 2 and len(rows[0]["theta_beta"]) == 4 and len(rows[0]["ssmax_s"]) == 4
    assert rows[0]["theta_beta"][0] == pytest.approx(-0.8) and rows[0]["mu"] == [0.0] * 4
    assert rows[0]["prior"] == "ggd"
    rope = GPT(GPTConfig(**sizes, pos_encoding="rope", ssmax=False))
    assert plot_prior.prior_summary(rope) == []
    alibi = GPT(GPTConfig(**sizes, pos_encoding="alibi", ssmax=False))
    row = plot_prior.prior_summary(alibi)[0]
    assert row["prior"] == "alibi" and row["slope"] == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]


def test_head_label_of_a_vector_shape_is_empty():
    """T5's buckets are a vector per head: no label, rather than a format error."""
    assert ia.head_label({"shape_param": "theta_beta", "shape": -0.42}) == "θbeta=-0.42"
    assert ia.head_label({"shape_param": "bias", "shape": [0.1, -0.2]}) == ""
    assert ia.head_label({}) == ""
