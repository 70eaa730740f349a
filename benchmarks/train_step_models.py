"""The models ``benchmarks/train_step.py`` races against dufu's: a single-file PyTorch GPT-2 (``plain``) and
transformers' ``GPT2LMHeadModel`` (``hf``), both of GPT-2 small's architecture, and the copy of dufu's weights into
either, so that all three start from the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- (b) the plain PyTorch GPT-2
class PlainAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)  # q, k and v in one matmul
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class PlainMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class PlainBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = PlainAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = PlainMLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, num_layers, hidden_size, num_attention_heads, vocab_size, max_position_embeddings):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.wpe = nn.Embedding(max_position_embeddings, hidden_size)
        self.h = nn.ModuleList(PlainBlock(hidden_size, num_attention_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 cross entropy for every implementation, as dufu computes it, so bf16 runs do the same work.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings, not biases or norm weights (the usual GPT-2 split)."""
    params = {id(p): p for p in model.parameters()}.values()
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------- copying dufu's weights
@torch.no_grad()
def copy_dufu_weights(dufu_model: nn.Module, dst: nn.Module, kind: str) -> None:
    """Load the dufu model's weights into the plain (``nn.Linear``) or hf (``Conv1D``, transposed) model."""
    body = dst.transformer if kind == "hf" else dst
    t = (lambda w: w.t()) if kind == "hf" else (lambda w: w)  # Conv1D stores (in, out)
    body.wte.weight.copy_(dufu_model.wte.weight)
    body.wpe.weight.copy_(dufu_model.wpe.weight)
    body.ln_f.load_state_dict(dufu_model.ln_f.state_dict())
    for i, blk in enumerate(body.h):
        src = dufu_model.blocks[str(i)]
        a = src.attn
        blk.ln_1.load_state_dict(src.ln1.state_dict())
        blk.ln_2.load_state_dict(src.ln2.state_dict())
        blk.attn.c_attn.weight.copy_(t(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)))
        blk.attn.c_attn.bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0))
        blk.attn.c_proj.weight.copy_(t(a.out_proj.weight))
        blk.attn.c_proj.bias.copy_(a.out_proj.bias)
        blk.mlp.c_fc.weight.copy_(t(src.mlp.fc1.weight))
        blk.mlp.c_fc.bias.copy_(src.mlp.fc1.bias)
        blk.mlp.c_proj.weight.copy_(t(src.mlp.fc2.weight))
        blk.mlp.c_proj.bias.copy_(src.mlp.fc2.bias)


def build_hf(model_size: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=model_size["vocab_size"],
        n_positions=model_size["max_position_embeddings"],
        n_embd=model_size["hidden_size"],
        n_layer=model_size["num_layers"],
        n_head=model_size["num_attention_heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)
