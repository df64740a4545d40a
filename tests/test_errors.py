"""Every script's expected failure, as a user meets it: one line `<script>: error: ...` on stderr,
exit status 1, no traceback. The scripts run as their own __main__ in this process (no interpreter
start-up per case); one case runs each evaluation under a new Python, as a user does."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_script_here, write_shard

from data import get_tokenizer
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVALS = ("eval_passkey.py", "eval_ppl.py", "eval_ruler.py")


def run_script(script, *args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def assert_one_line_error(r, script, *needles):
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), r.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    enc = get_tokenizer("byte")
    tokens = [
        t
        for i in range(200)
        for t in [enc.eot_token] + enc.encode_ordinary(f"document number {i} is short")
    ]
    write_shard(str(d / "tiny_val_000000.bin"), tokens[:2000], "byte")
    write_shard(str(d / "tiny_train_000001.bin"), tokens[2000:], "byte")
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "ckpt_0000001.pt"
    torch.manual_seed(0)
    save_checkpoint(
        str(path),
        GPT(
            GPTConfig(
                vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16, block_size=32
            )
        ),
        step=1,
    )
    return path


def test_train_truncated_shard(data_dir, tmp_path):
    broken = tmp_path / "data"
    broken.mkdir()
    for f in os.listdir(data_dir):
        (broken / f).write_bytes((data_dir / f).read_bytes())
    with open(broken / "tiny_train_000001.bin", "r+b") as f:
        f.truncate(os.path.getsize(broken / "tiny_train_000001.bin") - 10)
    r = run_script_here(
        "train.py",
        f"--data_dir={broken}",
        f"--out_dir={tmp_path / 'out'}",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=32",
        "--batch_size=2",
        "--gradient_accumulation_steps=1",
    )
    assert_one_line_error(r, "train.py", "tiny_train_000001.bin", "truncated")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "impl,triton_version,needle",
    [
        ("sdpa", None, "impl='sdpa' cannot train a prior"),
        ("flex", None, "unknown attention impl 'flex'"),
        ("triton", "3.3.1", "the Triton kernel needs Triton 3.4 or newer, not 3.3.1"),
    ],
)
def test_train_refuses_an_attn_impl_that_cannot_train(
    data_dir, tmp_path, monkeypatch, impl, triton_version, needle
):
    """On the CPU: sdpa cannot train a prior, flex is no impl; and a Triton older than the kernel's
    floor (its version string says so) is named with the version needed."""
    if triton_version:
        triton = pytest.importorskip("triton")
        monkeypatch.setattr(triton, "__version__", triton_version)
    r = run_script_here(
        "train.py",
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path / 'out'}",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=16",
        "--block_size=32",
        "--batch_size=2",
        "--gradient_accumulation_steps=1",
        f"--attn_impl={impl}",
    )
    assert r.returncode == 1 and r.stderr.startswith("train.py: error: invalid settings:"), (
        r.stderr[-2000:]
    )
    assert "Traceback" not in r.stderr and needle in r.stderr
    assert not (tmp_path / "out").exists()


def test_train_config_file_with_a_syntax_error(tmp_path):
    bad = tmp_path / "bad_config.py"
    bad.write_text("batch_size = 4\nlearning_rate = = 1e-3\n")
    assert_one_line_error(
        run_script_here("train.py", bad, "--device=cpu"), "train.py", "bad_config.py", "line 2"
    )


@pytest.mark.parametrize("script", EVALS)
def test_eval_missing_checkpoint(script, tmp_path):
    r = run_script(
        script, "--ckpt", tmp_path / "nowhere", "--out", tmp_path / "res", "--device", "cpu"
    )
    assert_one_line_error(r, script, "no checkpoint at", "nowhere")


@pytest.mark.parametrize("script", EVALS)
def test_eval_garbage_checkpoint(script, tmp_path):
    (tmp_path / "ckpt_0000001.pt").write_bytes(b"this is not a checkpoint" * 100)
    r = run_script_here(script, "--ckpt", tmp_path, "--out", tmp_path / "res", "--device", "cpu")
    assert_one_line_error(r, script, "could not read checkpoint", "ckpt_0000001.pt")


def test_eval_ppl_missing_data_dir(ckpt, tmp_path):
    r = run_script_here(
        "eval_ppl.py",
        "--ckpt",
        ckpt,
        "--data_dir",
        tmp_path / "nowhere",
        "--out",
        tmp_path / "res",
        "--device",
        "cpu",
        "--seq_len",
        "64",
    )
    assert_one_line_error(r, "eval_ppl.py", "data directory", "does not exist")
    r = run_script_here(
        "eval_ppl.py",
        "--ckpt",
        ckpt,
        "--out",
        tmp_path / "res",
        "--device",
        "cpu",
        "--seq_len",
        "64",
    )
    assert_one_line_error(r, "eval_ppl.py", "record no training data directory", "--data_dir")


def test_prepare_fineweb_missing_input(tmp_path):
    r = run_script_here(
        "prepare_fineweb.py",
        "--local_files",
        tmp_path / "missing.jsonl",
        "--tokenizer",
        "byte",
        "--out_dir",
        tmp_path / "d",
    )
    assert_one_line_error(r, "prepare_fineweb.py", "no file matches", "missing.jsonl")


def test_prepare_fineweb_no_text_column(tmp_path):
    (tmp_path / "other.jsonl").write_text(
        "\n".join(json.dumps({"body": f"text {i}"}) for i in range(3)) + "\n"
    )
    r = run_script_here(
        "prepare_fineweb.py",
        "--local_files",
        tmp_path / "other.jsonl",
        "--tokenizer",
        "byte",
        "--out_dir",
        tmp_path / "d",
        "--num_proc",
        "2",
    )
    assert_one_line_error(r, "prepare_fineweb.py", "no column 'text'", "--text_column")


def test_a_gpu_without_native_bfloat16_is_told_apart(monkeypatch):
    """A T4 (compute capability 7.5) emulates bfloat16; torch.cuda.is_bf16_supported() says yes."""
    import eval_common
    from infra import runtime

    for capability, native in (((7, 5), False), ((8, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
        assert runtime.native_bf16("cuda") is native
        assert eval_common.resolve_dtype("cuda") == ("bfloat16" if native else "float16")
