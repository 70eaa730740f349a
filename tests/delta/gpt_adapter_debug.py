# gpt_debug with Houlsby bottleneck adapters (after each block's attention and MLP), for the delta tests.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.delta import Adapter

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
delta = L(Adapter)(placement="houlsby", bottleneck=8, activation="gelu")
