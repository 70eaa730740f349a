"""DeepSeek-V3 decoders (DeepSeek-V2/V2-Lite, Moonlight): multi-head latent attention, DeepSeekMoE blocks after dense
first blocks, optional multi-token prediction."""

from dufu.models.deepseek.model import DeepseekV3Model

__all__ = ["DeepseekV3Model"]
