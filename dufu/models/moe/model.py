"""Mixture-of-experts causal decoder (Mixtral, Jiang et al. 2024; Qwen1.5-MoE / Qwen2-MoE; Qwen3-MoE),
single-device code built from dufu.layers.

The LLaMA decoder (:class:`dufu.models.llama.model.LlamaDecoder`: RMSNorm, rotary embeddings, grouped-query
attention, optional Q/K/V biases, optional per-head query/key RMSNorm as in Qwen3) in which the feed-forward of
some blocks is a :class:`dufu.layers.MoE`: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token,
optionally beside a shared expert every token goes through (Qwen2-MoE, gated by ``sigmoid(shared_gate(x))``).
The other blocks keep the dense SwiGLU MLP of ``ffn_hidden_size``. Block ``i`` is a mixture of experts when
``(i + 1) % moe_layer_freq == 0`` and ``i`` is not in ``mlp_only_layers`` (Qwen2-MoE's and Qwen3-MoE's rule,
their ``decoder_sparse_step``; Mixtral: every block). Qwen3-MoE is ``qk_norm=True`` with renormalised top-k
weights and no shared expert.

Parameter names follow the dense family's, with the experts under the block's ``mlp``:
``blocks.{i}.mlp.router.weight`` (E, H), ``blocks.{i}.mlp.experts.gate_up_proj`` (E, 2F, H),
``blocks.{i}.mlp.experts.down_proj`` (E, H, F), ``blocks.{i}.mlp.shared.{gate,up,down}_proj.weight`` and
``blocks.{i}.mlp.shared_gate.weight`` (1, H).

The auxiliary losses (load balancing, router z-loss) are not part of the returned loss, which is the
language-model loss alone: each MoE layer's output carries its auxiliary loss into the backward pass (see
:mod:`dufu.layers.moe`), so ``loss.backward()`` already gives the routers their gradient, on one device and
on every pipeline stage alike.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from dufu.layers import MoE
from dufu.models.llama.model import LlamaBlock, LlamaDecoder


class MoEModel(LlamaDecoder):
    """Causal decoder whose blocks' feed-forward is a mixture of experts (see the module docstring).

    The LLaMA keyword arguments mean what they mean for :class:`dufu.models.llama.LlamaModel`;
    ``ffn_hidden_size`` and ``mlp_bias`` are those of the dense blocks only, and ``hidden_dropout`` applies to
    the attention's output and the dense blocks (a MoE feed-forward has no dropout). The experts:

    * ``num_experts``, ``top_k``: experts per MoE block and how many each token uses;
    * ``moe_ffn_hidden_size``: each expert's hidden size (None: ``ffn_hidden_size``, as in Mixtral);
    * ``norm_topk_prob``: renormalise the kept router probabilities to sum to one (Mixtral: True; Qwen2-MoE's
      default: False);
    * ``capacity_factor``: None routes every token to its ``top_k`` experts (dropless); a number caps each
      expert's assignments (:class:`dufu.layers.MoE`);
    * ``aux_loss_coeff``, ``z_loss_coeff``: the load-balancing and router z-loss weights (they reach the
      gradients through the layers' outputs, not through the returned loss);
    * ``shared_ffn_hidden_size``: a shared SwiGLU expert of that size in every MoE block; with
      ``shared_expert_gate`` its output is scaled by a learned sigmoid gate (Qwen2-MoE);
    * ``moe_layer_freq``, ``mlp_only_layers``: which blocks are MoE blocks (see the module docstring);
    * ``score_func``, ``n_group``, ``topk_group``, ``routed_scaling_factor``, ``score_bias``,
      ``bias_update_rate``, ``seq_aux_loss_coeff``: DeepSeekMoE routing and auxiliary-loss-free balancing, as
      :class:`dufu.layers.MoE` takes them (defaults: Mixtral's softmax routing)."""

    supports_context_parallel = False
    context_parallel_unsupported_reason = (
        "its load-balancing loss is computed from the router's statistics over the tokens a rank holds, so "
        "chunks would change it (and experts are carved out of the data ranks, which context parallelism splits)")

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 4096,
        num_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: Optional[int] = 8,
        head_dim: Optional[int] = None,
        ffn_hidden_size: int = 14336,
        max_position_embeddings: int = 32768,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 1000000.0,
        rope_scaling: Optional[dict] = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        mlp_bias: bool = False,
        embedding_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        fused_loss: bool = False,
        qk_norm: bool = False,
        num_experts: int = 8,
        top_k: int = 2,
        moe_ffn_hidden_size: Optional[int] = None,
        norm_topk_prob: bool = True,
        capacity_factor: Optional[float] = None,
        aux_loss_coeff: float = 0.01,
        z_loss_coeff: float = 0.0,
        shared_ffn_hidden_size: Optional[int] = None,
        shared_expert_gate: bool = False,
        moe_layer_freq: int = 1,
        mlp_only_layers: Sequence[int] = (),
        pretrained: Optional[str] = None,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        score_bias: bool = False,
        bias_update_rate: float = 0.0,
        seq_aux_loss_coeff: float = 0.0,
    ):
        if not isinstance(moe_layer_freq, int) or moe_layer_freq < 1:
            raise ValueError(f"MoEModel: moe_layer_freq {moe_layer_freq!r} must be a whole number >= 1 (every "
                             "moe_layer_freq-th block is a MoE block)")
        outside = sorted(i for i in mlp_only_layers if not 0 <= i < num_layers)
        if outside:
            raise ValueError(f"MoEModel: mlp_only_layers {outside} are not blocks of a {num_layers}-layer model "
                             f"(0 .. {num_layers - 1})")
        # Read by _block while LlamaDecoder's constructor builds the blocks, so they are set first (plain
        # values, which nn.Module accepts before its own __init__).
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_ffn_hidden_size = moe_ffn_hidden_size or ffn_hidden_size
        self.norm_topk_prob, self.capacity_factor = norm_topk_prob, capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.shared_ffn_hidden_size, self.shared_expert_gate = shared_ffn_hidden_size, shared_expert_gate
        self.moe_layer_freq, self.mlp_only_layers = moe_layer_freq, tuple(sorted(set(mlp_only_layers)))
        self.router_options = dict(score_func=score_func, n_group=n_group, topk_group=topk_group,
                                   routed_scaling_factor=routed_scaling_factor, score_bias=score_bias,
                                   bias_update_rate=bias_update_rate, seq_aux_loss_coeff=seq_aux_loss_coeff)
        super().__init__(
            vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, head_dim=head_dim, ffn_hidden_size=ffn_hidden_size,
            max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
            rope_scaling=rope_scaling, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
            embedding_dropout=embedding_dropout, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
            tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range, fused_loss=fused_loss,
            qk_norm=qk_norm, pretrained=pretrained,
        )

    def is_moe_layer(self, i: int) -> bool:
        """True when block ``i``'s feed-forward is a mixture of experts (Qwen2-MoE's rule)."""
        return (i + 1) % self.moe_layer_freq == 0 and i not in self.mlp_only_layers

    def _block(self, i: int, **kwargs) -> nn.Module:
        mlp = None
        if self.is_moe_layer(i):
            mlp = MoE(
                kwargs["hidden_size"], self.moe_ffn_hidden_size, self.num_experts, top_k=self.top_k,
                norm_topk_prob=self.norm_topk_prob, capacity_factor=self.capacity_factor,
                aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff,
                shared_ffn_hidden_size=self.shared_ffn_hidden_size, shared_expert_gate=self.shared_expert_gate,
                init_std=self.initializer_range, **self.router_options,
            )
        return LlamaBlock(layer_idx=i, mlp=mlp, **kwargs)

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE feed-forwards of the blocks this model holds, by block key (a pipeline stage: its own)."""
        return {key: block.mlp for key, block in self.blocks.items() if isinstance(block.mlp, MoE)}
