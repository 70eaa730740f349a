# llama_lora_debug with prefix tuning (4 virtual tokens in every self-attention) instead of LoRA, for the tests.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.delta import PrefixTuning

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("llama_lora_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
delta = L(PrefixTuning)(num_virtual_tokens=4)
