"""A train step compiled with MindSpore's bytecode capture (``@ms.jit(capture_mode="bytecode")``)
and recorded, in a process of its own (test_ms_bytecode.py): before probekit refused the steps it
cannot record, such a step ended the process with a segmentation fault.

    python ms_bytecode.py VARIANT WHERE DUMP [CAPTURE]

prints ``RESULT {json}`` as its last line: per call of the step its loss and whether the weights
changed, the error of the call that failed (type and message), the error ``stop()`` raised if
any, the optimizer's ``global_step``, and, after an error, the steps a new ``@ms.jit`` (ast) step
records in the same process. ``CAPTURE`` ``trace`` runs ``capture_mode="trace"`` (here, because
MindSpore 2.10's trace reads the source line of every caller's frame, and fails under pytest)."""
import json
import os
import sys

import numpy as np

import mindspore as ms
from mindspore import nn

from ms_models import MLP, data, make_step, run_steps

BOUNDS = [-0.01, 0, 0.01]
STEPS = 4
#: how the train step is written: the loss a Cell (MindSpore captures the step whole), a Python
#: function (as MindSpore's tutorials write it; captured whole too), a lambda (MindSpore 2.10's
#: bytecode capture fails to compile the step with the probe's tap in it), or a Cell with a
#: print() in the step (a graph break)
VARIANTS = ("cell", "function", "lambda", "break")


def new_run():
    ms.set_seed(1)
    net = MLP()
    return net, nn.SGD(net.trainable_params(), learning_rate=0.05)


def train_step(variant, net, opt):
    """The train step ``step(x, y) -> loss`` of ``variant``, not compiled."""
    loss_fn = nn.MSELoss()
    if variant == "function":
        def forward(x, y):
            return loss_fn(net(x), y)

        grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    elif variant == "lambda":
        grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    else:
        grad_fn = ms.value_and_grad(nn.WithLossCell(net, loss_fn), None, opt.parameters)
    brk = variant == "break"

    def step(x, y):
        loss, grads = grad_fn(x, y)
        if brk:
            print("a graph break", flush=True)
        opt(grads)
        return loss

    return step


def main(variant, where, dump, capture="bytecode"):
    from probekit.mindspore import GradProbe

    net, opt = new_run()
    step = ms.jit(train_step(variant, net, opt), capture_mode=capture)
    probe = GradProbe(opt, grad_level="L2", bounds=BOUNDS, significance=True, where=where,
                      dump_path=os.path.join(dump, capture)).start()
    out = {"losses": [], "updated": []}  # per call: its loss, whether the weights changed
    for x, y in data(STEPS, seed=2):
        before = net.fc1.weight.asnumpy().copy()
        try:
            out["losses"] += run_steps(step, [(x, y)])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = [type(exc).__name__, str(exc)]
        out["updated"].append(not np.array_equal(before, net.fc1.weight.asnumpy()))
        if "error" in out:
            break
    try:
        probe.stop()
    except Exception as exc:  # noqa: BLE001
        out["stop_error"] = [type(exc).__name__, str(exc)]
    out["global_step"] = int(opt.global_step.asnumpy()[0])
    if "error" in out:  # a new train step, compiled with @ms.jit (ast), in the same process
        again = GradProbe(opt, grad_level="L1", dump_path=os.path.join(dump, "after")).start()
        run_steps(make_step("jit", net, opt), data(2, seed=3))
        again.stop()
        out["after_steps"] = again.steps_seen
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
