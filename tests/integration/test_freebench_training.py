"""The free benchmark on a training loop: a small bf16 transformer block (attention + MLP +
LayerNorm) trains under every mode, and check mode changes nothing, bit for bit."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probekit.freebench import FreeBench


class Block(nn.Module):
    def __init__(self, d=32, heads=4, ff=64, p_drop=0.1, sdpa=False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            a = att @ v
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=50, d=32, dtype=torch.bfloat16, blocks=("manual", "sdpa")):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d, sdpa=(b == "sdpa")) for b in blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.to(dtype)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx))))


def make(seed=0, dtype=torch.bfloat16, blocks=("manual", "sdpa"), adam=True):
    """(model, optimizer, step function) with the data drawn from the global RNG each step."""
    torch.manual_seed(seed)
    model = TinyLM(dtype=dtype, blocks=blocks)
    if adam:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def step():
        idx = torch.randint(0, 50, (4, 12))
        tgt = torch.randint(0, 50, (4, 12))
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.float().reshape(-1, 50), tgt.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


ALL_MODES = [
    dict(pert_mode="improve_precision"),
    dict(pert_mode="bit_noise"),
    dict(pert_mode="add_noise"),
    dict(pert_mode="change_value"),
    dict(pert_mode="no_change"),
    dict(pert_mode="to_cpu", fuzz_device="cpu"),
    dict(pert_mode="improve_precision", handler_type="fix"),
    dict(pert_mode="to_cpu", fuzz_device="cpu", handler_type="fix"),
    dict(pert_mode="improve_precision", fuzz_stage="backward"),
    dict(pert_mode="bit_noise", fuzz_stage="backward"),
    dict(pert_mode="add_noise", fuzz_stage="backward"),
    dict(pert_mode="change_value", fuzz_stage="backward"),
    dict(pert_mode="no_change", fuzz_stage="backward"),
    dict(pert_mode="bit_noise", if_preheat=True, preheat_step=1, max_sample=2),
]


@pytest.mark.parametrize("options", ALL_MODES, ids=lambda o: "-".join(map(str, o.values())))
def test_transformer_block_trains_under_every_mode(tmp_path, options):
    model, opt, step = make()
    fb = FreeBench(dump_path=str(tmp_path), **options)
    losses = []
    for _ in range(3):
        with fb:
            losses.append(step())
        fb.step()
    s = fb.summary
    assert all(torch.isfinite(x) for x in losses)
    assert s["steps"] == 3 and s["calls"] > 0 and s["checked"] > 0
    assert "error" not in s["skipped"], s
    df = fb.results
    assert set(df["stage"]) <= {options.get("fuzz_stage", "forward")}
    assert df["dtype"].notna().all() and df["shape"].notna().all()
    assert (df["output_index"] >= 0).all()
    if options.get("handler_type") == "fix":
        assert df.empty


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def train(n, dtype, fb=None):
    model, _, step = make(seed=1, dtype=dtype, blocks=("manual",), adam=False)
    losses = []
    for _ in range(n):
        if fb is None:
            losses.append(step())
        else:
            with fb:
                losses.append(step())
            fb.step()
    return torch.stack(losses), snapshot(model), torch.get_rng_state()


_BASELINES = {}


def baseline(dtype):
    if dtype not in _BASELINES:
        _BASELINES[dtype] = train(20, dtype)
    return _BASELINES[dtype]


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict(pert_mode="bit_noise")),
    (torch.float32, dict(pert_mode="improve_precision")),
    (torch.float32, dict(pert_mode="change_value")),
    (torch.float32, dict(pert_mode="add_noise", fuzz_stage="backward")),
    (torch.float32, dict(pert_mode="improve_precision", fuzz_stage="backward")),
    (torch.bfloat16, dict(pert_mode="bit_noise")),
    (torch.bfloat16, dict(pert_mode="no_change", fuzz_stage="backward")),
    (torch.float32, dict(pert_mode="bit_noise", budget=0.05)),
    (torch.bfloat16, dict(pert_mode="improve_precision", fuzz_stage="backward", budget=0.05)),
], ids=lambda o: "-".join(map(str, o.values())) if isinstance(o, dict) else str(o)[6:])
def test_check_mode_is_bitwise_invisible(tmp_path, dtype, options):
    """20 training steps (dropout on, so the RNG is in play) with and without the probe:
    losses, parameters and the global RNG state are bitwise equal."""
    ref_losses, ref_params, ref_rng = baseline(dtype)
    fb = FreeBench(dump_path=str(tmp_path), **options)
    losses, params, rng = train(20, dtype, fb)
    assert fb.summary["checked"] > 0 and fb.summary["steps"] == 20
    assert "error" not in fb.summary["skipped"]
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert torch.equal(rng, ref_rng)


def test_budget_checks_a_share_of_the_calls_and_rotates_through_every_call_site(tmp_path):
    """A tight budget checks a few calls per probed step; steps 1, 11 and 21 are reference
    steps and the steps the budget leaves quiet intercept nothing (the plain step's time,
    issue 38): every eligible call site ran once per probed step."""
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise", budget=0.05)
    train(30, torch.float32, fb)
    s, cov = fb.summary, fb.coverage
    steps = s["budget_steps"]
    assert steps["reference"] == 3 and sum(steps.values()) == 30 and steps["probed"] >= 1
    assert list(cov.columns) == ["api_name", "calls", "checked", "reason"]
    # every floating-point call site; the eligible ones are skipped by the budget only (the
    # dropout is replayed, not skipped), the others are exact (views, copies...) or the
    # optimizer's updates
    eligible = cov[cov["reason"].isin(["", "budget"])]
    assert set(cov["reason"]) - {"", "budget"} <= {"view", "copy", "conversion", "creation",
                                                   "optimizer"}
    assert "Functional.dropout.0" in set(eligible["api_name"])
    assert (eligible["calls"] == steps["probed"]).all() and cov["api_name"].is_unique
    sites, limit = len(eligible), s["budget_limit"]
    assert limit >= 1
    assert s["skipped"].get("budget", 0) == int((eligible["calls"] - eligible["checked"]).sum())
    assert s["checked"] == int(eligible["checked"].sum()) < 27 * sites
    assert s["coverage"] == 1.0 and (eligible["checked"] >= 1).all()
    assert s["checked_share"] == s["checked"] / s["float_calls"]
