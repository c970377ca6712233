"""The model both sides of bench_freebench.py time: a small bf16 transformer-style MLP block
(LayerNorm, matmul, softmax, Linear, GELU), trained with SGD. Imported by the probekit side and
by the msprobe helper (run under msprobe's venv), so both time the very same step."""
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, T, B = 128, 512, 32, 4


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
