"""A small MindSpore MLP and its training loop for the tests (PyNative mode)."""
import numpy as np

import mindspore as ms
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
