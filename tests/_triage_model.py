"""A small residual model with a planted ill-conditioned op, for the triage tests.

Four blocks (LayerNorm -> Linear -> GELU -> Linear, residual) and a head; block ``planted``
instead normalises ``x + OFFSET`` with the one-pass variance E[x²] - E[x]² (catastrophic
cancellation: the two terms are ~1600, their difference ~4). ``make_model(dtype)`` computes that
block in ``dtype`` (bfloat16: the cancellation keeps no correct digit), the rest in float32.
Import by name (``tests/`` is on ``sys.path``).
"""
import torch
import torch.nn.functional as F
from torch import nn

D, B, OFFSET, PLANTED = 64, 64, 40.0, 2


class NaiveNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0.5))


class Block(nn.Module):
    def __init__(self, planted=False):
        super().__init__()
        self.norm = NaiveNorm() if planted else nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.offset = OFFSET if planted else 0.0
        self.dtype = torch.float32

    def forward(self, x):
        h = x.to(self.dtype) + self.offset
        h = self.fc2(F.gelu(self.fc1(self.norm(h))))
        return x + h.to(x.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(i == PLANTED) for i in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = Net()
    model.blocks[PLANTED].to(dtype).dtype = dtype
    return model


def batch(g):
    return torch.randn(B, D, generator=g), torch.randn(B, 4, generator=g)


def train(dtype, dump_path, steps=4):
    """Train ``steps`` SGD steps with the grad probe recording into ``dump_path``."""
    import probekit

    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    with probekit.GradProbe(model, opt, grad_level="L1", dump_path=str(dump_path)):
        for _ in range(steps):
            x, y = batch(g)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, opt
