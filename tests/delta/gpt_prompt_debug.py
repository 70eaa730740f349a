# gpt_debug with prompt tuning (4 virtual tokens before the sequence), for the delta tests.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.delta import PromptTuning

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
delta = L(PromptTuning)(num_virtual_tokens=4)
optim.lr = 1e-2  # prompt tuning's usual higher rate (a few hundred parameters)
