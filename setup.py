"""The one compiled part: the grad probe's fused statistics kernel
(probekit/grads/numerics/_kernel.c), which also holds the free benchmark's one-pass bit_noise
and comparison (probekit/freebench/perturb/fused.py loads it through ctypes).

Optional: where it cannot be built (no C compiler) probekit installs without it and the grad
probe uses its numpy twin (probekit/grads/numerics/kernel.py), slower, same values. Everything
else about the package is in pyproject.toml.
"""
import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-fno-strict-aliasing"]
setup(ext_modules=[Extension("probekit.grads.numerics._kernel",
                             ["probekit/grads/numerics/_kernel.c"],
                             extra_compile_args=flags, optional=True)])
