"""Writing files safely on a shared cluster: a full disk (a fault injected at the write), a writer
killed by SIGKILL (real processes), and two evaluations started into one --out (real processes)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import eval_passkey
import prepare_fineweb
from infra.runtime import LOCK_NAME, atomic_file, save_checkpoint
from model import GPT, CheckpointError, GPTConfig, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A disk that fills up: once `room` bytes have gone into files whose path matches `target`, every
# write to any file fails with ENOSPC, as the kernel's would (the write that fills the disk writes
# what fits). It replaces open() and os.fdopen(), the two ways the repo opens a file to write.
FULL_DISK = r"""
import builtins, errno, io, os, re

_real_open = builtins.open
_real_fdopen = os.fdopen
_disk = {}


class _File(io.FileIO):
    def write(self, data):
        if _disk["full"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not re.search(_disk["target"], self.path):
            return super().write(data)

        data = bytes(data)
        if len(data) > _disk["room"]:
            _disk["full"] = True
            data = data[: _disk["room"]]
            if not data:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _disk["room"] -= len(data)
        return super().write(data)


def _wrap(raw, path, mode, encoding=None, errors=None, newline=None):
    raw.path = os.path.abspath(path)
    buffered = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
    if "b" in mode:
        return buffered
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, newline=newline)


def _open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
          opener=None):
    if isinstance(file, int) or not set(mode) & set("wax+"):
        return _real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    raw = _File(file, mode.replace("b", "").replace("t", ""), closefd, opener)
    return _wrap(raw, file, mode, encoding, errors, newline)


def _fdopen(fd, mode="r", **kwargs):
    if not set(mode) & set("wax+"):
        return _real_fdopen(fd, mode, **kwargs)
    raw = _File(fd, "r+" if "+" in mode else "w")
    return _wrap(raw, os.readlink(f"/proc/self/fd/{fd}"), mode, **kwargs)


def fill_disk(target, room, setattr=setattr):
    _disk.update(target=target, room=room, full=False)
    setattr(builtins, "open", _open)
    setattr(os, "fdopen", _fdopen)
"""

# Run a script (argv[1:]) on a disk that fills (FULL_TARGET, FULL_ROOM in the environment).
ON_A_FULL_DISK = (
    FULL_DISK
    + r"""
import runpy, sys
fill_disk(os.environ["FULL_TARGET"], int(os.environ["FULL_ROOM"]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
)


def fill_disk(monkeypatch, target, room):
    """This process's disk fills after `room` bytes into files whose path matches target."""
    namespace = {}
    exec(FULL_DISK, namespace)
    namespace["fill_disk"](target, room, monkeypatch.setattr)


def run(*argv, env=None, **kwargs):
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
        **kwargs,
    )


def on_a_full_disk(target, room, script, *args):
    """Run script's command line on a disk that fills after room bytes into files matching
    target."""
    env = dict(FULL_TARGET=target, FULL_ROOM=str(room))
    return run("-c", ON_A_FULL_DISK, script, *args, env=env)


def one_line_error(proc, script, *needles):
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"{script}: error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def temporaries(folder):
    return [name for name in os.listdir(folder) if ".tmp" in name]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16, block_size=32
    )
    return GPT(config)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny byte-level checkpoints in run directories runA/ and runB/."""
    root = tmp_path_factory.mktemp("ckpts")
    for seed, name in enumerate(["runA", "runB"]):
        save_checkpoint(str(root / name / "ckpt_10.pt"), tiny_model(seed), step=10)
    return [str(root / "runA"), str(root / "runB")]


# ---- A full disk ---------------------------------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_write(tmp_path, monkeypatch):
    """One line that says so, no temporary file, the previous checkpoint intact."""
    save_checkpoint(str(tmp_path / "ckpt_0000001.pt"), tiny_model(), step=1)

    fill_disk(monkeypatch, r"ckpt_0000002\.pt", 3000)
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(str(tmp_path / "ckpt_0000002.pt"), tiny_model(), step=2)
    monkeypatch.undo()

    assert re.fullmatch(
        rf"no space left for the checkpoint in {re.escape(str(tmp_path))} \([\d,]+ bytes free\)",
        str(error.value),
    )
    assert os.listdir(tmp_path) == ["ckpt_0000001.pt"]
    assert load_checkpoint(str(tmp_path))["step"] == 1


def test_another_write_error_names_the_checkpoint(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    path = tmp_path / "run" / "ckpt_0000001.pt"
    with pytest.raises(CheckpointError, match=rf"could not write the checkpoint {path}: "):
        save_checkpoint(str(path), tiny_model())


def test_an_evaluation_on_a_full_disk_resumes(tmp_path, ckpts):
    """The disk fills in the middle of a JSONL record, then while writing the summary: each time
    one line and exit 1, no temporary file, only whole records; a rerun ends where an uninterrupted
    run does."""
    args = ["--ckpt", ckpts[0], "--lengths", "400", "--samples", "3", "--no_progress"]
    reference = eval_passkey.main([*args, "--out", str(tmp_path / "reference")])["records"]
    one_record = len(json.dumps(reference[0]))

    out = tmp_path / "out"
    faults = [(r"samples\.jsonl$", one_record + 20, 1), (r"passkey_summary\.json", 10, 3)]
    for target, room, whole_records in faults:
        proc = on_a_full_disk(target, room, "eval_passkey.py", *args, "--out", str(out))
        one_line_error(proc, "eval_passkey.py", f"no space left in {out} (", "it resumes")
        assert not temporaries(out) and not (out / "passkey_summary.json").exists()
        with open(out / "passkey_samples.jsonl") as f:
            text = f.read()
        assert text.endswith("\n") and len(text.splitlines()) == whole_records
        assert [json.loads(line) for line in text.splitlines()]

    records = eval_passkey.main([*args, "--out", str(out)])["records"]
    correct = [(r["sample"], r["correct"]) for r in records]
    assert correct == [(r["sample"], r["correct"]) for r in reference]


def prepare_args(tmp_path):
    source = tmp_path / "docs.jsonl"
    texts = [f"document {i}: " + "the quick brown fox " * (i % 7 + 1) for i in range(120)]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    small = ["--val_tokens", "500", "--gap_tokens", "0", "--shard_size", "1000"]
    return ["--local_files", str(source), "--tokenizer", "byte", "--num_proc", "1", *small]


@pytest.mark.parametrize(
    "target,unlisted", [(r"_train_000002\.bin", set()), (r"meta\.json", {"docs_val_000000.bin"})]
)
def test_prepare_fineweb_on_a_full_disk_resumes(tmp_path, target, unlisted):
    """The disk fills inside a shard, or inside meta.json right after the first shard: one line,
    exit 1, no partial shard under a shard's name (a whole one meta.json does not vouch for yet is
    written again); the rerun resumes and ends byte-identical."""
    args = prepare_args(tmp_path)
    prepare_fineweb.main([*args, "--out_dir", str(tmp_path / "reference")])

    out = tmp_path / "out"
    proc = on_a_full_disk(target, 700, "prepare_fineweb.py", *args, "--out_dir", str(out))
    one_line_error(proc, "prepare_fineweb.py", f"no space left in {out} (", "resumes")
    assert not temporaries(out)
    with open(out / "meta.json") as f:
        vouched = json.load(f)["resume"]["shards"]
    shards = {name for name in os.listdir(out) if name.endswith(".bin")}
    index = {name: int(prepare_fineweb.SHARD_RE.match(name).group(3)) for name in shards}
    listed = {name for name in shards if index[name] < vouched}
    assert len(listed) == vouched and shards - listed == unlisted

    prepare_fineweb.main([*args, "--out_dir", str(out)])
    for name in os.listdir(tmp_path / "reference"):
        if name.endswith(".bin"):
            assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


# ---- One writer per folder ----------------------------------------------------------------------
OWN_FOLDER = "from infra import runtime; import sys; runtime.own_folder(sys.argv[1])"
OWNER = r"""
import sys, time
from infra import runtime

runtime.own_folder(sys.argv[1])
print("owning", flush=True)
time.sleep(120)
"""


def test_the_owner_removes_temporaries_and_a_second_owner_is_refused(tmp_path):
    names = ["ckpt_0000100.pt.tmp", "fw_train_000001.bin.tmp", "meta.json.tmp"]
    kept = ["ckpt_0000100.pt", "notes.tmp.old"]
    for name in names + kept:
        (tmp_path / name).write_text("x")

    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        notes = [owner.stdout.readline() for _ in names]
        assert owner.stdout.readline() == "owning\n"
        assert notes == [
            f"note: removed {name} from {tmp_path}, left by a writer that ended\n"
            for name in sorted(names)
        ]
        assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, *kept])

        # a second process is refused, naming the owner
        refused = run("-c", OWN_FOLDER, str(tmp_path))
        assert "FolderBusy" in refused.stderr
        assert f"is in use by another process (pid {owner.pid} on" in refused.stderr
    finally:
        owner.kill()
        owner.wait(timeout=30)

    # the kernel dropped the lock with the process: the folder is free again
    again = run("-c", OWN_FOLDER, str(tmp_path))
    assert again.returncode == 0, again.stderr


def test_atomic_file_replaces_a_dead_writer_of_the_same_name(tmp_path):
    """A killed writer's temporary under the same name is overwritten."""
    path = tmp_path / "meta.json"
    (tmp_path / "meta.json.tmp").write_text("stale")
    with atomic_file(path, "w") as f:
        f.write("{}")
    assert os.listdir(tmp_path) == ["meta.json"] and path.read_text() == "{}"


def test_atomic_file_leaves_nothing_on_an_exception(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(path, "w") as f:
            f.write("new, half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["summary.json"] and path.read_text() == "old"


# ---- Two evaluations into one folder -------------------------------------------------------------
# eval_passkey.py whose evaluation waits, once it holds its --out, until the file $GO exists.
HELD = r"""
import os, sys, time
import eval_common, eval_passkey
from infra import runtime

sys.argv = ["eval_passkey.py", *sys.argv[1:]]
runtime.own_folder(sys.argv[sys.argv.index("--out") + 1])
print("holding", flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.05)
runtime.errors_in_one_line("eval_passkey.py", eval_common.EXPECTED_ERRORS, "free some")
eval_passkey.main(sys.argv[1:])
"""


def test_a_second_evaluation_into_a_busy_folder_refuses(tmp_path, ckpts):
    out = tmp_path / "res"
    go = tmp_path / "go"
    args = ["--lengths", "400", "--samples", "2", "--no_progress", "--out", str(out)]
    first = subprocess.Popen(
        [sys.executable, "-c", HELD, "--ckpt", ckpts[0], *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, GO=str(go)),
    )
    try:
        assert first.stdout.readline() == "holding\n"
        second = run("eval_passkey.py", "--ckpt", ckpts[1], *args)
    finally:
        go.touch()
        first_out, first_err = first.communicate(timeout=120)

    line = one_line_error(second, "eval_passkey.py")
    holder = f"pid {first.pid} on {socket.gethostname()}: eval_passkey.py --ckpt {ckpts[0]}"
    assert line == (
        f"eval_passkey.py: error: {out} is in use by another process ({holder} "
        f"{' '.join(args)}); wait for it to end, or give this one another folder"
    )

    # the first ends as if alone: every sample of its checkpoint, its summary row
    assert first.returncode == 0, first_err[-3000:]
    with open(out / "passkey_samples.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert sorted(r["sample"] for r in records) == [0, 1]
    assert {r["label"] for r in records} == {"runA"}
    with open(out / "passkey_summary.json") as f:
        assert [row["label"] for row in json.load(f)] == ["runA"]

    # once the first has ended, the folder is free
    eval_passkey.main(["--ckpt", ckpts[1], *args])
    assert (out / LOCK_NAME).exists()
