"""A small bf16 transformer block (attention + MLP + LayerNorm) for the free-benchmark tests."""
import torch
import torch.nn as nn
import torch.nn.functional as F


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
