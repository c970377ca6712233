import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _children_temp_folder():
    """Child processes (torchrun's agents, kernels, servers, chromium) make their temporary
    files in one folder of this session, removed at its end: torchrun leaves a
    ``torchelastic_*`` folder in the temporary folder at every launch."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="probekit-tests-")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield folder
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def msprobe_config_dict():
    """msprobe 1.0.4's shipped config.json, every section present, as a user would have it."""
    return {
        "task": "free_benchmark", "dump_path": "./dump_path", "rank": [], "step": [],
        "level": "L1", "seed": 1234, "is_deterministic": False, "enable_dataloader": False,
        "acl_config": "",
        "tensor": {"scope": [], "list": [], "data_mode": ["all"], "backward_input": [],
                   "file_format": "npy"},
        "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                       "summary_mode": "statistics"},
        "overflow_check": {"overflow_nums": 1, "check_mode": "all"},
        "run_ut": {"white_list": [], "black_list": [], "error_data_path": "./"},
        "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]},
        "free_benchmark": {"scope": [], "list": [], "fuzz_device": "npu",
                           "pert_mode": "improve_precision", "handler_type": "check",
                           "fuzz_level": "L1", "fuzz_stage": "forward", "if_preheat": False,
                           "preheat_step": 15, "max_sample": 20},
    }


@pytest.fixture
def one_thread():
    """torch on one thread for the test, its thread count set back after: the free benchmark's
    exact expectations (rows, operator counts) are those of one thread's reduction order."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def python_exe():
    return sys.executable


# -- synthetic grad-probe datasets (tests/synthetic_grads.py) --------------------------------------
from synthetic_grads import GRAD_PARAMS_DIVERGING, compare_synthetic, make_grads  # noqa: E402


@pytest.fixture
def grads_l2():
    return make_grads()


@pytest.fixture
def grads_pair():
    """Two runs of rank 0; run b diverges on the attention weight from step 4."""
    return make_grads(seed=1), make_grads(seed=2, diverge_param=GRAD_PARAMS_DIVERGING, diverge_at=4)


@pytest.fixture
def grads_cmp(grads_pair):
    return compare_synthetic([grads_pair[0]], [grads_pair[1]])
