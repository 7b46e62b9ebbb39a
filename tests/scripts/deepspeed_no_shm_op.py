"""Runs a DeepSpeed script (argv[1], then its arguments) with DeepSpeed's optional
shared-memory comm op turned off: on first use it compiles C++ for minutes (cached in
``~/.cache/torch_extensions``), which a test on a fresh machine cannot afford; gloo does the
collectives either way.  ``deepspeed.ops.__compatible_ops__`` is the dict DeepSpeed consults
before it builds an op (its own comment: edits to it persist)."""

import runpy
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
