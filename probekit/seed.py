"""``seed`` and ``is_deterministic`` of the config: seed every generator a training run uses."""
from __future__ import annotations

import os
import random

import numpy as np


def seed_all(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); optionally force deterministic algorithms."""
    import torch

    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily) in current torch
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "manual_seed_all"):
        npu.manual_seed_all(seed)
    if deterministic:
        set_deterministic()


def set_deterministic() -> None:
    """Force deterministic algorithms (touches no random generator)."""
    import torch

    # cuBLAS needs a fixed workspace for deterministic results; it must be set before the first
    # cuBLAS call, so set it here and leave any value the user chose.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
