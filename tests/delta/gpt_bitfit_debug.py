# gpt_debug with BitFit (biases only) plus the final norm, for the delta tests.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.delta import BitFit, Freeze

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
delta = [L(BitFit)(), L(Freeze)(unfreeze=["ln_f"])]
