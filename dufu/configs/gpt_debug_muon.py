# gpt_debug trained with Muon (dufu.optim.Muon): the hidden layers' weight matrices get Newton-Schulz
# orthogonalised Nesterov momentum scaled to AdamW's update RMS (Moonlight), everything else (embeddings, the
# tied head, norms, biases) AdamW. Thanks to that scaling both take gpt_debug's AdamW rate and weight decay
# (Liu et al. 2025 reuse AdamW's hyper-parameters the same way).
from dufu.config import LazyCall as L
from dufu.optim import Muon, muon_param_groups

from .gpt_debug import dataloader, model, optim as adamw, tokenization, train

optim = L(Muon)(
    # which parameter is Muon's and which AdamW's: dufu.optim.muon_param_groups (model filled in by the trainer)
    params=L(muon_param_groups)(weight_decay_norm=0.0, weight_decay_bias=0.0),
    lr=adamw.lr,
    weight_decay=adamw.weight_decay,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    # fp32 like the rest of this debug recipe: its layouts must equal one process at fp32 tolerances ("auto", the
    # default, iterates in bf16 where the device has bf16 matrix hardware: dufu.optim.muon explains)
    ns_dtype="float32",
    betas=adamw.betas,
    eps=adamw.eps,
    fused=True,
)
del adamw
train.output_dir = "output/gpt_debug_muon"
