# Supervised fine-tuning data: prompt/response pairs, each sample prompt + response + end-of-document,
# right-padded; the loss covers the response (and its end) only (dufu.data.sft). data_path is "builtin"
# (CPython's pydoc topics: "Explain the Python topic: <name>" -> the topic's opening paragraphs), a .jsonl
# file of {"prompt": ..., "response": ...} objects (other field names: prompt_key / response_key), a
# directory of them, or a list. prompt_template wraps each prompt, e.g. "### Question:\n{prompt}\n### Answer:\n".
from dufu.config import LazyCall as L
from dufu.data.sft import build_sft_datasets

dataloader = dict(
    # tokenizer is filled in by the trainer from `tokenization.tokenizer`
    train=L(build_sft_datasets)(
        data_path="builtin",
        prompt_key="prompt",
        response_key="response",
        seq_length=512,
        valid_fraction=0.1,
        max_prompt_length=None,  # None: half of seq_length; a longer prompt keeps its last tokens
        prompt_template="{prompt}",
        packing=False,  # True: several samples per row, each attending only to itself (dufu.data.packing)
    ),
)
