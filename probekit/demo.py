"""``make demo``: a short training run of a small model under both probes, headless.

Writes its outputs under ``--out`` and prints a summary. (Extended by the notebook layer.)
"""
from __future__ import annotations

import argparse
import os

import torch

from . import PrecisionDebugger


def _train(model, steps, debugger=None, lr=0.1):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses = []
    for _ in range(steps):
        if debugger is not None and debugger.task == "free_benchmark":
            debugger.start()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if debugger is not None and debugger.task == "free_benchmark":
            debugger.stop()
            debugger.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probekit.demo")
    parser.add_argument("--out", default="demo_out")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for task in ("free_benchmark", "grad_probe"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        debugger = PrecisionDebugger(task=task, dump_path=os.path.join(args.out, task))
        try:
            if task == "grad_probe":
                debugger.monitor(model)
            losses = _train(model, 5, debugger)
            print(f"{task}: 5 steps, final loss {losses[-1]:.4f}")
        except NotImplementedError as exc:
            print(f"{task}: {exc}")
        finally:
            debugger.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
