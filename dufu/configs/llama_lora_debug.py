# LoRA on the tiny LLaMA (llama_debug's sizes): rank 4 on the attention's query and value projections, the
# built-in SFT data (prompt/response pairs from the pydoc topics, loss on the response), a few seconds in any
# layout. The base is llama_debug's seeded initialisation unless model.pretrained names one: a dufu run
# (`dufu train llama_debug` writes output/llama_debug) or a Hugging Face Llama/Qwen2 directory.
# Only the LoRA factors train and only they are saved in checkpoints.
from dufu.config import LazyCall as L
from dufu.delta import LoRA

from .common.data.sft import dataloader
from .common.finetune import finetune_run
from .llama_debug import model, optim, tokenization, train

model.pretrained = None
dataloader.train.seq_length = 32  # llama_debug's max_position_embeddings
delta = L(LoRA)(targets=["q_proj", "v_proj"], rank=4, alpha=8, dropout=0.0, rslora=False, dora=False)

finetune_run(train, optim, "output/llama_lora_debug")
optim.lr = 1e-3  # LoRA factors learn at a higher rate than full fine-tuning (PEFT's examples: 1e-4 to 2e-3)
