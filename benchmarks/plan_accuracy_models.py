"""The models ``benchmarks/plan_accuracy.py`` measures, by name: the calibration model, the one the constants of
the CPU cost model (``dufu/plan/cpu.py``) were set on, and held-out models of other widths, depths and a second
family, which were not, so they check the CPU model out of sample.

A model is a recipe, the sizes it overrides (``model.<key>=<value>``), the smaller sizes of a ``--quick`` run (4
layers or more: interleaved 1F1B at pp 2 needs 4 stages) and the tiny model of its baseline runs: the baseline
(the same command with a tiny model, whose peak RSS is subtracted from the model run's) is of the same family, so
it holds the same code, imports and buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_memory import BASELINE_MODEL, MEMORY_MODEL, QUICK_MEMORY_MODEL

# The tiny LLaMA of the LLaMA baselines: llama_debug's sizes (1 layer; 4 query and 2 key-value heads, SwiGLU 176)
# at the benchmarks' sequence length.
LLAMA_BASELINE = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=176,
                      vocab_size=384, max_position_embeddings=64)


@dataclass(frozen=True)
class Model:
    """One measured model: ``recipe`` with ``sizes`` (``quick`` in a ``--quick`` run), baseline runs with
    ``baseline`` (one layer per pipeline stage added as needed). ``held_out``: not used to set the CPU cost
    model's constants."""

    name: str
    recipe: str
    sizes: dict
    quick: dict
    baseline: dict
    held_out: bool
    about: str

    def describe(self, quick: bool = False) -> dict:
        return {"name": self.name, "recipe": self.recipe, "held_out": self.held_out, "about": self.about,
                "sizes": self.quick if quick else self.sizes}


MODELS = [
    Model("gpt-8x512", "gpt_debug", MEMORY_MODEL, QUICK_MEMORY_MODEL, BASELINE_MODEL, held_out=False,
          about="the calibration model: a GPT 8 layers deep and 512 wide, the model the CPU cost model's constants "
                "were set on (the planner's calibration step times a 2-layer GPT of the same width)"),
    Model("gpt-16x256", "gpt_debug",
          dict(num_layers=16, hidden_size=256, num_attention_heads=4, vocab_size=8192, max_position_embeddings=64),
          dict(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=2048, max_position_embeddings=64),
          BASELINE_MODEL, held_out=True,
          about="a deep, narrow GPT: twice the calibration model's layers at half its width (small matrices, "
                "many ops per step)"),
    Model("gpt-4x1024", "gpt_debug",
          dict(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=8192, max_position_embeddings=64),
          dict(num_layers=4, hidden_size=384, num_attention_heads=6, vocab_size=2048, max_position_embeddings=64),
          BASELINE_MODEL, held_out=True,
          about="a wide, shallow GPT: half the calibration model's layers at twice its width (large matrices, few "
                "ops per step)"),
    Model("llama-8x512", "llama_debug",
          dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, ffn_hidden_size=1408,
               vocab_size=8192, max_position_embeddings=64),
          dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=352,
               vocab_size=2048, max_position_embeddings=64),
          LLAMA_BASELINE, held_out=True,
          about="another family: a LLaMA (RMSNorm, SwiGLU, rotary positions, grouped-query attention with 2 query "
                "heads per key-value head, separate embedding and output head) 8 layers deep and 512 wide"),
]
BY_NAME = {m.name: m for m in MODELS}
CALIBRATION = MODELS[0]
HELD_OUT = "held-out"  # on the command line: every held-out model


def select(names: list[str]) -> list[Model]:
    """The models ``names`` give (comma-separated items too; ``held-out``: every held-out model), each once, in
    the order given; ValueError naming the choices for an unknown name."""
    chosen: list[Model] = []
    for item in (n.strip() for text in names for n in text.split(",")):
        if not item:
            continue
        if item == HELD_OUT:
            found = [m for m in MODELS if m.held_out]
        elif item in BY_NAME:
            found = [BY_NAME[item]]
        else:
            raise ValueError(f"unknown model {item!r}; choose from {', '.join([*BY_NAME, HELD_OUT])}")
        chosen += [m for m in found if m not in chosen]
    return chosen
