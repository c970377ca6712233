"""Free benchmark: what the replayed random stream adds to a random call's check.

    python benchmarks/bench_freebench_random.py [--calls 100] [--repeats 9] [--out FILE.json]

A random call (``F.dropout`` in training, SDPA with ``dropout_p > 0``) is checked like any call,
plus ``rng.Replay``: the generator states saved before the real call (``get_state``, 5 KB for the
CPU generator) and, around the re-run, the current states read and the saved ones set, then the
current ones set back. The same calls are checked again with the replay switched off for the
measurement only (``rng.plan`` patched to answer None: the call is checked as a deterministic
one would be; its re-run then draws another mask, so those verdicts are meaningless, and the
training's stream moves): the difference of the two is the replay's cost. Timed: the loop of
``--calls`` calls inside ``with fb:`` (thread CPU time, one torch thread; the step's gather after
the loop, where the off variant's wrong verdicts become rows, is not timed), medians of
``--repeats`` rounds after two warm-up rounds; ``plain``: the same loop without the probe. Also
the dispatched ATen operators per checked call with and without the replay (torch.profiler's
top-level ``aten::`` events).

``lstm``: a 2-layer ``nn.LSTM`` with dropout between the layers, whose masks are drawn inside
the one ``torch.lstm`` call: no rule lists it, it is found by watching the generators at its
signature's first call (``rng.observe``), then replayed and verified like a listed call; the
replay-off variant switches the observation off too.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

MODES = ("improve_precision", "bit_noise")


def ops():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g)
    big = torch.randn(512, 512, generator=g)
    q = torch.randn(2, 4, 64, 32, generator=g)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(32, 32, num_layers=2, dropout=0.3, batch_first=True).train()
    s = torch.randn(4, 16, 32, generator=g)
    return {
        "lstm 2 layers, dropout 0.3, 4x16x32": lambda: lstm(s)[0],
        "dropout 64x64": lambda: F.dropout(a, 0.3),
        "dropout 512x512": lambda: F.dropout(big, 0.3),
        "sdpa 2x4x64x32 dropout_p=0.1": lambda: F.scaled_dot_product_attention(q, q, q,
                                                                              dropout_p=0.1),
    }


def top_level_aten(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        n += p is None
    return n


class _ReplayOff:
    """``rng.plan`` answering None while entered: the call is checked as a deterministic one."""

    def __enter__(self):
        from probekit.freebench.engine import intercept

        self.mod, self.plan, self.observe = intercept.rng, intercept.rng.plan, \
            intercept.rng.observe
        self.mod.plan = self.mod.observe = lambda *a, **k: None

    def __exit__(self, *exc):
        self.mod.plan, self.mod.observe = self.plan, self.observe


def measure(op: str, fn, mode: str, calls: int, repeats: int) -> list:
    """Rounds alternate: plain loop, probed loop with the replay, probed loop without it (two
    sessions, one per variant), so the machine's load drifts over all three alike."""
    import contextlib

    import probekit

    sessions = {v: probekit.FreeBench(dump_path=tempfile.mkdtemp(prefix="bench_rnd_"),
                                      pert_mode=mode) for v in (True, False)}

    def loop():
        for _ in range(calls):
            fn()

    def probed(replay):
        fb = sessions[replay]
        with contextlib.nullcontext() if replay else _ReplayOff():
            with fb:
                t = time.thread_time()
                loop()
                dt = time.thread_time() - t
            fb.step()
        return dt

    def plain():
        t = time.thread_time()
        loop()
        return time.thread_time() - t

    for _ in range(2):
        plain(), probed(True), probed(False)
    checked0 = {v: fb._engine.checked for v, fb in sessions.items()}
    times = {"plain": [], True: [], False: []}
    for _ in range(repeats):
        times["plain"].append(plain())
        times[True].append(probed(True))
        times[False].append(probed(False))
    out = []
    n_plain = top_level_aten(loop)
    p = statistics.median(times["plain"]) / calls
    for replay, fb in sessions.items():
        assert (fb._engine.checked - checked0[replay]) == calls * repeats, (op, mode)
        with contextlib.nullcontext() if replay else _ReplayOff():
            with fb:
                n_probed = top_level_aten(loop)
            fb.step()
        q = statistics.median(times[replay]) / calls
        out.append({"op": op, "mode": mode, "replay": replay, "plain_us": p * 1e6,
                    "probed_us": q * 1e6, "overhead_us": (q - p) * 1e6,
                    "aten_per_check": (n_probed - n_plain) / calls})
    return out


def fixed_costs(repeats: int) -> list:
    """What watching the generators costs, apart (``timeit``, best of ``repeats``): building and
    looking up the call signature, which every checked call of an unlisted API pays (a 2-tensor
    call, and ``torch.lstm``'s 17 arguments); observing a signature's first call (saving the
    CPU generator's state, then comparing it after the call), paid once per signature; and the
    CPU test that a fast verdict is conclusive (``deferred._finite``, four values), which every
    fast check pays."""
    import timeit

    from probekit.freebench.judge import deferred, metric
    from probekit.freebench.engine import rng
    from probekit.freebench.perturb.perturb import flatten

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    lstm = torch.nn.LSTM(32, 32, num_layers=2, dropout=0.3)
    lstm_leaves, _ = flatten((torch.randn(4, 16, 32), (torch.zeros(2, 4, 32),) * 2,
                              lstm._flat_weights, True, 2, 0.3, True, False, True), {})
    cache: dict = {}
    gen = torch.default_generator
    state = gen.get_state()
    vals = metric.device_stats(a, b)
    cases = {
        "signature + lookup, 2 tensors": lambda: cache.get(rng.signature("Torch.add", [a, b])),
        f"signature + lookup, torch.lstm ({len(lstm_leaves)} leaves)":
            lambda: cache.get(rng.signature("Torch.lstm", lstm_leaves)),
        "first call of a signature: get_state before, get_state + equal after":
            lambda: (gen.get_state(), torch.equal(gen.get_state(), state)),
        "CPU fast verdict conclusive? (4 values, by their bits)": lambda: deferred._finite(vals),
    }
    out = []
    for name, fn in cases.items():
        n = 20000
        best = min(timeit.repeat(fn, number=n, repeat=repeats)) / n
        out.append({"what": name, "us": best * 1e6})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    res = []
    for mode in MODES:
        for op, fn in ops().items():
            res += measure(op, fn, mode, a.calls, a.repeats)
    lines = ["| pert_mode | call | plain call | check overhead, replayed | check overhead, "
             "replay off | replay's cost | ATen ops per check (replayed / off) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for on, off in zip(res[::2], res[1::2]):
        lines.append(f"| {on['mode']} | {on['op']} | {on['plain_us']:.1f} µs | "
                     f"{on['overhead_us']:.1f} µs | {off['overhead_us']:.1f} µs | "
                     f"{on['overhead_us'] - off['overhead_us']:+.1f} µs | "
                     f"{on['aten_per_check']:g} / {off['aten_per_check']:g} |")
    fixed = fixed_costs(a.repeats)
    lines += ["", "| fixed cost | µs |", "|---|---:|"]
    lines += [f"| {r['what']} | {r['us']:.2f} |" for r in fixed]
    res += fixed
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
