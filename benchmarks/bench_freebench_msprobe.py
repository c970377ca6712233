"""msprobe 1.0.4 side of bench_freebench.py, and the model both sides time.

    python bench_freebench_msprobe.py --section '{"pert_mode": "bit_noise"}' --repeats 7 --dump DIR

(run with msprobe's venv python) prints one JSON object: plain and probed step times
([cpu_s, wall_s] each) and the number of rows msprobe wrote. Plain steps are timed first: once
msprobe has started, its API wrappers stay installed for the rest of the process. A 1-process gloo
group is initialised, without which msprobe 1.0.4 writes nothing on CPU.

The model (``build``): a small bf16 transformer-style block (LayerNorm, matmul, softmax, Linear,
GELU), two of them, trained with SGD on one torch thread. bench_freebench.py imports it from here,
so both tools time the very same step; msprobe itself is imported only inside ``main``.
"""
import argparse
import csv
import json
import os
import socket
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, T, B = 128, 512, 32, 4
#: named model sizes (D, H, T, B): "block" is the default above; "small" the issue-11 model
#: (d=256, 4 x 64 tokens), whose per-call costs dominate its step
SIZES = {"block": (128, 512, 32, 4), "small": (256, 1024, 64, 4)}


def set_size(name: str) -> None:
    """Select the model size ``build`` uses (``SIZES``)."""
    global D, H, T, B
    D, H, T, B = SIZES[name]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        h = self.ln(x)
        a = torch.softmax(torch.matmul(h, h.transpose(-1, -2)) * D ** -0.5, dim=-1)
        h = torch.matmul(a, h)
        return x + self.fc2(F.gelu(self.fc1(h)))


def build(seed: int = 0):
    """(step function, model): one training step = forward, loss, backward, SGD update."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(B, T, D, dtype=torch.bfloat16)

    def step():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return step, model


def timed(fn):
    """(CPU seconds of this thread, wall seconds) of one call."""
    c, w = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c, time.perf_counter() - w


def medians(samples):
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", required=True, help="free_benchmark section as JSON")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--size", default="block", choices=sorted(SIZES))
    a = ap.parse_args()
    set_size(a.size)
    os.makedirs(a.dump, exist_ok=True)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1,
                                         init_method=f"tcp://127.0.0.1:{free_port()}")
    step, _ = build()
    for _ in range(a.warmup):
        step()
    plain = [timed(step) for _ in range(a.repeats)]
    section = {"scope": [], "list": [], "fuzz_device": "npu", "pert_mode": "improve_precision",
               "handler_type": "check", "fuzz_level": "L1", "fuzz_stage": "forward",
               "if_preheat": False, "preheat_step": 15, "max_sample": 20}
    section.update(json.loads(a.section))
    cfg = {"task": "free_benchmark", "dump_path": a.dump, "rank": [], "step": [], "level": "L1",
           "seed": 1234, "is_deterministic": False, "enable_dataloader": False,
           "free_benchmark": section}
    path = os.path.join(a.dump, "config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    from msprobe.pytorch import PrecisionDebugger

    dbg = PrecisionDebugger(config_path=path)

    def probed():
        dbg.start()
        step()
        dbg.stop()
        dbg.step()

    for _ in range(a.warmup):
        probed()
    runs = [timed(probed) for _ in range(a.repeats)]
    rows = 0
    fb_csv = os.path.join(a.dump, "free_benchmark.csv")
    if os.path.exists(fb_csv):
        with open(fb_csv, encoding="utf-8-sig") as fh:
            rows = max(0, len(list(csv.reader(fh))) - 1)
    torch.distributed.destroy_process_group()
    print(json.dumps({"plain": plain, "probed": runs, "rows": rows, "steps": a.warmup + a.repeats}))


if __name__ == "__main__":
    main()
