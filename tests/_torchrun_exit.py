"""How the torchrun scripts of the tests end: both ranks leave together, then the process ends
without the interpreter's finalization.

A gloo rank tearing the process group down while the other is still in its last collective
aborted once; and with the process group destroyed, gloo's worker threads may still hold work
objects whose tensors keep Python references, and destroying them during interpreter
finalization takes the GIL and aborts (SIGABRT, "terminate called without an active
exception": pytorch/pytorch#179291, #190489; seen here in about one full suite run of ten).
Everything a test reads was written and closed before this is called."""
import gc
import os
import sys

import torch.distributed as dist


def finish() -> None:
    dist.barrier()
    gc.collect()  # the models' reducers and pending work objects, while Python is whole
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
