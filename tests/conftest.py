import os
import sys

# The Triton kernel is tested on the CPU through Triton's interpreter; it must be switched on
# before triton is imported anywhere. On a CUDA machine, unset it (TRITON_INTERPRET=0) to test the
# compiled kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_train(argv):
    """train.py's command line, run in this process as its own __main__ (no interpreter start-up):
    the script's globals when it ends (step, val_loss, last_checkpoint, ...). Its exceptions reach
    the caller; its stop signals' handlers are put back."""
    import runpy
    import signal
    from unittest import mock

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    excepthook = sys.excepthook
    try:
        with mock.patch.object(sys, "argv", [script, *map(str, argv)]):
            return runpy.run_path(script, run_name="__main__")
    finally:
        sys.excepthook = excepthook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def write_shard(path, tokens, tokenizer_name):
    """A shard at path, written as the prepare scripts write theirs: whole or not at all."""
    import data
    from infra.runtime import atomic_file

    with atomic_file(path) as f:
        data.write_shard(f, tokens, tokenizer_name)
