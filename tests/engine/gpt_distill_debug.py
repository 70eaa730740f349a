# gpt_debug as a distillation student (1 layer, hidden 32) of a gpt_debug teacher; the tests set distill.teacher.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.engine.distill import Distillation

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
model.update(hidden_size=32, num_layers=1, num_attention_heads=2)
distill = L(Distillation)(teacher="output/gpt_debug", temperature=2.0, kd_weight=0.5)
train.evaluation.enabled = False
