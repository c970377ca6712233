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
