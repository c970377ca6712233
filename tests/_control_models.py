"""Validation set-ups for control runs (issue 27): tiny randomly initialised models (Hugging Face
configs, nothing downloaded), a training loop with the precision settings a test run uses, and
planted bugs that switch on at a chosen step. Shared by tests/ and benchmarks/bench_control.py.

Settings: ``fp32`` (the reference), ``autocast`` (bf16 CPU autocast, fp32 weights), ``bf16``
(the model cast to bf16), ``sdpa_math`` (fp32, attention through SDPA's math path instead of the
fused kernel), ``reorder`` (fp32, every linear layer's reduction in another order: its input
features permuted). Bugs (``BUGS``) are planted in one module of block 1 of the model.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

VOCAB = 256
KINDS = ("gpt2", "llama", "bert", "resnet", "vit", "distilbert")
SETTINGS = ("fp32", "autocast", "bf16", "sdpa_math", "reorder")


def build(kind: str, *, width: int = 64, layers: int = 3, inner: int | None = None,
          seed: int = 0, dropout: bool = False):
    """A tiny random-init model: ``inner`` is the MLP's hidden size (the K of its down
    projection; default 1024) or, for the CNN, the channels of its last stage (default 128:
    K = 9 x 128 = 1152 in its second convolution)."""
    import transformers

    if inner is None:
        inner = 128 if kind == "resnet" else 1024

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    p = 0.1 if dropout else 0.0
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_inner=inner,
                                      vocab_size=VOCAB, n_positions=256, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=p, embd_pdrop=p,
                                      attn_pdrop=p)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                       intermediate_size=inner, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=256, bos_token_id=0,
                                       eos_token_id=0, pad_token_id=0, attention_dropout=p)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=width,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      intermediate_size=inner, max_position_embeddings=256,
                                      hidden_dropout_prob=p, attention_probs_dropout_prob=p)
        model = transformers.BertForMaskedLM(cfg)
    elif kind == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=width, n_layers=layers,
                                            n_heads=4, hidden_dim=inner,
                                            max_position_embeddings=256, dropout=p,
                                            attention_dropout=p)
        model = transformers.DistilBertForMaskedLM(cfg)
    elif kind == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3,
                                     hidden_size=width, num_hidden_layers=layers,
                                     num_attention_heads=4, intermediate_size=inner,
                                     num_labels=4, hidden_dropout_prob=p,
                                     attention_probs_dropout_prob=p)
        model = transformers.ViTForImageClassification(cfg)
    elif kind == "resnet":
        cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16,
                                        hidden_sizes=[16, 32, inner], depths=[1, 1, 1],
                                        layer_type="basic", num_labels=4)
        model = transformers.ResNetForImageClassification(cfg)
    else:
        raise ValueError(f"kind: {kind!r} is not valid; accepted: {', '.join(KINDS)}")
    return model.train()


def batch(kind: str, gen, size: int = 4, seq: int = 32) -> dict:
    if kind in ("resnet", "vit"):
        return {"pixel_values": torch.randn(size, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 4, (size,), generator=gen)}
    ids = torch.randint(0, VOCAB, (size, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


class Clock:
    """The training step a planted bug reads (``train`` advances it)."""

    def __init__(self) -> None:
        self.step = 0


def train(model, kind: str, setting: str = "fp32", steps: int = 10, *, clock=None,
          seed: int = 1, lr: float = 1e-3, size: int = 4, seq: int = 32):
    """AdamW on random batches under ``setting``; returns the losses. The loop a grad probe
    (entered by the caller) records."""
    gen = torch.Generator().manual_seed(seed)
    if setting == "bf16":
        model.to(torch.bfloat16)
    if setting == "reorder":
        reorder(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dtype = next(model.parameters()).dtype
    losses = []
    for step in range(steps):
        if clock is not None:
            clock.step = step
        inputs = batch(kind, gen, size, seq)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with _setting(setting):
            loss = model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return losses


def _setting(setting: str):
    if setting == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if setting == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def reorder(model) -> None:
    """Every ``nn.Linear`` and GPT-2 ``Conv1D`` sums its input features in another order (a
    fixed permutation of them): the same function, another reduction order."""
    from transformers.pytorch_utils import Conv1D

    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            k = module.weight.shape[1] if isinstance(module, torch.nn.Linear) else \
                module.weight.shape[0]
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
            module.forward = _permuted(module, perm)


def _permuted(module, perm):
    from transformers.pytorch_utils import Conv1D

    def forward(x):
        xp = x[..., perm]
        if isinstance(module, Conv1D):
            w = module.weight[perm]
            y = torch.addmm(module.bias, xp.reshape(-1, xp.shape[-1]), w)
            return y.view(*x.shape[:-1], module.nf)
        return F.linear(xp, module.weight[:, perm], module.bias)
    return forward


# -- planted bugs ---------------------------------------------------------------------------
#: where each bug goes, per model: (module of the bug, the parameter it should be found at)
TARGETS = {
    "gpt2": {"accumulate": "transformer.h.1.mlp.c_proj", "overflow": "transformer.h.1.mlp.act",
             "grad_count": "transformer.h.1.attn.c_proj.weight",
             "norm_scale": "transformer.h.1.ln_2"},
    "llama": {"accumulate": "model.layers.1.mlp.down_proj", "overflow": "model.layers.1.mlp.act_fn",
              "grad_count": "model.layers.1.self_attn.o_proj.weight",
              "norm_scale": "model.layers.1.post_attention_layernorm"},
    "bert": {"accumulate": "bert.encoder.layer.1.output.dense",
             "overflow": "bert.encoder.layer.1.intermediate",
             "grad_count": "bert.encoder.layer.1.attention.output.dense.weight",
             "norm_scale": "bert.encoder.layer.1.output.LayerNorm"},
    "vit": {"accumulate": "vit.layers.1.mlp.fc2", "overflow": "vit.layers.1.mlp.activation_fn",
            "grad_count": "vit.layers.1.attention.o_proj.weight",
            "norm_scale": "vit.layers.1.layernorm_after"},
    "distilbert": {"accumulate": "distilbert.transformer.layer.1.ffn.lin2",
                   "overflow": "distilbert.transformer.layer.1.ffn.activation",
                   "grad_count": "distilbert.transformer.layer.1.attention.out_lin.weight",
                   "norm_scale": "distilbert.transformer.layer.1.sa_layer_norm"},
    "resnet": {"accumulate": "resnet.encoder.stages.2.layers.0.layer.1.convolution",
               "overflow": "resnet.encoder.stages.1.layers.0.layer.0.activation",
               "grad_count": "resnet.encoder.stages.1.layers.0.layer.1.convolution.weight",
               "norm_scale": "resnet.encoder.stages.1.layers.0.layer.1.normalization"},
}
BUGS = ("accumulate", "overflow", "grad_count", "norm_scale")


def plant(model, kind: str, bug: str, clock: Clock, start: int = 0, **options):
    """Plant ``bug`` in ``model`` (``TARGETS[kind][bug]``), active from step ``start`` of
    ``clock``. Options: accumulate ``chunk`` (elements summed in fp32 before each bf16 add,
    default 1: a plain bf16 accumulator); overflow ``limit`` (the activation saturates at it, as
    an fp16 value scaled by 65504/limit does; default: the 99th percentile of the activation
    at the first call) or ``saturate=False`` (inf instead); grad_count ``factor`` (default 2);
    norm_scale ``factor`` (default sqrt(128/96): the mean square over 128 padded lanes instead
    of 96). Returns the planted module's or parameter's name."""
    target = TARGETS[kind][bug]
    on = lambda: clock.step >= start  # noqa: E731
    if bug == "grad_count":
        param = model.get_parameter(target)
        factor = options.get("factor", 2.0)

        def scale(p):
            if on():
                p.grad.div_(factor)
        param.register_post_accumulate_grad_hook(scale)
        return target
    module = model.get_submodule(target)
    if bug == "accumulate":
        module.forward = _accumulating(module, on, options.get("chunk", 1))
    elif bug == "overflow":
        state = {"limit": options.get("limit")}
        saturate = options.get("saturate", True)

        def overflow(mod, args, out):
            if state["limit"] is None:
                state["limit"] = float(out.detach().float().abs().flatten().quantile(0.99))
            return _Fp16Overflow.apply(out, state["limit"], saturate) if on() else out
        module.register_forward_hook(overflow)
    elif bug == "norm_scale":
        factor = options.get("factor", math.sqrt(128 / 96))
        module.register_forward_hook(lambda mod, args, out: out * factor if on() else out)
    else:
        raise ValueError(f"bug: {bug!r} is not valid; accepted: {', '.join(BUGS)}")
    return target


class _Fp16Overflow(torch.autograd.Function):
    """An activation kept in fp16 at a scale where its largest values overflow: 65504 stands
    for ``limit``; beyond it the value saturates at +-limit (``saturate``, as an fp16
    conversion in saturation mode) or becomes inf. The backward is the clamp's (no gradient
    through a saturated value), in the activation's dtype."""

    @staticmethod
    def forward(ctx, x, limit, saturate):
        scale = 65504.0 / limit
        big = x.float() * scale
        if saturate:
            big = big.clamp(-65504.0, 65504.0)
        ctx.save_for_backward(x.abs() <= limit)
        return (big.half().float() / scale).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        (inside,) = ctx.saved_tensors
        return gy * inside, None, None


def bf16_mm(a, b, chunk: int = 1):
    """``a @ b`` (2-D) with the reduction accumulated in bf16: partial sums of ``chunk``
    products (exact in fp32, rounded to bf16) added one after another in bf16."""
    ab, bb = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
    acc = None
    for k0 in range(0, a.shape[1], chunk):
        part = (ab[:, k0:k0 + chunk] @ bb[k0:k0 + chunk]).to(torch.bfloat16)
        acc = part if acc is None else acc + part
    return acc


class _Bf16Accumulate(torch.autograd.Function):
    """A matmul kernel accumulating in bf16, in all three of its GEMMs: the forward (K = the
    input features), the input gradient (K = the output features) and the weight gradient
    (K = the tokens)."""

    @staticmethod
    def forward(ctx, x2, w, chunk):   # x2 (M, K), w (K, N)
        ctx.save_for_backward(x2, w)
        ctx.chunk = chunk
        with torch.autocast("cpu", enabled=False):
            return bf16_mm(x2, w, chunk)

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            gx = bf16_mm(gy, w.t(), ctx.chunk).to(x2.dtype)
            gw = bf16_mm(x2.t(), gy, ctx.chunk).to(w.dtype)
        return gx, gw, None


def _accumulating(module, on, chunk: int):
    """The module's matmul replaced by ``_Bf16Accumulate`` while the bug is on."""
    from transformers.pytorch_utils import Conv1D

    plain = module.forward

    def matmul(x2, w):
        return _Bf16Accumulate.apply(x2, w, chunk)

    def forward(x):
        if not on():
            return plain(x)
        if isinstance(module, Conv1D):
            y = matmul(x.reshape(-1, x.shape[-1]), module.weight) + module.bias.to(torch.bfloat16)
            return y.view(*x.shape[:-1], module.nf)
        if isinstance(module, torch.nn.Linear):
            y = matmul(x.reshape(-1, x.shape[-1]), module.weight.t())
            if module.bias is not None:
                y = y + module.bias.to(torch.bfloat16)
            return y.view(*x.shape[:-1], module.out_features)
        if isinstance(module, torch.nn.Conv2d):
            n, c, h, w = x.shape
            kh, kw = module.kernel_size
            cols = F.unfold(x, module.kernel_size, padding=module.padding, stride=module.stride)
            oh = (h + 2 * module.padding[0] - kh) // module.stride[0] + 1
            ow = (w + 2 * module.padding[1] - kw) // module.stride[1] + 1
            x2 = cols.transpose(1, 2).reshape(-1, cols.shape[1])
            y = matmul(x2, module.weight.reshape(module.out_channels, -1).t())
            y = y.view(n, oh * ow, -1).transpose(1, 2).reshape(n, -1, oh, ow)
            if module.bias is not None:
                y = y + module.bias.to(torch.bfloat16)[:, None, None]
            return y
        raise TypeError(f"accumulate: {type(module).__name__} is not a matmul module")
    return forward
