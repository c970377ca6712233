"""Gradients before or after clipping (issue 21, point 2): HF Trainer, Lightning and accelerate
clip before ``optimizer.step()``, so the default (``grad_point="step"``) records the clipped
gradients; ``grad_point="backward"`` records the raw ones, as the last backward pass before the
step left them. Every loop accumulates over 2 micro-batches and clips with a max norm small
enough that every step clips."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from probekit.grads import GradProbe, open_grads

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _train import make_model  # noqa: E402

MAX_NORM = 0.05
STEPS = 3
EPS = 1e-6  # clip_grad_norm_'s: clip_coef = max_norm / (total_norm + 1e-6)


def total_norms(path):
    """The recorded total norm per step: sqrt of the sum of the parameters' squared norms."""
    ds = open_grads(path)
    assert bool(ds["present"].all())
    return ds["step"].values.tolist(), np.sqrt((ds["norm"].values ** 2).sum(axis=1))


def assert_clipped(recorded, pre_clip, max_norm=MAX_NORM):
    """The default records the clipped gradients: each step's total norm is the clip value
    (max_norm * g / (g + 1e-6) for a pre-clip norm g above it), to float32 rounding."""
    pre_clip = np.asarray(pre_clip)
    assert np.all(pre_clip > 2 * max_norm)  # every step did clip
    np.testing.assert_allclose(recorded, max_norm * pre_clip / (pre_clip + EPS), rtol=1e-6)


def assert_max_min(path, grads_per_step, names):
    """Exact max and min of every parameter at every step."""
    ds = open_grads(path)
    assert ds["param"].values.tolist() == names
    for s, grads in enumerate(grads_per_step):
        for j, name in enumerate(names):
            assert ds["max"].values[s, j] == float(grads[name].max()), (s, name)
            assert ds["min"].values[s, j] == float(grads[name].min()), (s, name)


def batches(n, seed=1, batch=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n * batch, 16, generator=gen),
                                          torch.randn(n * batch, 4, generator=gen))


# -- HF Trainer --------------------------------------------------------------------------------
def hf_trainer_run(tmp_path, point):
    """A tiny GPT-2 under transformers.Trainer: accumulation 2, max_grad_norm 0.5, 3 steps.
    Returns (trainer, model, post-clip gradients per step or None without a probe)."""
    import transformers
    from _hf_models import VOCAB, build

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, VOCAB, (12, 16),
                                     generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class KeepClipped(transformers.TrainerCallback):
        """The gradients the optimizer is handed: after clipping ("on_pre_optimizer_step")."""

        def __init__(self, model):
            self.model, self.grads = model, []

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    model = build("gpt2", layers=1, width=32)
    out = str(tmp_path / f"hf_{point}")
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=STEPS, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    keep = KeepClipped(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[keep])
    if point is None:
        trainer.train()
    else:
        with GradProbe(model, dump_path=out, grad_point=point):
            trainer.train()
    return trainer, model, keep.grads


def test_hf_trainer_records_clipped_by_default_and_raw_with_the_option(tmp_path):
    plain, plain_model, _ = hf_trainer_run(tmp_path, None)
    clipped, _, at_step = hf_trainer_run(tmp_path, "step")
    raw, raw_model, _ = hf_trainer_run(tmp_path, "backward")
    logged = [[h for h in t.state.log_history if "grad_norm" in h] for t in (plain, clipped, raw)]
    # the option leaves training unchanged: the same losses, gradient norms and weights
    assert [h["loss"] for h in logged[2]] == [h["loss"] for h in logged[0]]
    assert [h["loss"] for h in logged[1]] == [h["loss"] for h in logged[0]]
    for (n, a), b in zip(plain_model.named_parameters(), raw_model.parameters()):
        assert torch.equal(a, b), n
    grad_norm = [h["grad_norm"] for h in logged[0]]  # the Trainer's own, before clipping
    assert len(grad_norm) == STEPS == raw.state.global_step
    steps, post = total_norms(tmp_path / "hf_step")
    assert steps == list(range(STEPS))
    assert_clipped(post, grad_norm, max_norm=0.5)
    names = open_grads(tmp_path / "hf_step")["param"].values.tolist()
    assert_max_min(tmp_path / "hf_step", at_step, names)
    steps, pre = total_norms(tmp_path / "hf_backward")
    assert steps == list(range(STEPS))
    np.testing.assert_allclose(pre, grad_norm, rtol=1e-6)


# -- Lightning ---------------------------------------------------------------------------------
def lightning_run(tmp_path, point):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.losses, self.raw, self.clipped = [], [], []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # Lightning clips after this hook
            self.raw.append({n: p.grad.clone() for n, p in self.named_parameters()})

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.clipped.append({n: p.grad.clone() for n, p in self.named_parameters()})

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=2, gradient_clip_val=MAX_NORM,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / "lightning"))
    loader = torch.utils.data.DataLoader(batches(2 * STEPS), batch_size=4)
    if point is None:
        trainer.fit(module, loader)
    else:
        with GradProbe(module, dump_path=str(tmp_path / f"pl_{point}"), grad_point=point):
            trainer.fit(module, loader)
    return trainer, module


def test_lightning_records_clipped_by_default_and_raw_with_the_option(tmp_path):
    _, plain = lightning_run(tmp_path, None)
    _, clipped = lightning_run(tmp_path, "step")
    trainer, raw = lightning_run(tmp_path, "backward")
    assert raw.losses == plain.losses == clipped.losses and len(plain.losses) == 2 * STEPS
    for (n, a), b in zip(plain.named_parameters(), raw.parameters()):
        assert torch.equal(a, b), n
    assert trainer.global_step == STEPS
    names = [n for n, _ in plain.named_parameters()]
    pre_clip = [float(torch.nn.utils.get_total_norm(list(g.values()))) for g in plain.raw]
    steps, post = total_norms(tmp_path / "pl_step")
    assert steps == list(range(STEPS))
    assert_clipped(post, pre_clip)
    assert_max_min(tmp_path / "pl_step", clipped.clipped, names)
    steps, pre = total_norms(tmp_path / "pl_backward")
    assert steps == list(range(STEPS))
    np.testing.assert_allclose(pre, pre_clip, rtol=1e-6)
    assert_max_min(tmp_path / "pl_backward", raw.raw, names)


# -- accelerate --------------------------------------------------------------------------------
def accelerate_run(tmp_path, point):
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(batches(2 * STEPS), batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    out = {"losses": [], "norms": [], "raw": [], "clipped": []}

    def loop():
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                out["losses"].append(loss.item())
                if accelerator.sync_gradients:
                    out["raw"].append({n: p.grad.clone() for n, p in model.named_parameters()})
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    out["norms"].append(float(norm))
                    out["clipped"].append({n: p.grad.clone()
                                           for n, p in model.named_parameters()})
                opt.step()  # accelerate skips it on the first micro-batch of each step
                opt.zero_grad()

    if point is None:
        loop()
    else:
        with GradProbe(model, dump_path=str(tmp_path / f"acc_{point}"),
                       grad_point=point) as probe:
            loop()
        out["steps_seen"] = probe.steps_seen
    out["weights"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_accelerate_records_clipped_by_default_and_raw_with_the_option(tmp_path):
    plain = accelerate_run(tmp_path, None)
    clipped = accelerate_run(tmp_path, "step")
    raw = accelerate_run(tmp_path, "backward")
    assert raw["losses"] == plain["losses"] == clipped["losses"]
    assert all(torch.equal(a, b) for a, b in zip(plain["weights"], raw["weights"]))
    assert raw["steps_seen"] == clipped["steps_seen"] == len(plain["norms"]) == STEPS
    names = [n for n, _ in make_model().named_parameters()]
    steps, post = total_norms(tmp_path / "acc_step")
    assert steps == list(range(STEPS))
    assert_clipped(post, plain["norms"])
    assert_max_min(tmp_path / "acc_step", clipped["clipped"], names)
    steps, pre = total_norms(tmp_path / "acc_backward")
    assert steps == list(range(STEPS))
    assert [open_grads(tmp_path / f"acc_{p}").attrs["grad_point"] for p in ("step", "backward")
            ] == ["step", "backward"]
    np.testing.assert_allclose(pre, plain["norms"], rtol=1e-6)
    assert_max_min(tmp_path / "acc_backward", raw["raw"], names)


# -- the iteration rules hold with the option ---------------------------------------------------
def touch(model, keep):
    """What a loop does between backward and step: keep the raw gradients, then change them
    in place (as clipping does)."""
    keep.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def two_optimizers(model_dir):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(6, 5), "head": torch.nn.Linear(5, 2)})
    body = torch.optim.SGD(model["body"].parameters(), lr=0.1)
    head = torch.optim.SGD(model["head"].parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    raw = []
    with GradProbe(model, dump_path=model_dir, grad_point="backward"):
        for it in range(4):
            model.zero_grad()
            model["head"](torch.tanh(model["body"](torch.randn(4, 6, generator=gen)))
                          ).pow(2).sum().backward()
            touch(model, raw)
            for opt in (head, body):  # the head every other iteration
                if opt is body or it % 2 == 0:
                    opt.step()
    return raw, {"head.weight": [0, 2], "body.weight": [0, 1, 2, 3]}


def gan(model_dir):
    """Two backward passes per iteration; the generator's also writes the discriminator's
    gradients, after the discriminator stepped."""
    torch.manual_seed(0)
    gen_net, disc = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"g": gen_net, "d": disc})
    opt_g = torch.optim.Adam(gen_net.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    raw = []
    with GradProbe(model, dump_path=model_dir, grad_point="backward"):
        for _ in range(3):
            z, real = torch.randn(8, 3), torch.randn(8, 4)
            opt_d.zero_grad()
            (disc(real).mean() - disc(gen_net(z).detach()).mean()).backward()
            touch(model, raw)
            opt_d.step()
            opt_g.zero_grad()
            disc(gen_net(z)).mean().backward()
            keep = []
            touch(model, keep)
            raw[-1].update({k: v for k, v in keep[0].items() if k.startswith("g.")})
            opt_g.step()
    return raw, {"d.weight": [0, 1, 2], "g.weight": [0, 1, 2]}


def lbfgs(model_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = torch.randn(16, 5), torch.randn(16, 1)
    raw, evals = [], []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        keep = []
        touch(model, keep)  # inside the closure, as Lightning clips
        evals.append(keep[0])
        return loss

    with GradProbe(model, dump_path=model_dir, grad_point="backward"):
        for _ in range(3):
            n = len(evals)
            opt.step(closure)
            raw.append(evals[n])  # the closure's first evaluation: what the update uses
    return raw, {"weight": [0, 1, 2]}


def grad_scaler(model_dir):
    """GradScaler (scale 2**8): the raw gradients are scaled; with scaler= their statistics
    are unscaled, as unscale_ gives them. Steps 1 and 2 overflow and are skipped."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    raw = []
    with GradProbe(model, dump_path=model_dir, scaler=scaler, grad_level="L2",
                   bounds=[-0.01, 0, 0.01], grad_point="backward"):
        for it in range(5):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if it in (1, 2):  # an overflow: GradScaler skips this step
                model[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            touch(model, raw)
            scaler.step(opt)
            scaler.update()
    return raw, {"4.weight": [0, 3, 4], "0.bias": [0, 3, 4]}


@pytest.mark.parametrize("loop", [two_optimizers, gan, lbfgs, grad_scaler])
def test_raw_gradients_with_several_optimizers_closures_and_scaler(tmp_path, loop):
    raw, expect = loop(str(tmp_path))
    ds = open_grads(tmp_path)
    steps = sorted({s for v in expect.values() for s in v})
    assert ds["step"].values.tolist() == list(range(steps[-1] + 1))
    for name, recorded in expect.items():
        present = ds["present"].sel(param=name).values
        assert np.flatnonzero(present).tolist() == recorded, name
        for s in recorded:
            g = raw[s][name]
            sel = ds.sel(param=name, step=s)
            assert float(sel["max"]) == float(g.max()), (name, s)
            assert float(sel["min"]) == float(g.min()), (name, s)
            assert float(sel["norm"]) == pytest.approx(float(g.double().norm()), rel=1e-7)
            packed = np.packbits(g.reshape(-1).numpy() > 0)
            off = int(ds["offset"].sel(param=name))
            assert ds["direction"].values[s, off:off + packed.size].tolist() == packed.tolist()
            if "dist" in ds:  # the intervals of the unscaled values
                flat = g.reshape(-1).double().numpy()
                le = [int(np.sum(flat <= b)) for b in (-0.01, 0, 0.01)]
                shares = np.diff([0, *le, flat.size]) / flat.size
                assert sel["dist"].values.tolist() == shares.tolist(), (name, s)


def test_hooks_removed_at_stop_and_training_unchanged(tmp_path):
    def run(point):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(4)
        losses = []
        probe = GradProbe(model, dump_path=str(tmp_path / str(point)), grad_point=point)
        if point is not None:
            probe.start()
            assert all(len(p._post_accumulate_grad_hooks or {}) == (point == "backward")
                       for p in model.parameters())
        for _ in range(3):
            for _ in range(2):
                loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16, generator=gen)),
                                                    torch.randn(8, 4, generator=gen))
                (loss / 2).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        probe.stop()
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
        return losses, [p.detach().clone() for p in model.parameters()]

    plain = run(None)
    raw = run("backward")
    assert raw[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], raw[1]))
    assert open_grads(tmp_path / "backward")["step"].values.tolist() == [0, 1, 2]


def test_precision_debugger_reads_grad_point_from_config_json(tmp_path, msprobe_config_dict,
                                                             monkeypatch):
    from probekit import PrecisionDebugger

    monkeypatch.delenv("RANK", raising=False)
    msprobe_config_dict.update(task="grad_probe", dump_path=str(tmp_path / "dbg"))
    msprobe_config_dict["grad_probe"]["grad_point"] = "backward"
    (tmp_path / "config.json").write_text(json.dumps(msprobe_config_dict))
    debugger = PrecisionDebugger(config_path=str(tmp_path / "config.json"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger.monitor(model)
    norms = []
    for x, y in torch.utils.data.DataLoader(batches(4), batch_size=4):
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    debugger.close()  # stop() does nothing for grad_probe (as in msprobe); close() ends it
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    steps, pre = total_norms(tmp_path / "dbg")
    assert steps == [0, 1, 2, 3]
    np.testing.assert_allclose(pre, norms, rtol=1e-6)


def test_l0_with_a_scaler_is_refused():
    from probekit import ConfigError

    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ConfigError, match="'L0' is not valid with grad_point 'backward' and a "
                                          "GradScaler") as err:
        GradProbe(make_model(), grad_level="L0", grad_point="backward", scaler=scaler)
    assert err.value.key == "grad_probe.grad_level"
    GradProbe(make_model(), grad_level="L0", scaler=scaler)  # at the step: its grads unscaled


# -- DDP and FSDP2 -----------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_and_fsdp2_record_the_synchronised_raw_gradients(tmp_path):
    """DDP writes its all-reduced gradients into .grad in an autograd callback after the
    parameters' post-accumulate hooks ran; the option's statistics are taken after it, so
    they are the synchronised gradients clip_grad_norm_ sees (each rank's batches differ: rank
    0's local gradient has another norm). FSDP2: each rank's shard, assembled."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "_preclip_dist.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}", script,
                          str(tmp_path), "ddp", "fsdp2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = {tuple(line.split()[:2]): line for line in res.stdout.splitlines()
             if line.startswith(("ddp ", "fsdp2 "))}
    assert len(lines) == 4, res.stdout[-2000:]

    def values(line, key):  # a repr'd list of finite floats reads as JSON
        return json.loads(line.split(f"{key}=")[1].split(" losses=")[0])

    # one statistics pass per step: DDP's backward inside no_sync is not computed (a synced
    # one follows), FSDP2 calls no hook before its reduce-scatter (the synced backward)
    assert "ddp backward passes=(3, 3) " in lines[("ddp", "backward")]
    assert "fsdp2 backward passes=(3, 0) " in lines[("fsdp2", "backward")]
    for layout in ("ddp", "fsdp2"):
        norms = values(lines[(layout, "step")], "norms")
        assert values(lines[(layout, "backward")], "norms") == norms
        assert values(lines[(layout, "backward")], "losses") == \
            values(lines[(layout, "step")], "losses")
        steps, post = total_norms(tmp_path / f"{layout}_step")
        assert steps == [0, 1, 2]
        assert_clipped(post, norms)
        steps, pre = total_norms(tmp_path / f"{layout}_backward")
        assert steps == [0, 1, 2]
        np.testing.assert_allclose(pre, norms, rtol=1e-6)
    assert sorted(os.listdir(tmp_path / "ddp_backward" / "grads.zarr")) == ["rank0", "zarr.json"]
    assert sorted(os.listdir(tmp_path / "fsdp2_backward" / "grads.zarr")) == [
        "rank0", "rank1", "zarr.json"]
    assert open_grads(tmp_path / "fsdp2_backward").attrs["assembled_from"] == [0, 1]
