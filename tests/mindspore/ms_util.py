"""MindSpore runs in its own venv (.venv-mindspore, made by `make test`): its CPU wheel needs
numpy < 2. In any other venv these tests skip, or fail when PROBEKIT_REQUIRE_MINDSPORE=1."""
import os
import sys

import pytest


def require_mindspore():
    """The mindspore module; skips the calling test module (fails under make test) without it."""
    try:
        import mindspore
        if getattr(mindspore, "__file__", None) is None:  # only this tests/mindspore folder
            del sys.modules["mindspore"]
            raise ImportError("No module named 'mindspore'")
    except ImportError as exc:
        msg = (f"mindspore is not importable here ({exc}); the MindSpore tests run in "
               "`.venv-mindspore` (make it with `make .venv-mindspore/.installed`)")
        if os.environ.get("PROBEKIT_REQUIRE_MINDSPORE") == "1":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    return mindspore
