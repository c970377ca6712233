"""The real-bug zoo: genuine defects of PyTorch kernels and genuinely ill-conditioned
computations, each one call (or one backward) whose answer is known, shared by the tests
(``tests/unit/test_freebench_repro.py`` scripts the first eleven, ``test_freebench_real_bugs.py``
finds all fifteen) and ``benchmarks/bench_real_bugs.py`` (found per mode, before -> after).

``REAL_BUGS``: (name, pert_mode, options, the call, the finding's cause). ``NEW_BF16``: the CPU
bf16 defects issue 34 measured on model sweeps (point 7), each on inputs that show it, with the
API and output that must be a finding.
"""
import torch
import torch.nn.functional as F

bf16, fp16 = torch.bfloat16, torch.float16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


N, BINS = 20_000, 4


def _values():
    g = gen()
    return torch.randint(0, BINS, (N,), generator=g), torch.rand(N, generator=g).to(fp16)


def _near_1e20():
    return torch.full((1000,), 1e20) + torch.randn(1000, generator=gen()) * 4e19


def _constant_channels():
    c = (torch.rand(5, generator=gen()) * 2 - 1) * 1e5
    return c[None, :, None, None].repeat(4, 1, 6, 6).float()


def _autocast_layer_norm():
    # bf16 rows with fp32 weight and bias under CPU autocast: the mixed-type kernel sums the
    # weight and bias gradients in bf16 (issue 26, RESULTS.md)
    g = gen()
    x = torch.randn(1024, 64, generator=g).to(bf16).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(64, generator=g)).requires_grad_()
    gy = torch.randn(1024, 64, generator=g).to(bf16)
    with torch.autocast("cpu", dtype=bf16):
        y = F.layer_norm(x, (64,), w, b)
    y.backward(gy)


def _exp_backward():
    x = torch.tensor([50.0, 51.0, 52.0], dtype=bf16, requires_grad=True)
    torch.exp(x).float().sum().backward()


def _exp_inplace_backward():
    x = torch.tensor([50.0, 51.0, 52.0], dtype=bf16, requires_grad=True)
    x.clone().exp_().float().sum().backward()


def _fp16_layer_norm_backward():
    g = gen()
    x = torch.randn(1024, 64, generator=g).half().requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).half().requires_grad_()
    b = (0.1 * torch.randn(64, generator=g)).half().requires_grad_()
    F.layer_norm(x, (64,), w, b).backward(torch.randn(1024, 64, generator=g).half())


def batch_norm_kernel_is_wrong() -> bool:
    """Does this CPU's fp32 training batch norm get constant channels wrong (pytorch#5410: the
    vectorised kernels; a path that computes them right has nothing to report)?"""
    y = F.batch_norm(_constant_channels(), torch.zeros(5), torch.ones(5), training=True)
    return y.abs().max().item() > 16 * 2.0 ** -24


# (name, pert_mode, options, the call, the finding's cause)
ZOO = [
    # pytorch/pytorch#156173: fp16 index_put accumulate stalls at 2048
    ("index_put_fp16", "improve_precision", {},
     lambda: torch.index_put(torch.zeros(BINS, dtype=fp16), (_values()[0],), _values()[1],
                             accumulate=True), "inaccurate"),
    # the same in place: the script writes into fresh inputs each run
    ("index_add_inplace_fp16", "improve_precision", {},
     lambda: torch.zeros(BINS, dtype=fp16).index_add_(0, *_values()), "inaccurate"),
    # pytorch/pytorch#57690: cdist(x, x)'s diagonal is not 0 (one tensor passed twice)
    ("cdist_self", "improve_precision", {},
     lambda: torch.cdist(*(torch.randn(40, 8, generator=gen()) * 10 + 100,) * 2), "inaccurate"),
    ("log_softmax_fp16_small_output", "improve_precision", {},
     lambda: F.log_softmax(torch.tensor([[0.0, -7.93]]).to(fp16), -1), "inaccurate"),
    # fp32 overflow where float64 is finite (a NaN/Inf finding)
    ("var_overflow", "improve_precision", {}, lambda: torch.var(_near_1e20()), "inaccurate"),
    # pytorch/pytorch#5410: constant channels normalise to up to 0.95 (AVX2/AVX-512 kernels)
    ("batch_norm_constant_channels", "improve_precision", {},
     lambda: F.batch_norm(_constant_channels(), torch.zeros(5), torch.ones(5), training=True),
     "inaccurate"),
    ("softmax_fp16_large_logits", "bit_noise", {},
     lambda: torch.softmax((torch.randn(4, 64, generator=gen()) * 2 + 1000).to(fp16), -1),
     "ill-conditioned"),
    # backward: fp16 layer_norm's parameter gradients summed in fp16; exp's gradient near 50 in
    # bf16; layer_norm's parameter gradients under bf16 autocast (a matmul's weight gradient
    # that cancels was used here: it moves by u S under one-ulp nudges, not ill-conditioned
    # relative to its S, issue 26 point 2)
    ("fp16_layer_norm_backward", "improve_precision",
     {"fuzz_stage": "backward", "list": ["layer_norm"]}, _fp16_layer_norm_backward, "inaccurate"),
    ("exp_bf16_backward", "bit_noise", {"fuzz_stage": "backward"}, _exp_backward,
     "ill-conditioned"),
    # the same through an in-place call (checked out of place on a clone, issue 26): the script
    # makes the call the user made, differentiated on a copy of the leaf
    ("exp_inplace_bf16_backward", "bit_noise", {"fuzz_stage": "backward", "list": ["exp"]},
     _exp_inplace_backward, "ill-conditioned"),
    ("autocast_layer_norm_backward", "improve_precision",
     {"fuzz_stage": "backward", "list": ["layer_norm"]}, _autocast_layer_norm, "inaccurate"),
]


def _index_put_random_signs():
    # pytorch/pytorch#156173's own reproducer: 2x4x256x256 random-sign fp16 values into 4 bins
    # (k = 131,072 each), off by 9-22 per bin; gamma_k(u32) S is about 820 (issue 34 point 4)
    g = gen(42)
    idx = torch.arange(4).view(1, 4, 1, 1).expand(2, 4, 256, 256)
    vals = torch.randn(2, 4, 256, 256, generator=g).to(fp16)
    return torch.index_put(torch.zeros(4, dtype=fp16), [idx], vals, accumulate=True)


def _one_pass_variance():
    # E[x^2] - E[x]^2 of bf16 features whose mean is 40 times their spread
    x = (torch.randn(64, 64, generator=gen()) + 40).to(bf16)
    m = x.mean(-1, keepdim=True)
    return (x * x).mean(-1, keepdim=True) - m * m


def _bf16_layer_norm_backward():
    # CPU bf16 layer_norm backward sums the weight and bias gradients in bf16
    g = gen()
    x = torch.randn(1024, 64, generator=g).to(bf16).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(bf16).requires_grad_()
    b = (0.1 * torch.randn(64, generator=g)).to(bf16).requires_grad_()
    F.layer_norm(x, (64,), w, b).backward(torch.randn(1024, 64, generator=g).to(bf16))


REAL_BUGS = ZOO + [
    ("index_put_fp16_random_signs", "improve_precision", {}, _index_put_random_signs,
     "inaccurate"),
    ("one_pass_variance_bf16", "bit_noise", {"list": ["sub"]}, _one_pass_variance,
     "ill-conditioned"),
    ("bf16_layer_norm_backward", "improve_precision",
     {"fuzz_stage": "backward", "list": ["layer_norm"]}, _bf16_layer_norm_backward, "inaccurate"),
    # fp16 sums 100,000 ones into 65504 + inf (its accumulation is fp32: the output overflows)
    ("fp16_long_sum_overflows", "improve_precision", {},
     lambda: torch.sum(torch.ones(100_000, dtype=fp16)), "inaccurate"),
]
assert len(REAL_BUGS) == 15 and len({n for n, *_ in REAL_BUGS}) == 15


# -- issue 34 point 7: CPU bf16 kernels that round or accumulate in bf16 ---------------------------
def _embedding_bag_backward():
    g = gen()
    w = torch.randn(100, 32, generator=g).to(bf16).requires_grad_()
    idx, off = torch.randint(0, 100, (4096,), generator=g), torch.arange(0, 4096, 8)
    F.embedding_bag(idx, w, off, mode="sum").backward(torch.randn(512, 32, generator=g).to(bf16))


def _broadcast_mul_backward():
    # the gradient of h sums g a over 4096 rows; a row-constant a (a broadcast feature) and
    # random-sign g cancel, and g a rounded to bf16 per term is far from the fp32 sum
    g = gen()
    a = torch.randn(1, 64, generator=g).repeat(4096, 1).to(bf16).requires_grad_()
    h = torch.randn(1, 64, generator=g).to(bf16).requires_grad_()
    (a * h).backward(torch.randn(4096, 64, generator=g).to(bf16))


def _cross_entropy_mean():
    g = gen(97)
    logits = (torch.randn(64, 256, generator=g) * 3).to(bf16)
    return F.cross_entropy(logits, torch.randint(0, 256, (64,), generator=g))


def _nll_loss_mean():
    # the same mean over the log-probabilities: CPU bf16 nll_loss sums it in bf16 (2.6 u of the
    # loss, fp32 accumulation 0.04 u)
    g = gen(97)
    logits = torch.randn(64, 256, generator=g) * 3
    return F.nll_loss(F.log_softmax(logits, -1).to(bf16),
                      torch.randint(0, 256, (64,), generator=g))


def _grid_sample(backward):
    g = gen()
    x = torch.randn(2, 4, 32, 32, generator=g).to(bf16).requires_grad_()
    grid = (torch.rand(2, 16, 16, 2, generator=g) * 2 - 1).to(bf16).requires_grad_()
    y = F.grid_sample(x, grid, align_corners=False)
    if backward:
        y.backward(torch.randn(2, 4, 16, 16, generator=g).to(bf16))


def _norm_backward(norm):
    # CPU bf16 layer, batch and group norms save their mean and rstd in bf16 and the backward
    # reads them: the input gradient is off by their rounding (issue 34 point 7)
    g = gen()
    shape = (1024, 64) if norm == "layer_norm" else (16, 8, 6, 6)
    x = torch.randn(*shape, generator=g).to(bf16).requires_grad_()
    call = {"layer_norm": lambda t: F.layer_norm(t, (64,)),
            "batch_norm": lambda t: F.batch_norm(t, None, None, training=True),
            "group_norm": lambda t: F.group_norm(t, 2)}[norm]
    call(x).backward(torch.randn(*shape, generator=g).to(bf16))


#: (name, options, the call, the API and output index that must be a finding)
NEW_BF16 = [
    ("embedding_bag_backward", {"fuzz_stage": "backward", "list": ["embedding_bag"]},
     _embedding_bag_backward, ("Functional.embedding_bag.0.backward", 1)),
    ("broadcast_mul_backward", {"fuzz_stage": "backward", "list": ["mul"]},
     _broadcast_mul_backward, ("Tensor.__mul__.0.backward", 1)),
    ("cross_entropy_mean", {"list": ["cross_entropy"]}, _cross_entropy_mean,
     ("Functional.cross_entropy.0.forward", 0)),
    ("nll_loss_mean", {"list": ["nll_loss"]}, _nll_loss_mean,
     ("Functional.nll_loss.0.forward", 0)),
    ("grid_sample_forward", {"list": ["grid_sample"]}, lambda: _grid_sample(False),
     ("Functional.grid_sample.0.forward", 0)),
    ("grid_sample_grid_gradient", {"fuzz_stage": "backward", "list": ["grid_sample"]},
     lambda: _grid_sample(True), ("Functional.grid_sample.0.backward", 1)),
    ("layer_norm_parameter_gradients", {"fuzz_stage": "backward", "list": ["layer_norm"]},
     _bf16_layer_norm_backward, ("Functional.layer_norm.0.backward", 3)),
    ("layer_norm_input_gradient", {"fuzz_stage": "backward", "list": ["layer_norm"]},
     _bf16_layer_norm_backward, ("Functional.layer_norm.0.backward", 0)),
] + [(f"{n}_input_gradient_saved_statistics", {"fuzz_stage": "backward", "list": [n]},
      (lambda n=n: _norm_backward(n)), (f"Functional.{n}.0.backward", 0))
     for n in ("layer_norm", "batch_norm", "group_norm")]
