"""A small deterministic training loop shared by tests (also run under msprobe's venv: torch only)."""
import torch


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def train(model, steps=20, lr=0.1, seed=0, on_step=None):
    """SGD on fixed random data; returns the losses (floats)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(s)
    return losses
