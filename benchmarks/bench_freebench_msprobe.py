"""msprobe 1.0.4 side of bench_freebench.py; run with msprobe's venv python.

    python bench_freebench_msprobe.py --section '{"pert_mode": "bit_noise"}' --repeats 7 --dump DIR

Prints one JSON object: plain and probed step times ([cpu_s, wall_s] each) and the number of rows
msprobe wrote. Plain steps are timed first: once msprobe has started, its API wrappers stay
installed for the rest of the process. A 1-process gloo group is initialised, without which msprobe
1.0.4 writes nothing on CPU.
"""
import argparse
import csv
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _fb_model import build, timed  # noqa: E402


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
    a = ap.parse_args()
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
