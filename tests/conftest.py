import os
import sys

# The Triton kernel is tested on the CPU through Triton's interpreter; it must be switched on
# before triton is imported anywhere. On a CUDA machine, unset it (TRITON_INTERPRET=0) to test the
# compiled kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
