"""A small MindSpore MLP, its data, and the ways MindSpore users run a training step (PyNative,
@ms.jit, GRAPH_MODE) for the tests."""
import numpy as np

import mindspore as ms
import torch
from mindspore import nn, ops


class MLP(nn.Cell):
    def __init__(self, sizes=(6, 16, 8, 3)):
        super().__init__()
        self.fc1 = nn.Dense(sizes[0], sizes[1])
        self.fc2 = nn.Dense(sizes[1], sizes[2])
        self.head = nn.Dense(sizes[2], sizes[3])

    def construct(self, x):
        return self.head(ops.tanh(self.fc2(ops.tanh(self.fc1(x)))))


def data(steps, batch=8, n_in=6, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, n_in)).astype(np.float32),
             rng.standard_normal((batch, n_out)).astype(np.float32)) for _ in range(steps)]


def train(net, opt, batches, grads_out=None):
    """Plain PyNative loop; the gradients handed to the optimizer are kept in ``grads_out``."""
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    for x, y in batches:
        _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
        if grads_out is not None:
            grads_out.append([g.asnumpy().copy() for g in grads])
        opt(grads)


#: the ways a MindSpore user runs a training step (docs/mindspore.md)
MODES = ("pynative", "jit", "graph_cell", "graph_split")


def make_step(mode, net, opt):
    """A training step ``step(x, y) -> loss`` as written in ``mode``: ``pynative`` (eager, the
    optimizer's own @jit construct compiled), ``jit`` (the whole step in one ``@ms.jit``, the
    optimizer inside, as MindSpore's tutorials write it), ``graph_cell`` (GRAPH_MODE,
    ``TrainOneStepCell``) and ``graph_split`` (GRAPH_MODE, forward/backward and the optimizer
    called from Python one after the other). GRAPH_MODE is the caller's (``graph_mode``)."""
    loss_fn = nn.MSELoss()
    if mode == "graph_cell":
        return nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt)

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return ms.jit(step) if mode == "jit" else step


class graph_mode:
    """``with graph_mode(mode):`` GRAPH_MODE for the graph_* modes, PyNative restored after."""

    def __init__(self, mode):
        self.on = mode.startswith("graph")

    def __enter__(self):
        if self.on:
            ms.set_context(mode=ms.GRAPH_MODE)
        return self

    def __exit__(self, *exc):
        ms.set_context(mode=ms.PYNATIVE_MODE)


def run_steps(step, batches):
    return [float(step(ms.Tensor(x), ms.Tensor(y)).asnumpy()) for x, y in batches]


class TorchMLP(torch.nn.Module):
    """PyTorch's twin of ``MLP`` (the same layer names, shapes and tanh), for the tests that
    record both frameworks."""

    def __init__(self, sizes=(6, 16, 8, 3)):
        super().__init__()
        self.fc1 = torch.nn.Linear(sizes[0], sizes[1])
        self.fc2 = torch.nn.Linear(sizes[1], sizes[2])
        self.head = torch.nn.Linear(sizes[2], sizes[3])

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
