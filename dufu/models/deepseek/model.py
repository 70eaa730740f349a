"""The DeepSeek-V3 decoder (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"; DeepSeek-V2 / V2-Lite and Moonlight
share it), single-device code built from dufu.layers.

Pre-norm blocks ``x + mla(rmsnorm(x))`` then ``x + ffn(rmsnorm(x))``: multi-head latent attention
(:class:`dufu.layers.MLA`) in every block; the first ``first_k_dense`` blocks have a dense SwiGLU feed-forward of
``ffn_hidden_size``, the others a DeepSeekMoE layer (:class:`dufu.layers.MoE`): ``num_experts`` fine-grained
routed experts of ``moe_ffn_hidden_size``, ``top_k`` per token by sigmoid scores (group-limited to
``topk_group`` of ``n_group`` groups, weights renormalised and times ``routed_scaling_factor``), beside
``num_shared_experts`` shared experts (one SwiGLU of ``num_shared_experts x moe_ffn_hidden_size``), balanced
without an auxiliary loss by a per-expert bias on the choice (``score_bias``, moved by ``bias_update_rate``
after each step by the training loop) plus a small sequence-wise balance loss (``seq_aux_loss_coeff``), which
reaches the gradients through the layers themselves (:mod:`dufu.layers.moe`).

**Multi-token prediction** (sec. 2.2), ``mtp_depth`` = D modules. Module k (1..D) takes the previous depth's
hidden state at position i (k = 1: the main model's last block output, before the final norm) and the embedding
of token i + k, RMS-normalises both, concatenates them (embedding first, the order of DeepSeek's checkpoints and
transformers' ``MtpLayer``), projects 2H -> H (``eh_proj``), runs one block (MLA + MoE, like the main model's
last), normalises (``norm``) and predicts token i + k + 1 with the shared output head; the embedding table is
the main model's too. Positions i + k beyond the sequence have no token: they are fed token 0 and their targets
are ignored, and causal attention keeps them from touching the others. The loss is
``lm_loss + mtp_loss_weight x mtp_loss``, ``mtp_loss`` the mean over depths of each depth's mean cross entropy
(DeepSeek-V3 uses 0.3 for the first 10T tokens, then 0.1); the output carries the parts (``lm_loss``,
``mtp_loss``). Without labels (generation, evaluation of logits) the MTP modules do not run; the Hugging Face
mapping stores them as DeepSeek's checkpoints do (:mod:`dufu.models.deepseek.hf`), which transformers'
DeepseekV3ForCausalLM leaves aside.

Pipeline parallelism: blocks by ``layer_idx``; the first stage keeps the embedding, the last the final norm, the
head and the MTP modules. The MTP modules need the embeddings of later tokens, which only the first stage can
compute: that stage embeds the D shifted copies of the input ids and every stage passes them on beside the
hidden states (D extra (B, T, H) activations per hop; their gradients flow back to the embedding the same way).
The shift is made on the token ids, before the embedding, so under sequence parallelism a rank's shard of the
shifted embeddings lines up with its shard of the hidden states. Under tensor parallelism an MTP module is
replicated (``tensor_parallel_replicated``: one block's weights on every tensor-parallel rank, fed the whole
sequence, as a MoE layer is). Context parallelism is refused with MTP (the shift crosses the chunks' borders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dufu.layers import MLA, GatedMLP, KVCache, Linear, MoE, RMSNorm, VocabEmbedding
from dufu.layers.attention import context_parallel_of, document_mask
from dufu.layers.loss import causal_lm_loss, fused_linear_cross_entropy, next_token_labels
from dufu.layers.mla import LatentRotary
from dufu.models.base import InitByModule
from dufu.models.outputs import ModelOutput


@dataclass
class DeepseekOutput(ModelOutput):
    """``loss`` = ``lm_loss + mtp_loss_weight x mtp_loss`` (what training minimises); the parts beside it."""

    lm_loss: Optional[torch.Tensor] = None
    mtp_loss: Optional[torch.Tensor] = None

    @property
    def loss_parts(self) -> dict[str, torch.Tensor]:
        """The named parts of ``loss`` a run can log beside it."""
        return {k: v for k, v in (("lm_loss", self.lm_loss), ("mtp_loss", self.mtp_loss)) if v is not None}


class DeepseekBlock(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``: MLA, then a dense SwiGLU or a DeepSeekMoE
    layer; ``layer_idx`` places it on a pipeline stage."""

    def __init__(self, hidden_size: int, layer_idx: int, attn: MLA, mlp: nn.Module, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                context_parallel=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), attention_mask=attention_mask, position_ids=position_ids,
                          kv_cache=kv_cache, context_parallel=context_parallel)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class MTPModule(nn.Module):
    """One multi-token-prediction depth (module docstring): ``norm(block(eh_proj([enorm(e); hnorm(h)])))``.
    Its input is h and e stacked along the batch dim (2B, T, H): one tensor, so that under tensor parallelism the
    module is replicated and its input gathered whole along the sequence like a MoE layer's
    (``tensor_parallel_replicated``), and its gradient's halves are contiguous (a pipeline stage sends the
    gradients of what it received, and point-to-point sends take contiguous tensors only)."""

    tensor_parallel_replicated = True

    def __init__(self, hidden_size: int, block: DeepseekBlock, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        # torch's RMSNorm: inside a replicated module nothing is sequence-parallel
        self.enorm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)

    def forward(self, he: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        h, e = he.chunk(2, dim=0)  # (B, T, H) each
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))  # (B, T, H)
        return self.norm(self.block(x, attention_mask=attention_mask, position_ids=position_ids))


class MultiTokenPrediction(nn.ModuleDict):
    """The MTP depths keyed ``str(k - 1)``, run in order by one call (so that hooks on this module, e.g. an FSDP
    unit's, see them run): ``forward(h, embeddings)`` -> the hidden state of each depth, D x (B, T, H)."""

    def forward(self, h: torch.Tensor, embeddings, attention_mask=None, position_ids=None) -> list[torch.Tensor]:
        out = []
        for k, module in enumerate(self.values()):
            h = module(torch.cat([h, embeddings[k]], dim=0), attention_mask=attention_mask,
                       position_ids=position_ids)  # (B, T, H)
            out.append(h)
        return out


def shifted_ids(input_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Token i + k at position i (B, T); token 0 where i + k is past the end (its target is ignored)."""
    return F.pad(input_ids[:, k:], (0, k), value=0)


def shifted_targets(target: torch.Tensor, k: int) -> torch.Tensor:
    """The target of MTP depth k at position i: ``target[:, i + k]`` (next-token targets), -100 past the end."""
    return F.pad(target[:, k:], (0, k), value=-100)


class DeepseekV3Model(InitByModule, nn.Module):
    """The DeepSeek-V3 causal decoder (module docstring). The attention: ``num_attention_heads`` heads,
    ``q_lora_rank`` (None: a plain query projection), ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave`` (see :class:`dufu.layers.MLA`); ``rope_scaling``
    e.g. DeepSeek-V3's ``{"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}``. The experts: see
    :class:`dufu.layers.MoE` for ``score_func``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
    ``score_bias``, ``bias_update_rate``, ``seq_aux_loss_coeff``, ``aux_loss_coeff``, ``capacity_factor``.
    ``fused_loss``: the head and cross entropy chunk by chunk, as :class:`dufu.models.llama.LlamaModel`."""

    pipeline_layout = {"blocks": "blocks", "first": ("wte",), "last": ("norm", "lm_head", "mtp")}
    main_input_name = "input_ids"
    # The family takes sequence chunks (MLA gathers the latents); a model built with MTP or the sequence-wise
    # balance loss cannot, and says why in its constructor.
    supports_context_parallel = True
    context_parallel_unsupported_reason = ""

    def __init__(
        self,
        vocab_size: int = 129280,
        hidden_size: int = 7168,
        num_layers: int = 61,
        num_attention_heads: int = 128,
        q_lora_rank: Optional[int] = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        ffn_hidden_size: int = 18432,
        first_k_dense: int = 3,
        num_experts: int = 256,
        top_k: int = 8,
        moe_ffn_hidden_size: int = 2048,
        num_shared_experts: int = 1,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        norm_topk_prob: bool = True,
        score_func: str = "sigmoid",
        score_bias: bool = True,
        bias_update_rate: float = 0.001,
        seq_aux_loss_coeff: float = 0.0001,
        aux_loss_coeff: float = 0.0,
        capacity_factor: Optional[float] = None,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        rope_interleave: bool = True,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        embedding_dropout: float = 0.0,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        mtp_depth: int = 0,
        mtp_loss_weight: float = 0.3,
        fused_loss: bool = False,
        pretrained: Optional[str] = None,
    ):
        super().__init__()
        if not 0 <= first_k_dense <= num_layers:
            raise ValueError(f"DeepseekV3Model: first_k_dense {first_k_dense} must be between 0 and num_layers "
                             f"{num_layers} (the first blocks with a dense feed-forward)")
        if mtp_depth < 0:
            raise ValueError(f"DeepseekV3Model: mtp_depth {mtp_depth} must be >= 0 (0: no multi-token prediction)")
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.num_attention_heads, self.max_position_embeddings = num_attention_heads, max_position_embeddings
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.ffn_hidden_size, self.first_k_dense = ffn_hidden_size, first_k_dense
        self.num_experts, self.top_k, self.moe_ffn_hidden_size = num_experts, top_k, moe_ffn_hidden_size
        self.num_shared_experts, self.n_group, self.topk_group = num_shared_experts, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.rope_theta = rope_theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.rope_interleave, self.attention_bias = rope_interleave, attention_bias
        self.rms_norm_eps, self.attention_dropout = rms_norm_eps, attention_dropout
        self.initializer_range, self.fused_loss = initializer_range, fused_loss
        self.tie_word_embeddings = tie_word_embeddings
        self.mtp_depth, self.mtp_loss_weight = mtp_depth, mtp_loss_weight
        self.tied_parameter_names = {"lm_head.weight": "wte.weight"} if tie_word_embeddings else {}
        self.return_dict = True
        attn_kwargs = dict(
            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta, rope_scaling=rope_scaling, rope_interleave=rope_interleave, bias=attention_bias,
            norm_eps=rms_norm_eps, attention_dropout=attention_dropout)
        moe_kwargs = dict(
            top_k=top_k, norm_topk_prob=norm_topk_prob, capacity_factor=capacity_factor,
            aux_loss_coeff=aux_loss_coeff, shared_ffn_hidden_size=num_shared_experts * moe_ffn_hidden_size or None,
            init_std=initializer_range, score_func=score_func, n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor, score_bias=score_bias, bias_update_rate=bias_update_rate,
            seq_aux_loss_coeff=seq_aux_loss_coeff)

        def block(i: int, moe: bool) -> DeepseekBlock:
            mlp = (MoE(hidden_size, moe_ffn_hidden_size, num_experts, **moe_kwargs) if moe
                   else GatedMLP(hidden_size, ffn_hidden_size, activation="silu", bias=False))
            attn = MLA(hidden_size, num_attention_heads, **attn_kwargs)
            return DeepseekBlock(hidden_size, i, attn, mlp, rms_norm_eps)

        self.wte = VocabEmbedding(vocab_size, hidden_size)
        self.drop = nn.Dropout(embedding_dropout)
        self.blocks = nn.ModuleDict({str(i): block(i, i >= first_k_dense) for i in range(num_layers)})
        self.norm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = Linear(hidden_size, vocab_size, bias=False, parallel="col")
        # MTP module k is keyed str(k - 1); its block's layer_idx continues the main blocks' (num_layers + k - 1)
        self.mtp = MultiTokenPrediction({
            str(k): MTPModule(hidden_size, block(num_layers + k, True), rms_norm_eps) for k in range(mtp_depth)
        }) if mtp_depth else None
        reasons = [m.context_parallel_unsupported_reason for m in self.modules() if isinstance(m, MoE)]
        if mtp_depth:
            reasons.insert(0, "multi-token prediction shifts each sequence by up to mtp_depth tokens, across the "
                              "chunk boundaries of context parallelism; set model.mtp_depth=0")
        reasons = [r for r in reasons if r]
        self.supports_context_parallel = not reasons
        self.context_parallel_unsupported_reason = reasons[0] if reasons else ""
        self.finish_init(pretrained)

    # ------------------------------------------------------------------ init
    def init_module(self, name: str, module: nn.Module) -> None:
        """Matrices, embeddings and experts N(0, initializer_range), norms 1 (transformers' rule for the
        family); the MoE's choice bias 0; the rotary tables recomputed (a meta build leaves them empty)."""
        self.init_normal(name, module, self.initializer_range)
        if isinstance(module, MoE):
            module.init_own()
        elif isinstance(module, LatentRotary):
            module.reset_parameters()

    def output_head(self) -> Optional[nn.Module]:
        return self.lm_head

    def token_embedding(self) -> Optional[nn.Module]:
        return self.wte

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE layers this model (a pipeline stage: its part) holds, by module name."""
        return {n: m for n, m in self.named_modules() if isinstance(m, MoE)}

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        shift_labels: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> DeepseekOutput:
        """Hugging Face semantics as :class:`dufu.models.llama.LlamaModel`: ``labels`` are the input ids (shifted
        inside), ``shift_labels`` the next-token ids (the trainer's); ``attention_mask``, ``position_ids`` (packed
        documents) and ``kv_cache`` as there. With labels the MTP modules run and the loss has their part (module
        docstring); without, they do not. With ``fused_loss`` and labels, ``logits`` is None."""
        target = shift_labels if shift_labels is not None else (
            next_token_labels(labels) if labels is not None else None)
        h, mtp_embeddings, attention_mask = self._embed(input_ids, attention_mask, position_ids, kv_cache,
                                                        with_mtp=target is not None)
        h, mtp_hidden = self._blocks_and_mtp(h, mtp_embeddings, attention_mask, position_ids, kv_cache)
        h = self.norm(h)
        if self.fused_loss and target is not None:
            lm_loss = fused_linear_cross_entropy(h, self.lm_head.weight, target)
            mtp_losses = [fused_linear_cross_entropy(m, self.lm_head.weight, shifted_targets(target, k + 1))
                          for k, m in enumerate(mtp_hidden)]
            return self._output(lm_loss, mtp_losses, None)
        logits = self.lm_head(h)  # (B, T, V)
        if target is None:
            return DeepseekOutput(logits=logits) if self.return_dict else logits
        lm_loss = causal_lm_loss(logits, target)
        mtp_losses = [causal_lm_loss(self.lm_head(m), shifted_targets(target, k + 1)) for k, m in enumerate(mtp_hidden)]
        return self._output(lm_loss, mtp_losses, logits)

    def pipeline_forward(self, *received: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                         position_ids: Optional[torch.Tensor] = None):
        """One pipeline stage. ``received``: ``(input_ids,)`` on the first stage, else what the stage before
        returned: the hidden states (B, T, C), then the D MTP depths' embeddings (module docstring). A stage other
        than the last returns that tuple (the hidden states alone without MTP); the last returns the logits, or
        ``(logits, MTP logits of each depth, mtp_loss_weight)`` for :func:`deepseek_pipeline_loss`."""
        if self.wte is not None:
            (input_ids,) = received
            h, mtp_embeddings, attention_mask = self._embed(input_ids, attention_mask, position_ids, None,
                                                            with_mtp=True)
        else:
            h, mtp_embeddings = received[0], received[1:]
            if position_ids is not None and context_parallel_of(self) is None:
                attention_mask = document_mask(position_ids, attention_mask)
        if self.lm_head is None:  # not the last stage: run the blocks, pass the MTP embeddings on
            for block in self.blocks.values():
                h = block(h, attention_mask=attention_mask, position_ids=position_ids,
                          context_parallel=context_parallel_of(self))
            return (h, *mtp_embeddings) if mtp_embeddings else h
        h, mtp_hidden = self._blocks_and_mtp(h, mtp_embeddings, attention_mask, position_ids, None)
        logits = self.lm_head(self.norm(h))  # (B, T, V)
        if not mtp_hidden:
            return logits
        # the weight as a (1,) tensor: the schedule concatenates the micro-batches' outputs along dim 0
        return (logits, *[self.lm_head(m) for m in mtp_hidden],
                torch.full((1,), self.mtp_loss_weight, device=logits.device))

    def _embed(self, input_ids, attention_mask, position_ids, kv_cache, with_mtp: bool):
        """(token embeddings (B, T, C), the MTP depths' embeddings of tokens i + k (k = 1 .. D) when
        ``with_mtp`` and the model has MTP, the attention mask the blocks take)."""
        if position_ids is not None and kv_cache is None and context_parallel_of(self) is None:
            attention_mask = document_mask(position_ids, attention_mask)  # once for all blocks
        h = self.drop(self.wte(input_ids))  # (B, T, C)
        mtp = ()
        if with_mtp and self.mtp_depth:
            mtp = tuple(self.wte(shifted_ids(input_ids, k)) for k in range(1, self.mtp_depth + 1))
        return h, mtp, attention_mask

    def _blocks_and_mtp(self, h, mtp_embeddings, attention_mask, position_ids, kv_cache):
        """This model's blocks on h, then the MTP depths (when given their embeddings): (h before the final
        norm, the depths' hidden states)."""
        cp = context_parallel_of(self)
        for block in self.blocks.values():
            h = block(h, attention_mask=attention_mask, position_ids=position_ids, kv_cache=kv_cache,
                      context_parallel=cp)
        mtp_hidden = []
        if self.mtp is not None and mtp_embeddings:  # depth 1 reads h before the final norm
            mtp_hidden = self.mtp(h, mtp_embeddings, attention_mask=attention_mask, position_ids=position_ids)
        return h, mtp_hidden

    def _output(self, lm_loss, mtp_losses, logits) -> DeepseekOutput:
        if not mtp_losses:
            return DeepseekOutput(loss=lm_loss, logits=logits, lm_loss=lm_loss)
        mtp_loss = torch.stack(mtp_losses).mean()
        return DeepseekOutput(loss=lm_loss + self.mtp_loss_weight * mtp_loss, logits=logits, lm_loss=lm_loss,
                              mtp_loss=mtp_loss)


def deepseek_pipeline_loss(output, target: torch.Tensor) -> torch.Tensor:
    """What a pipeline's last stage computes from its output: the logits alone, or ``(logits, MTP logits of
    depth 1 .. D, mtp_loss_weight as a (1,) tensor)`` (a class-level loss function sees no model, so the stage
    hands it the weight): the LM loss plus the weight x the mean MTP loss, as the model's ``loss``."""
    if not isinstance(output, tuple):
        return causal_lm_loss(output, target)
    logits, *mtp_logits, weight = output
    mtp = torch.stack([causal_lm_loss(m, shifted_targets(target, k + 1)) for k, m in enumerate(mtp_logits)]).mean()
    return causal_lm_loss(logits, target) + weight.reshape(-1)[0].to(mtp.dtype) * mtp


DeepseekV3Model.pipeline_loss = staticmethod(deepseek_pipeline_loss)
