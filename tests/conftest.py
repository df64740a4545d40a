import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
from unittest import mock

import pytest

# The Triton kernel is tested on the CPU through Triton's interpreter; it must be switched on
# before triton is imported anywhere. On a CUDA machine, unset it (TRITON_INTERPRET=0) to test the
# compiled kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _patch_the_language_once_per_launch():
    """Triton's interpreter patches triton.language at a kernel's launch (_patch_lang), and again,
    never undone, at every call of a @triton.jit helper inside it: 40% of a kernel test's time. The
    helpers share the kernel's module, so the launch's patches are theirs: within a launch, a
    helper of the same module skips them. Any other call patches as before."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return

    launch = {}

    def patch_lang(fn):
        if launch.get("globals") is fn.__globals__:
            return interpreter._LangPatchScope()
        scope = original(fn)
        if not launch:
            launch["globals"] = fn.__globals__
            restore = scope.restore

            def restore_and_end_the_launch():
                launch.clear()
                restore()

            scope.restore = restore_and_end_the_launch
        return scope

    interpreter._patch_lang = patch_lang


if os.environ["TRITON_INTERPRET"] == "1":
    _patch_the_language_once_per_launch()


@contextlib.contextmanager
def _as_main(script, argv):
    """sys.argv as the script's command line; its stop signals' handlers and excepthook put back
    after it."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    excepthook = sys.excepthook
    try:
        with mock.patch.object(sys, "argv", [script, *map(str, argv)]):
            yield
    finally:
        sys.excepthook = excepthook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_train(argv):
    """train.py's command line, run in this process as its own __main__ (no interpreter start-up):
    the script's globals when it ends (step, val_loss, last_checkpoint, ...). Its exceptions reach
    the caller."""
    script = os.path.join(ROOT, "train.py")
    with _as_main(script, argv):
        return runpy.run_path(script, run_name="__main__")


def run_script_here(script, *args):
    """A script's command line as Python runs it, but in this process (no interpreter start-up):
    a CompletedProcess with its exit status, stdout and stderr. An uncaught exception goes through
    the excepthook the script installed and exits 1, as in Python."""
    path = os.path.join(ROOT, script)
    stdout = io.StringIO()
    stderr = io.StringIO()
    with (
        _as_main(path, args),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            runpy.run_path(path, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code or 0
        except Exception as error:
            sys.excepthook(type(error), error, error.__traceback__)
            status = 1
    return subprocess.CompletedProcess([path, *args], status, stdout.getvalue(), stderr.getvalue())


@pytest.fixture
def gpu_driver(monkeypatch):
    """Under the interpreter, Triton's driver stands in for an H100 (sm_90), as in
    dev/compile_check.py: the kernel's host code asks it for the GPU, so the interpreter runs that
    GPU's tiles where INTERPRET_BLOCKS is None. On a GPU (TRITON_INTERPRET=0): the GPU's own."""
    if os.environ["TRITON_INTERPRET"] != "1":
        yield
        return
    monkeypatch.syspath_prepend(os.path.join(ROOT, "dev"))
    import compile_check

    with compile_check.stand_in(90):
        yield


def write_shard(path, tokens, tokenizer_name):
    """A shard at path, written as the prepare scripts write theirs: whole or not at all."""
    import data
    from infra.runtime import atomic_file

    with atomic_file(path) as f:
        data.write_shard(f, tokens, tokenizer_name)
