"""Supervised fine-tuning through the command line: pretrain llama_debug, then fine-tune it with llama_sft on a
.jsonl of prompt/response pairs. The logged loss of the first step (the pretrained weights, before any update)
must be the mean cross entropy over the response tokens (and each response's end) of the global batch only,
computed here by hand on each record unpadded: the prompt and the padding count for nothing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dufu.cli import main
from dufu.data import build_tokenizer
from dufu.engine.weights.pretrained import pretrained_model
from dufu_testing import FAST

# Short enough that nothing is truncated at llama_sft's seq_length 32 (prompts <= 16 tokens).
RECORDS = [
    {"question": "2+2=", "answer": "4"},
    {"question": "Say hi:", "answer": " hello there"},
    {"question": "Color of sky?", "answer": " blue, mostly"},
    {"question": "Q: a dog says", "answer": " woof woof"},
]


def losses(out) -> dict[int, float]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "pretrain"
    assert main(["train", "llama_debug", *FAST, "train.train_iter=2", "train.checkpointer.period=2",
                 f"train.output_dir={out}"]) == 0
    return out


def test_sft_loss_counts_only_response_tokens(pretrained, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n", encoding="utf-8")
    out = tmp_path / "sft"
    assert main([
        "train", "llama_sft", *FAST, f"model.pretrained={pretrained}", f"dataloader.train.data_path={data}",
        "dataloader.train.prompt_key=question", "dataloader.train.response_key=answer",
        "dataloader.train.valid_fraction=0", "train.train_micro_batch_size=4", "train.global_batch_size=4",
        "train.train_iter=3", "optim.lr=1e-2", "train.checkpointer.period=0", f"train.output_dir={out}",
    ]) == 0
    logged = losses(out)

    tok = build_tokenizer("byte")
    model = pretrained_model(path=str(pretrained)).eval()
    response_nll, all_nll, n_response, n_all = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for r in RECORDS:
            prompt, answer = tok.encode(r["question"]), tok.encode(r["answer"]) + [tok.eod_id]
            ids = torch.tensor([prompt + answer])  # (1, L): no padding at all
            logits = model(ids).logits[0, :-1].float()  # (L - 1, V): position t predicts token t + 1
            nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
            response_nll += nll[len(prompt) - 1:].sum().item()  # the targets that are answer tokens
            n_response += len(answer)
            all_nll += nll.sum().item()
            n_all += nll.numel()
    expected = response_nll / n_response
    assert logged[1] == pytest.approx(expected, rel=1e-5)
    # the loss over every token of the same records is another number: the prompts were left out
    assert abs(all_nll / n_all - expected) > 1e-3
    assert logged[3] < logged[1]  # and it learns (step 1 warms up from lr 0)
