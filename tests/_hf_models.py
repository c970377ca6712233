"""Tiny randomly initialised Hugging Face models (built from configs; nothing is downloaded)
and a training loop on synthetic tokens, shared by tests and benchmarks/bench_models.py."""
import torch

VOCAB = 256


def build(kind: str, dtype=torch.float32, layers=2, width=64, seed=0):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                       intermediate_size=2 * width, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, bos_token_id=0,
                                       eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"kind: {kind!r} is not valid; accepted: gpt2, llama")
    return model.to(dtype)


def train(model, steps=3, seed=1, batch=2, seq=16, probe=None, lr=1e-3):
    """AdamW on random tokens. ``probe``: a FreeBench (entered around forward+backward).
    Returns the losses as Python floats."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        if probe is not None:
            probe.start()
        try:
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
        finally:
            if probe is not None:
                probe.stop()
        opt.step()
        if probe is not None:
            probe.step()
        losses.append(loss.item())
    return losses


# -- the healthy zoo: five architectures nobody here wrote (issue 19) -----------------------------
#: model kinds of the healthy zoo: three transformers (causal, RoPE/RMSNorm, bidirectional), a
#: CNN with BatchNorm and a ViT, all from Hugging Face transformers configs (no torchvision)
ZOO = ("gpt2", "llama", "bert", "resnet", "vit")
#: dtype settings: parameters in fp32, in bf16, or fp32 parameters under bf16 CPU autocast
ZOO_DTYPES = ("fp32", "bf16", "autocast")


#: the zoo models that have dropout (``zoo_model(..., dropout=True)``)
ZOO_DROPOUT = ("gpt2", "llama", "bert", "vit")


def zoo_model(kind: str, setting: str = "fp32", layers: int = 3, width: int = 96, seed: int = 0,
              dropout: bool = False):
    """A randomly initialised zoo model in training mode, dropout off (issue 19's set-up:
    3 layers, width 96). ``setting``: one of ``ZOO_DTYPES`` (autocast keeps fp32 parameters).
    ``dropout=True``: GPT-2's default dropouts (0.1), 0.1 for BERT's and ViT's hidden and
    attention dropout and LLaMA's attention dropout (random calls, checked on the replayed
    stream)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    heads = 4
    p = 0.1 if dropout else 0.0
    if kind in ("gpt2", "llama"):
        model = build(kind, torch.float32, layers=layers, width=width, seed=seed)
        if kind == "llama" and dropout:
            model.config.attention_dropout = p
            for blk in model.model.layers:
                blk.self_attn.attention_dropout = p
        if kind == "gpt2" and not dropout:  # dropout off: the measurement
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
            model.config.attn_pdrop = 0.0
            for blk in model.transformer.h:
                blk.attn.attn_dropout.p = 0.0
    elif kind == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers,
                                      num_attention_heads=heads, intermediate_size=2 * width,
                                      max_position_embeddings=64, hidden_dropout_prob=p,
                                      attention_probs_dropout_prob=p)
        model = transformers.BertForMaskedLM(cfg)
    elif kind == "resnet":
        cfg = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64],
                                        depths=[1, 1, 1], layer_type="basic", num_labels=4)
        model = transformers.ResNetForImageClassification(cfg)
    elif kind == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3,
                                     hidden_size=width, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=2 * width,
                                     num_labels=4, hidden_dropout_prob=p,
                                     attention_probs_dropout_prob=p)
        model = transformers.ViTForImageClassification(cfg)
    else:
        raise ValueError(f"kind: {kind!r} is not valid; accepted: {', '.join(ZOO)}")
    if setting not in ZOO_DTYPES:
        raise ValueError(f"setting: {setting!r} is not valid; accepted: {', '.join(ZOO_DTYPES)}")
    model.train()
    return model.to(torch.bfloat16) if setting == "bf16" else model


def zoo_batch(kind: str, gen, batch: int = 2, seq: int = 16) -> dict:
    """One batch of inputs (labels included) for a zoo model."""
    if kind in ("resnet", "vit"):
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 4, (batch,), generator=gen)}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def zoo_train(model, kind: str, setting: str, steps: int = 2, probe=None, seed: int = 1):
    """SGD steps on random batches, the probe (a FreeBench) around forward + backward; pixel
    inputs are cast to the parameters' dtype. Returns the losses."""
    import contextlib

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        inputs = zoo_batch(kind, gen)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast" \
            else contextlib.nullcontext()
        if probe is not None:
            probe.start()
        try:
            with amp:
                loss = model(**inputs).loss
            opt.zero_grad()
            loss.backward()
        finally:
            if probe is not None:
                probe.stop()
        opt.step()
        if probe is not None:
            probe.step()
        losses.append(loss.item())
    return losses
