"""``make demo``: execute ``notebooks/01_quickstart.ipynb`` headless (both probes on a model with
a planted ill-conditioned op) and write ``{out}/quickstart.html`` (plots inline) and
``{out}/quickstart_summary.txt``; the run's dumps land in ``{out}/quickstart_run``. Then
``notebooks/04_triage.ipynb`` the same way: ``{out}/triage.html``, ``{out}/triage_summary.txt``.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probekit.demo")
    parser.add_argument("--out", default="demo_out")
    args = parser.parse_args(argv)
    from .notebook.run import demo  # the notebook layer runs the quickstart in a real kernel

    print(demo(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
