"""train.py on a cluster, with real processes and real signals: a signal stops a run after its
current step with a checkpoint and a documented exit code, and the resumed run ends bitwise equal to
an uninterrupted one (one process, and torchrun with 2 gloo ranks); a full disk during a checkpoint
is one line and loses nothing; a writer killed mid-checkpoint leaves nothing behind a resume."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import run_train
from test_disk import on_a_full_disk
from test_train import ROOT, data_dir, metrics, tiny  # noqa: F401 (data_dir is a fixture)

from infra import runtime
from model import checkpoints, load_checkpoint

TRAIN_PY = os.path.join(ROOT, "train.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ENV = dict(os.environ, OMP_NUM_THREADS="1")

# long enough for a signal to land mid-run (the tiny data repeats), short enough for the default run
STEPS = 120
LONG_RUN = dict(
    max_iters=STEPS, allow_data_repeat=True, eval_interval=60, ckpt_interval=60, log_interval=1
)


def start(command):
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(out_dir, step, process, timeout=120):
    """Wait until metrics.jsonl records `step`: the run is training, past that step."""
    deadline = time.time() + timeout
    path = os.path.join(out_dir, "metrics.jsonl")
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()
        if os.path.exists(path) and any(m["step"] >= step for m in metrics(out_dir)):
            return
        time.sleep(0.005)
    raise AssertionError(f"the run did not reach step {step} in {timeout} s")


def children(pid):
    """The pids whose parent is pid (torchrun's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def assert_same_run(resumed_dir, full_dir):
    """Weights, optimizer state, step and every logged loss of the two runs are bitwise equal."""
    a = load_checkpoint(str(resumed_dir))
    b = load_checkpoint(str(full_dir))
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])

    state_a = a["optimizer"]["state"]
    state_b = b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[index][name]))

    timing = ("tokens_per_s", "ms_per_step", "mfu")
    losses_a = [{k: v for k, v in m.items() if k not in timing} for m in metrics(resumed_dir)]
    losses_b = [{k: v for k, v in m.items() if k not in timing} for m in metrics(full_dir)]
    assert losses_a == losses_b


def stopped_step(out_dir):
    return checkpoints(str(out_dir))[-1][0]


def test_sigterm_stops_after_the_step_and_the_resume_is_exact(data_dir, tmp_path):  # noqa: F811
    at_least = random.randint(3, STEPS - 30)
    stopped = tmp_path / "stopped"
    process = start([sys.executable, TRAIN_PY, *tiny(data_dir, stopped, **LONG_RUN)])
    wait_for_step(stopped, at_least, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)

    step = stopped_step(stopped)
    assert process.returncode == runtime.EXIT_PREEMPTED, (at_least, err)
    assert at_least <= step < STEPS, (at_least, step)
    assert f"stopped by SIGTERM after step {step}; checkpoint" in out
    assert metrics(stopped)[-1]["step"] == step and err == ""

    # the resume and the uninterrupted run in this process, on one thread as the stopped one was
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_train(tiny(data_dir, stopped, **LONG_RUN, resume=True))["step"] == STEPS
        run_train(tiny(data_dir, tmp_path / "full", **LONG_RUN))
    finally:
        torch.set_num_threads(threads)
    assert_same_run(stopped, tmp_path / "full")


def test_ctrl_c_saves_the_step_and_exits_130(data_dir, tmp_path):  # noqa: F811
    """At a terminal, Ctrl-C does what a preemption does: the step ends, the checkpoint is written,
    and the exit code is the shell's for an interrupt."""
    stopped = tmp_path / "stopped"
    # one process reads its stop signals every step, not only at log steps
    args = tiny(data_dir, stopped, **dict(LONG_RUN, log_interval=7))
    process = start([sys.executable, TRAIN_PY, *args])
    wait_for_step(stopped, 3, process)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)

    step = stopped_step(stopped)
    assert process.returncode == runtime.EXIT_INTERRUPTED, err
    assert 3 <= step < STEPS and f"stopped by SIGINT after step {step}; checkpoint" in out
    assert "Traceback" not in err


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_two_ranks_stop_at_one_step_and_resume_exactly(data_dir, tmp_path):  # noqa: F811
    """SIGTERM to both workers of torchrun (as a cluster signals every process of a job): they agree
    on one step, rank 0 writes its checkpoint, each exits 75, and the resume under torchrun ends
    equal to an uninterrupted torchrun run."""
    at_least = random.randint(3, STEPS - 30)
    ddp = dict(LONG_RUN, gradient_accumulation_steps=2)
    launch = [TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN_PY]
    stopped = tmp_path / "stopped"
    process = start([*launch, *tiny(data_dir, stopped, **ddp)])
    # the uninterrupted run, alongside: torchrun's start-up is mostly waiting
    full = start([*launch, *tiny(data_dir, tmp_path / "full", **ddp)])
    wait_for_step(stopped, at_least, process)
    for worker in children(process.pid):
        os.kill(worker, signal.SIGTERM)
    out, err = process.communicate(timeout=120)

    step = stopped_step(stopped)
    assert at_least <= step < STEPS, (at_least, step)
    assert f"stopped by SIGTERM after step {step}; checkpoint" in out, err[-3000:]
    # torchrun reports a worker's code, and counts any but 0 as a failure
    assert "exitcode: 75" in err and "exitcode: 1 " not in err, err[-3000:]
    assert load_checkpoint(str(stopped))["world_size"] == 2

    resume = start([*launch, *tiny(data_dir, stopped, **ddp, resume=True)])
    out, err = resume.communicate(timeout=240)
    assert resume.returncode == 0, err[-3000:]
    out, err = full.communicate(timeout=240)
    assert full.returncode == 0, err[-3000:]
    assert_same_run(stopped, tmp_path / "full")


def run_with_save(body, args, timeout=240):
    """train.py's command line in a process whose torch.save is replaced by body(obj, file, call):
    a fault injected at the checkpoint write. Returns the Popen."""
    wrapper = "\n".join(
        [
            "import errno, os, runpy, sys, time, torch",
            "real_save, calls = torch.save, []",
            "def save(obj, f, *args, **kwargs):",
            "    calls.append(1)",
            "    call = len(calls)",
            body,
            "    return real_save(obj, f, *args, **kwargs)",
            "torch.save = save",
            f"sys.argv = [{TRAIN_PY!r}, *{args!r}]",
            f"runpy.run_path({TRAIN_PY!r}, run_name='__main__')",
        ]
    )
    return start([sys.executable, "-c", wrapper])


def test_a_full_disk_at_a_checkpoint_is_one_line_and_loses_nothing(data_dir, tmp_path):  # noqa: F811
    # the disk fills 3,000 bytes into the second checkpoint; keep_last=1 must not delete the first
    out_dir = tmp_path / "run"
    args = tiny(data_dir, out_dir, max_iters=6, ckpt_interval=3, keep_last=1)
    process = on_a_full_disk(r"ckpt_0000006\.pt", 3000, "train.py", *args)

    assert process.returncode == 1 and process.stderr.count("\n") == 1, process.stderr
    assert process.stderr.startswith(
        f"train.py: error: no space left for the checkpoint in {out_dir} ("
    )
    assert f"the last good checkpoint is {out_dir / 'ckpt_0000003.pt'}" in process.stderr
    assert sorted(os.listdir(out_dir)) == [
        ".lock",
        "ckpt_0000003.pt",
        "config.json",
        "env.json",
        "metrics.jsonl",
    ]
    assert load_checkpoint(str(out_dir))["step"] == 3


def test_a_writer_killed_mid_checkpoint_leaves_nothing_on_resume(data_dir, tmp_path, capsys):  # noqa: F811
    out_dir = tmp_path / "run"
    ready = tmp_path / "writing"
    args = tiny(data_dir, out_dir, max_iters=6, ckpt_interval=3)
    # the second checkpoint writes 4 KiB, says so, and hangs there until it is killed
    body = "\n".join(
        [
            "    if call == 2:",
            "        f.write(b'x' * 4096)",
            "        f.flush()",
            f"        open({str(ready)!r}, 'w').close()",
            "        time.sleep(600)",
        ]
    )
    process = run_with_save(body, args)
    deadline = time.time() + 120
    while not ready.exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.01)
    process.kill()
    process.communicate(timeout=60)
    assert [f for f in os.listdir(out_dir) if f.endswith(".tmp")], "the killed writer left its file"

    assert run_train(tiny(data_dir, out_dir, max_iters=6, resume=True))["step"] == 6
    assert "note: removed ckpt_0000006.pt.tmp" in capsys.readouterr().out
    assert not [f for f in os.listdir(out_dir) if ".tmp" in f]
    assert load_checkpoint(str(out_dir))["step"] == 6
