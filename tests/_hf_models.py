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


# -- the healthy zoo: architectures nobody here tuned the verdicts to (issues 19, 26) -------------
#: model kinds of the healthy zoo. Issue 19's five: three transformers (causal, RoPE/RMSNorm,
#: bidirectional), a CNN with BatchNorm and a ViT (transformers' classes, no torchvision).
#: Issue 26's: a mixture of experts (Mixtral; its default expert path, ``torch._grouped_mm``
#: after ``histc``, and its eager one, ``one_hot`` + ``index_add_``), an encoder-decoder (T5), a
#: speech model (Wav2Vec2: conv1d feature extractor with GroupNorm, a weight-normed positional
#: conv1d, transformer), ConvNeXt, an efficient CNN with squeeze-excite and in-place
#: activations (written here: timm's and torchvision's need torchvision), an LSTM/GRU language
#: model (written here) and a GQA/RoPE decoder with biased projections (Qwen2)
ZOO = ("gpt2", "llama", "bert", "resnet", "vit", "moe", "moe_eager", "t5", "wav2vec2",
       "convnext", "secnn", "rnnlm", "qwen2")
#: dtype settings: parameters in fp32, in bf16, or fp32 parameters under bf16 CPU autocast
ZOO_DTYPES = ("fp32", "bf16", "autocast")
#: the zoo models fed images / audio (the rest are language models fed token ids)
IMAGE_KINDS = ("resnet", "vit", "convnext", "secnn")
AUDIO_KINDS = ("wav2vec2",)


#: the zoo models that have dropout (``zoo_model(..., dropout=True)``)
ZOO_DROPOUT = ("gpt2", "llama", "bert", "vit")


class _Output:
    """What the training loop reads of a model's output (``.loss``), for the models written here."""

    def __init__(self, loss):
        self.loss = loss


class SqueezeExcite(torch.nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.reduce = torch.nn.Conv2d(c, c // r, 1)
        self.act = torch.nn.ReLU(inplace=True)
        self.expand = torch.nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = torch.nn.functional.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.expand(self.act(self.reduce(s))))


class MBConv(torch.nn.Module):
    """An inverted residual block (EfficientNet/MobileNetV3): 1x1 expand, depthwise 3x3,
    squeeze-excite, 1x1 project, BatchNorm after each conv, in-place SiLU."""

    def __init__(self, c, expand=4):
        super().__init__()
        h = c * expand
        self.expand = torch.nn.Sequential(torch.nn.Conv2d(c, h, 1, bias=False),
                                          torch.nn.BatchNorm2d(h), torch.nn.SiLU(inplace=True))
        self.depthwise = torch.nn.Sequential(torch.nn.Conv2d(h, h, 3, padding=1, groups=h,
                                                             bias=False),
                                             torch.nn.BatchNorm2d(h), torch.nn.SiLU(inplace=True))
        self.se = SqueezeExcite(h)
        self.project = torch.nn.Sequential(torch.nn.Conv2d(h, c, 1, bias=False),
                                           torch.nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class SECNN(torch.nn.Module):
    """A small efficient CNN: stem conv + BN + in-place SiLU, two MBConv blocks with
    squeeze-excite, a strided conv, global pooling and a linear head."""

    def __init__(self, width=16, classes=4):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, stride=2, padding=1,
                                                        bias=False),
                                        torch.nn.BatchNorm2d(width), torch.nn.SiLU(inplace=True))
        self.blocks = torch.nn.Sequential(MBConv(width), torch.nn.Conv2d(width, 2 * width, 3,
                                                                         stride=2, padding=1),
                                          torch.nn.BatchNorm2d(2 * width),
                                          torch.nn.ReLU(inplace=True), MBConv(2 * width))
        self.head = torch.nn.Linear(2 * width, classes)

    def forward(self, pixel_values, labels):
        h = self.blocks(self.stem(pixel_values))
        logits = self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))
        return _Output(torch.nn.functional.cross_entropy(logits, labels))


class RNNLM(torch.nn.Module):
    """An LSTM/GRU language model: embedding, a 2-layer LSTM, a 2-layer GRU (inter-layer dropout
    ``p`` in both, drawn inside ``torch.lstm`` / ``torch.gru``), dropout, tied-size head."""

    def __init__(self, vocab=VOCAB, width=64, p=0.0):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.lstm = torch.nn.LSTM(width, width, num_layers=2, dropout=p, batch_first=True)
        self.gru = torch.nn.GRU(width, width, num_layers=2, dropout=p, batch_first=True)
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        h, _ = self.lstm(self.embed(input_ids))
        h, _ = self.gru(h)
        logits = self.head(self.drop(h))
        return _Output(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                         labels[:, 1:].flatten()))


def zoo_model(kind: str, setting: str = "fp32", layers: int = 3, width: int = 96, seed: int = 0,
              dropout: bool = False):
    """A randomly initialised zoo model in training mode, dropout off (issue 19's set-up:
    3 layers, width 96; issue 26's models are smaller: 2 layers, width 64). ``setting``: one of
    ``ZOO_DTYPES`` (autocast keeps fp32 parameters). ``dropout=True``: GPT-2's default dropouts
    (0.1), 0.1 for BERT's and ViT's hidden and attention dropout, LLaMA's attention dropout and
    the RNN LM's (random calls, checked on the replayed stream)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    heads = 4
    p = 0.1 if dropout else 0.0
    small = dict(layers=2, width=64)
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
    elif kind in ("moe", "moe_eager"):
        w = small["width"]
        cfg = transformers.MixtralConfig(num_hidden_layers=small["layers"], hidden_size=w,
                                         intermediate_size=w + w // 2, num_attention_heads=heads,
                                         num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, vocab_size=VOCAB,
                                         max_position_embeddings=64, attention_dropout=p,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.MixtralForCausalLM(cfg)
        if kind == "moe_eager":
            model.set_experts_implementation("eager")
    elif kind == "qwen2":
        w = small["width"]
        cfg = transformers.Qwen2Config(num_hidden_layers=small["layers"], hidden_size=w,
                                       intermediate_size=2 * w, num_attention_heads=heads,
                                       num_key_value_heads=1, vocab_size=VOCAB,
                                       max_position_embeddings=64, attention_dropout=p,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "t5":
        w = small["width"]
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=w, d_kv=w // heads, d_ff=2 * w,
                                    num_layers=small["layers"], num_heads=heads,
                                    dropout_rate=p, decoder_start_token_id=0, pad_token_id=0,
                                    eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(cfg)
    elif kind == "wav2vec2":
        w = small["width"]
        cfg = transformers.Wav2Vec2Config(hidden_size=w, num_hidden_layers=small["layers"],
                                          num_attention_heads=heads, intermediate_size=2 * w,
                                          conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                                          conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                          num_conv_pos_embedding_groups=4, num_labels=4,
                                          hidden_dropout=p, activation_dropout=p,
                                          attention_dropout=p, feat_proj_dropout=p,
                                          final_dropout=p, layerdrop=0.0, mask_time_prob=0.0,
                                          classifier_proj_size=32)
        model = transformers.Wav2Vec2ForSequenceClassification(cfg)
    elif kind == "convnext":
        cfg = transformers.ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[16, 32],
                                          depths=[1, 1], num_stages=2, num_labels=4,
                                          image_size=32, drop_path_rate=0.0)
        model = transformers.ConvNextForImageClassification(cfg)
    elif kind == "secnn":
        model = SECNN()
    elif kind == "rnnlm":
        model = RNNLM(p=p)
    else:
        raise ValueError(f"kind: {kind!r} is not valid; accepted: {', '.join(ZOO)}")
    if setting not in ZOO_DTYPES:
        raise ValueError(f"setting: {setting!r} is not valid; accepted: {', '.join(ZOO_DTYPES)}")
    model.train()
    return model.to(torch.bfloat16) if setting == "bf16" else model


def zoo_batch(kind: str, gen, batch: int = 2, seq: int = 16) -> dict:
    """One batch of inputs (labels included) for a zoo model."""
    if kind in IMAGE_KINDS:
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
                "labels": torch.randint(0, 4, (batch,), generator=gen)}
    if kind in AUDIO_KINDS:
        return {"input_values": torch.randn(batch, 1600, generator=gen),
                "labels": torch.randint(0, 4, (batch,), generator=gen)}
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def zoo_train(model, kind: str, setting: str, steps: int = 2, probe=None, seed: int = 1,
              batch=None):
    """SGD steps on random batches (``batch(kind, generator)``, by default ``zoo_batch``), the
    probe (a FreeBench) around forward + backward; pixel and audio inputs are cast to the
    parameters' dtype. Returns the losses."""
    import contextlib

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        inputs = (batch or zoo_batch)(kind, gen)
        for key in ("pixel_values", "input_values", "input_features"):
            if key in inputs:
                inputs[key] = inputs[key].to(dtype)
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
