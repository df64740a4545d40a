"""train.py: end to end as a user runs it, DDP equivalence, exact resume after a crash, every
variant learns, and the failures a user meets (typos, bad settings, missing data, a diverging run)
say what is wrong."""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import run_script_here, run_train, write_shard

import data
import model as model_module
import train
from configurator import ConfigError, configure
from data import TokenLoader, get_tokenizer
from model import GPT, POS_ENCODINGS, GPTConfig, load_checkpoint, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = [(pe, ss) for pe in POS_ENCODINGS for ss in (False, True)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Byte-tokenized shards: a 3,000-token val shard and a ~16,000-token train shard of short
    documents."""
    d = tmp_path_factory.mktemp("data")
    enc = get_tokenizer("byte")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and the dog ran far away from home with a big red ball".split()
    tokens = []
    for _ in range(220):
        tokens += [enc.eot_token] + enc.encode_ordinary(
            " ".join(rng.choice(words, int(rng.integers(5, 40))))
        )
    write_shard(str(d / "tiny_val_000000.bin"), tokens[:3000], "byte")
    write_shard(str(d / "tiny_train_000001.bin"), tokens[3000:], "byte")
    return str(d)


def tiny(data_dir, out_dir, **overrides):
    """argv for a tiny float32 run on CPU (2 layers, n_embd 32, 4 heads, context 32)."""
    s = dict(
        data_dir=data_dir,
        out_dir=str(out_dir),
        n_layer=2,
        n_embd=32,
        n_head=4,
        block_size=32,
        batch_size=4,
        gradient_accumulation_steps=1,
        max_iters=6,
        eval_interval=3,
        eval_iters=4,
        log_interval=1,
        ckpt_interval=3,
        keep_last=0,
        learning_rate=1e-2,
        min_lr=1e-3,
        device="cpu",
        dtype="float32",
        compile=False,
    )
    s.update(overrides)
    return [f"--{k}={v}" for k, v in s.items()]


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def changed(cfg, **settings):
    """A copy of resolved settings (a namespace) with some of them changed."""
    return SimpleNamespace(**{**vars(cfg), **settings})


def settings(*argv, **overrides):
    """train.py's settings after config files and --key=value arguments, as a namespace."""
    defaults = {k: getattr(train, k) for k in train.config_keys}
    return SimpleNamespace(**{**configure(defaults, list(argv)), **overrides})


def run_cli(args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


# --------------------------------------------------------------------------------------------------
def test_end_to_end_cli(data_dir, tmp_path):
    """python train.py CONFIG --key=value, as a user runs it: the run directory and its checkpoint
    are complete, and the logged val loss is the document-masked loss of the saved model on the val
    split."""
    config = tmp_path / "tiny.py"
    # 2 micro-batches of 4 x 32 tokens a step
    config.write_text(
        "n_layer = 2\nn_embd = 32\nn_head = 4\nblock_size = 32\nbatch_size = 4\n"
        "gradient_accumulation_steps = 2\n"
    )
    out = tmp_path / "run"
    settings = "--max_iters=6 --eval_interval=3 --eval_iters=4 --log_interval=2 --ckpt_interval=3"
    settings += " --keep_last=1 --learning_rate=1e-2 --device=cpu --dtype=float32 --compile=False"
    r = run_cli([str(config), f"--data_dir={data_dir}", f"--out_dir={out}", *settings.split()])
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and "16 trainable prior" in r.stdout
    assert "step 6/6 | loss" in r.stdout and "done: step 6 of 6" in r.stdout

    check_run_directory(out, config)
    check_val_loss_is_the_masked_loss(out, data_dir)


def check_run_directory(out, config):
    """config.json, env.json, metrics.jsonl and the one checkpoint kept (keep_last=1)."""
    assert sorted(os.listdir(out)) == [
        ".lock",
        "ckpt_0000006.pt",
        "config.json",
        "env.json",
        "metrics.jsonl",
    ]
    cfg = json.load(open(out / "config.json"))
    assert cfg["gradient_accumulation_steps"] == 2
    model_args = cfg["model_args"]
    assert model_args["tokenizer"] == "byte" and model_args["vocab_size"] == 257
    assert "attn_impl" in cfg and "attn_impl" not in model_args
    env = json.load(open(out / "env.json"))
    assert env["torch"] == torch.__version__
    assert "train.py" in env["command"] and str(config) in env["command"]

    rec = metrics(out)
    assert [m["step"] for m in rec] == [0, 2, 3, 4, 6]
    assert "val_loss" in rec[0] and "train_loss" not in rec[0]
    logged = ("train_loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step", "val_loss")
    assert all(k in rec[-1] for k in logged)
    assert "mfu" not in rec[-1]  # CPU
    theta_beta = rec[-1]["prior"]["theta_beta"]
    assert len(theta_beta) == 2 and all(lo <= med <= hi for lo, med, hi in theta_beta)

    ckpt = load_checkpoint(str(out))
    assert ckpt["step"] == 6 and ckpt["config"]["pos_encoding"] == "bam"
    assert "optimizer" in ckpt and ckpt["rng"]


def check_val_loss_is_the_masked_loss(out, data_dir):
    """The last logged val loss is the document-masked loss of the saved model (masking is on)."""
    model, _ = load_model(str(out))
    assert model.config.tokenizer == "byte" and model.config.vocab_size == 257
    val = TokenLoader(data_dir, "val", 32, 4)
    with torch.no_grad():
        batches = [val.get_batch(k) for k in range(4)]
        losses = [model(x, y, doc_start=d)[1] for x, y, d in batches]
        unmasked = [model(x, y)[1] for x, y, _ in batches]
    val_loss = metrics(out)[-1]["val_loss"]
    assert val_loss == pytest.approx(torch.stack(losses).mean().item(), abs=1e-6)
    assert abs(val_loss - torch.stack(unmasked).mean().item()) > 1e-4  # masking is really on


def test_cli_config_typo_is_a_clear_error():
    r = run_script_here("train.py", "--batch_sise=4")
    assert r.returncode == 1
    assert "unknown config key 'batch_sise'" in r.stderr and "Did you mean batch_size" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--pos_encoding=alibbi"], "pos_encoding must be one of"),
        (["--n_embd=30"], "n_embd=30 is not divisible by n_head=4"),
        (["--dtype=fp16"], "dtype must be bfloat16, float16 or float32"),
        (["--min_lr=1.0"], "min_lr=1.0 is above learning_rate"),
        (["--stop_signals=SIGTERM,SIGKILL"], "'SIGKILL' is not a signal a process can catch"),
        (["--stop_signals=SIGTREM"], "'SIGTREM' is not a signal a process can catch"),
    ],
)
def test_bad_settings_fail_before_touching_data(tmp_path, bad, message):
    # the data directory does not exist: a semantic error must be reported first, and nothing is
    # written
    with pytest.raises(ConfigError, match="invalid settings") as e:
        run_train(tiny(str(tmp_path / "no_data"), tmp_path / "run") + bad)
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_setting_the_model_ignores_is_one_line(tmp_path):
    """rope would train with --prior=kerple_log silently unused: refused before anything else."""
    config = os.path.join(ROOT, "config", "demo_cpu.py")
    out = tmp_path / "run"
    r = run_script_here(
        "train.py", config, "--pos_encoding=rope", "--prior=kerple_log", f"--out_dir={out}"
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        "train.py: error: invalid settings: prior='kerple_log' has no effect"
    )
    assert not out.exists()


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        run_train(tiny(str(tmp_path / "nowhere"), tmp_path / "run"))
    assert (
        "data directory" in str(e.value)
        and "does not exist" in str(e.value)
        and "prepare" in str(e.value)
    )


@pytest.fixture
def unchecked_kernel(monkeypatch):
    """The kernel self-check as in a new process: no problem checked yet."""
    from infra import kernel_check

    monkeypatch.setattr(kernel_check, "_checked", set())


def test_triton_training_checks_the_kernel_before_step_1(data_dir, tmp_path, unchecked_kernel):
    """--attn_impl=triton (here through Triton's interpreter) compares the kernel with the
    reference on a problem shaped like the run, prints the line, then trains."""
    out = tmp_path / "run"
    args = tiny(
        data_dir, out, attn_impl="triton", ssmax=True, max_iters=2, eval_interval=2, eval_iters=1
    )
    r = run_script_here("train.py", *args)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("attention kernel check"))
    assert "(float32, head_dim 8, ggd + SSMax scaling the prior, documents," in line, line
    assert line.endswith("s") and ": ok in " in line, line
    assert r.stdout.index("attention kernel check") < r.stdout.index("step 1/2")
    assert "done: step 2 of 2" in r.stdout


def test_a_wrong_kernel_stops_training_before_anything_is_written(
    data_dir, tmp_path, monkeypatch, unchecked_kernel
):
    """A kernel made wrong on purpose: every row reads the prior's table one distance off, as a
    wrong address would."""
    import attention_kernel as ak

    right = ak._prior_tables

    def misread(*args):
        table, *rest = right(*args)
        return (table.roll(1, -1), *rest)

    monkeypatch.setattr(ak, "_prior_tables", misread)
    out = tmp_path / "run"
    r = run_script_here("train.py", *tiny(data_dir, out, attn_impl="triton", ssmax=True))
    assert r.returncode == 1
    assert r.stderr.startswith("train.py: error: the Triton kernel disagrees with the reference")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--attn_impl=torch" in r.stderr and "Traceback" not in r.stderr
    assert "step 1" not in r.stdout
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_gpu_recipe_refuses_a_cpu(data_dir, tmp_path, monkeypatch):
    # as torchrun launches rank 0 of 2: one line, before any process group, data or run directory
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    config = os.path.join(ROOT, "config", "bam_120m.py")
    r = run_script_here(
        "train.py", config, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}"
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        "train.py: error: invalid settings: device=auto found no CUDA GPU under torchrun"
    )
    assert "pass --device=cpu" in r.stderr
    # the GPU recipe's settings without torchrun, and on purpose with --device=cpu
    c = settings(os.path.join(ROOT, "config/bam_120m.py"))
    with pytest.raises(
        ConfigError, match="dtype=bfloat16 and compile=True; to train on the CPU on purpose"
    ):
        train.check_settings(changed(c), world_size=1, ddp=False)
    cpu = torch.device("cpu")
    assert train.check_settings(changed(c, device="cpu"), world_size=1, ddp=True)[0] == cpu
    assert train.check_settings(changed(c, compile=False), world_size=1, ddp=False)[0] == cpu
    with pytest.raises(ConfigError, match="device='cuda:0' needs a CUDA GPU, and torch finds none"):
        train.check_settings(changed(c, device="cuda:0"), world_size=1, ddp=False)
    with pytest.raises(ConfigError, match="device='gpu' is not a device torch knows"):
        train.check_settings(changed(c, device="gpu"), world_size=1, ddp=False)
    assert not (tmp_path / "run").exists()


def test_every_model_setting_is_written_out_in_train_py():
    """The paper's switches (pos_encoding, ssmax, prior, bam_init, ...) are assignments in
    train.py's settings block, one per GPTConfig field (but vocab_size and tokenizer, which come
    from the data), with GPTConfig's defaults; attn_impl is a setting and no model field."""
    import ast
    from dataclasses import fields

    model_fields = {
        f.name: f.default for f in fields(GPTConfig) if f.name not in ("vocab_size", "tokenizer")
    }
    with open(os.path.join(ROOT, "train.py")) as f:
        module = ast.parse(f.read())
    assigned = {
        t.id
        for node in module.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    assert set(model_fields) <= assigned & set(train.config_keys)
    assert {k: getattr(train, k) for k in model_fields} == model_fields
    assert "attn_impl" in train.config_keys and "attn_impl" not in model_fields
    assert all(k.islower() for k in train.config_keys)


def test_a_world_size_that_does_not_divide_the_accumulation_is_refused():
    c = settings(device="cpu")
    with pytest.raises(ConfigError, match="not divisible by the world size 5"):
        train.check_settings(c, world_size=5, ddp=True)


def test_lr_schedule():
    c = SimpleNamespace(learning_rate=1e-3, min_lr=1e-4, warmup_iters=0, max_iters=100)
    assert train.get_lr(0, c) == 1e-3
    assert train.get_lr(50, c) == pytest.approx(5.5e-4)
    assert 1e-4 < train.get_lr(99, c) < 1.01e-4
    w = changed(c, warmup_iters=10)
    assert train.get_lr(0, w) == pytest.approx(1e-4) and train.get_lr(9, w) == pytest.approx(1e-3)


def test_configs_resolve():
    """config/bam_120m.py and config/bam_1b.py are the paper recipe and divide into 8-GPU
    micro-batches."""
    for path, size, accum in (
        ("bam_120m.py", (12, 768, 16), 24),
        ("bam_1b.py", (24, 2048, 64), 72),
    ):
        c = settings(os.path.join(ROOT, "config", path), "--device=cpu")
        _, config = train.check_settings(c, world_size=8, ddp=True)
        assert (config.n_layer, config.n_embd, config.n_head) == size
        assert c.gradient_accumulation_steps == accum
        assert (c.pos_encoding, c.ssmax, c.block_size, c.max_iters) == ("bam", True, 512, 20000)
        assert (c.learning_rate, c.min_lr, c.weight_decay, c.grad_clip) == (1e-3, 1e-4, 0.1, 1.0)
        assert (c.beta1, c.beta2, c.warmup_iters, c.seed, c.dtype) == (0.9, 0.95, 0, 42, "bfloat16")
        assert c.batch_size * c.block_size * c.gradient_accumulation_steps == 589824


def test_paper_config_has_the_papers_parameter_count():
    """config/bam_120m.py is the authors' setup: mistral data, no repeat, and l12 with the
    32,768-token vocabulary has the paper's 121.13M parameters (gpt2's 50,257 would give 148.07M).
    """
    c = settings(os.path.join(ROOT, "config", "bam_120m.py"), "--device=cpu")
    _, config = train.check_settings(c, world_size=1, ddp=False)
    assert c.data_dir == "data/fineweb_mistral" and c.allow_data_repeat is False
    vocab = get_tokenizer("mistral").n_vocab
    assert vocab == 32768
    config.vocab_size = vocab
    model = GPT(config)
    assert model.config.padded_vocab_size == 32768 and model.num_params() == 121_130_496
    assert round(model.num_params() / 1e6, 2) == 121.13


def test_a_run_that_would_repeat_data_is_refused(data_dir, tmp_path):
    windows = len(TokenLoader(data_dir, "train", 32, 4))
    steps = windows // 4 + 1  # one step more than the data holds
    r = run_script_here("train.py", *tiny(data_dir, tmp_path / "run", max_iters=steps))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    missing = steps * 128 - windows * 32
    assert (
        f"{missing:,} missing" in r.stderr and "prepare_fineweb.py --name sample-100BT" in r.stderr
    )
    assert "--allow_data_repeat=True" in r.stderr and not (tmp_path / "run").exists()
    # not one window
    with pytest.raises(data.DataError, match="longer than every train shard.*prepare more data"):
        run_train(tiny(data_dir, tmp_path / "run", block_size=20_000))
    # allowed, and a run that fits
    run_train(tiny(data_dir, tmp_path / "allowed", max_iters=steps, allow_data_repeat=True))
    run_train(tiny(data_dir, tmp_path / "fits", max_iters=steps - 1))


# --------------------------------------------------------------------------------------------------
def test_resume_after_a_crash_is_exact(data_dir, tmp_path, monkeypatch):
    """A run that dies in the middle of step 5 (its last checkpoint at step 3) and is resumed
    follows the uninterrupted run's trajectory bit for bit: train and val losses, grad norms and the
    final weights."""
    full, broken = tmp_path / "full", tmp_path / "broken"
    args = dict(max_iters=8, gradient_accumulation_steps=2, eval_interval=4, ckpt_interval=3)
    run_train(tiny(data_dir, full, **args))

    class Crash(Exception):
        pass

    class CrashingLoader(TokenLoader):
        def get_batch(self, step, micro_step=0, grad_accum=1):
            # update 5's second micro-batch, fetched while the first one computes
            if step == 4 and micro_step == 1:
                raise Crash
            return super().get_batch(step, micro_step, grad_accum)

    monkeypatch.setattr(data, "TokenLoader", CrashingLoader)
    with pytest.raises(Crash):
        run_train(tiny(data_dir, broken, **args))
    monkeypatch.setattr(data, "TokenLoader", TokenLoader)
    assert [m["step"] for m in metrics(broken)] == [0, 1, 2, 3, 4]
    assert sorted(f for f in os.listdir(broken) if f.startswith("ckpt")) == ["ckpt_0000003.pt"]

    # no silent restart over a run
    with pytest.raises(RuntimeError, match="already holds checkpoints") as e:
        run_train(tiny(data_dir, broken, **args))
    assert e.typename == "TrainingError"
    # a different model cannot resume it
    with pytest.raises(RuntimeError, match="n_embd: 32 vs 64") as e:
        run_train(tiny(data_dir, broken, **args, n_embd=64, resume=True))
    assert e.typename == "TrainingError"
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train_l')  # a record cut short by the crash
    assert run_train(tiny(data_dir, broken, **args, resume=True))["step"] == 8

    a, b = metrics(full), metrics(broken)
    assert [m["step"] for m in b] == list(
        range(9)
    )  # step 4's lost record was replaced, not duplicated
    timing = ("tokens_per_s", "ms_per_step")
    assert [{k: v for k, v in m.items() if k not in timing} for m in a] == [
        {k: v for k, v in m.items() if k not in timing} for m in b
    ]  # everything but timings is identical
    wa = load_checkpoint(str(full / "ckpt_0000008.pt"))["model"]
    wb = load_checkpoint(str(broken / "ckpt_0000008.pt"))["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    env = json.load(open(broken / "env.json"))
    assert env["start_step"] == 3


@pytest.mark.parametrize(
    "pos_encoding, ssmax", VARIANTS, ids=[f"{p}{'+ssmax' if s else ''}" for p, s in VARIANTS]
)
def test_every_variant_learns(data_dir, tmp_path, pos_encoding, ssmax):
    out = tmp_path / "run"
    run_train(
        tiny(
            data_dir,
            out,
            pos_encoding=pos_encoding,
            ssmax=ssmax,
            max_iters=14,
            eval_interval=14,
            ckpt_interval=14,
            learning_rate=2e-2,
        )
    )
    rec = metrics(out)
    first, last = (
        np.mean([m["train_loss"] for m in rec[1:4]]),
        np.mean([m["train_loss"] for m in rec[-3:]]),
    )
    assert last < first - 0.3, (first, last)
    assert rec[-1]["val_loss"] < rec[0]["val_loss"] - 0.3
    assert ("prior" in rec[-1]) == (pos_encoding == "bam")
    ckpt = load_checkpoint(str(out))
    assert (ckpt["model_args"]["pos_encoding"], ckpt["model_args"]["ssmax"]) == (
        pos_encoding,
        ssmax,
    )


@pytest.mark.parametrize("log_interval, stopped_at", [(1, 5), (4, 6)])
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    data_dir, tmp_path, monkeypatch, log_interval, stopped_at
):
    """The loss is read at log steps and before each evaluation and checkpoint: a NaN at step 5 is
    found there (log_interval 4: at step 6's checkpoint, which is not written)."""

    class NaNAtStep5(GPT):
        calls = 0

        def forward(self, idx, targets=None, **kw):
            logits, loss = super().forward(idx, targets, **kw)
            if self.training:  # one training forward per step here (no accumulation)
                NaNAtStep5.calls += 1
                if NaNAtStep5.calls == 5:
                    loss = loss * float("nan")
            return logits, loss

    monkeypatch.setattr(model_module, "GPT", NaNAtStep5)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"non-finite loss nan at step 5") as e:
        run_train(tiny(data_dir, out, max_iters=8, ckpt_interval=2, log_interval=log_interval))
    assert e.typename == "TrainingError" and "ckpt_0000004.pt" in str(e.value)
    assert f"training stopped at step {stopped_at}, unsaved" in str(e.value)
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt")) == [
        "ckpt_0000002.pt",
        "ckpt_0000004.pt",
    ]
    assert all(torch.isfinite(t).all() for t in load_checkpoint(str(out))["model"].values())
    assert metrics(out)[-1]["step"] == 4


def test_diverging_learning_rate_stops(data_dir, tmp_path):
    """The real thing, no monkeypatching: an absurd learning rate without clipping blows the model
    up, and the run stops at the first non-finite loss or gradient norm with the step in the
    message."""
    with pytest.raises(RuntimeError, match=r"non-finite (loss|gradient norm) \S+ at step \d+"):
        run_train(
            tiny(
                data_dir,
                tmp_path / "run",
                max_iters=30,
                learning_rate=1e12,
                min_lr=1e12,
                grad_clip=0.0,
                eval_interval=100,
                ckpt_interval=100,
            )
        )


@pytest.mark.skipif(
    shutil.which("torchrun") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not installed",
)
def test_ddp_two_processes_match_one_process(data_dir, tmp_path):
    """torchrun --nproc_per_node=2 (gloo) with 2 micro-batches in all (1 per process) ends with the
    same weights as one process doing both micro-batches: the ranks read disjoint data and the
    gradients are averaged correctly."""
    args = tiny(
        data_dir,
        tmp_path / "ddp",
        gradient_accumulation_steps=2,
        max_iters=3,
        eval_interval=3,
        ckpt_interval=3,
    )
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x 1 accumulation x 2 processes" in r.stdout
    run_train(
        tiny(
            data_dir,
            tmp_path / "one",
            gradient_accumulation_steps=2,
            max_iters=3,
            eval_interval=3,
            ckpt_interval=3,
        )
    )
    a = load_checkpoint(str(tmp_path / "ddp"))
    b = load_checkpoint(str(tmp_path / "one"))
    assert a["world_size"] == 2 and len(a["rng"]) == 2
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) < 1e-5
    la, lb = metrics(tmp_path / "ddp"), metrics(tmp_path / "one")
    assert [m.get("train_loss") for m in la] == pytest.approx(
        [m.get("train_loss") for m in lb], abs=1e-5
    )
    # and they really trained: the weights moved away from the initialisation (seed 42 on rank 0)
    torch.manual_seed(42)
    init = GPT(load_model(str(tmp_path / "one"))[0].config).state_dict()
    assert all(
        not torch.equal(init[k], b["model"][k]) for k in ("wte.weight", "blocks.0.attn.theta_beta")
    )


@pytest.mark.slow
def test_compiled_training_matches_eager(data_dir, tmp_path):
    run_train(tiny(data_dir, tmp_path / "eager", max_iters=3, eval_interval=3, ckpt_interval=3))
    run_train(
        tiny(
            data_dir,
            tmp_path / "compiled",
            max_iters=3,
            eval_interval=3,
            ckpt_interval=3,
            compile=True,
        )
    )
    a, b = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [m.get("train_loss") for m in a] == pytest.approx(
        [m.get("train_loss") for m in b], abs=1e-4
    )


def test_wandb_logging_on_request(data_dir, tmp_path, monkeypatch):
    """--wandb_log=True sends every metrics record (its numbers) to wandb, named after out_dir; off
    by default."""
    import importlib.machinery
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda data, step: calls.append(("log", step, data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_train(tiny(data_dir, tmp_path / "off", max_iters=2, eval_interval=2, ckpt_interval=2))
    assert calls == []
    run_train(
        tiny(
            data_dir, tmp_path / "on", max_iters=2, eval_interval=2, ckpt_interval=2, wandb_log=True
        )
    )
    (_, init), *logs = calls
    assert (
        init["name"] == "on" and init["project"] == "bam-gpt" and init["config"]["max_iters"] == 2
    )
    assert (
        [step for _, step, _ in logs] == [m["step"] for m in metrics(tmp_path / "on")] == [0, 1, 2]
    )
    assert (
        logs[-1][2]["val_loss"] == metrics(tmp_path / "on")[-1]["val_loss"]
        and "train_loss" in logs[-1][2]
    )
