"""`dufu plan` on the command line: the table, JSON, the plot, and errors that say what is wrong and how to fix it."""

from __future__ import annotations

import json

import pytest

from plan_testing import GPT30M
from dufu.cli import main

AUTO = ["train.dist.data_parallel_size=auto", "train.dist.tensor_parallel_size=auto",
        "train.dist.pipeline_parallel_size=auto", "train.train_micro_batch_size=auto", "train.global_batch_size=16"]


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_layout_breakdown(capsys):
    code, out, _ = plan(capsys, "gpt_debug", *GPT30M, "--gpus", "8", "--gpu", "a100-80gb",
                        "train.dist.data_parallel_size=4", "train.dist.tensor_parallel_size=2")
    assert code == 0
    for words in ("dp 4 x tp 2 x pp 1", "parameters", "optimizer states", "activations", "per optimizer step",
                  "tensor-parallel communication", "data-parallel communication", "fits"):
        assert words in out


def test_gpus_alone_trains_data_parallel(capsys):
    """A recipe that sets no layout is planned data parallel over every device, as `dufu train --nproc N` runs it."""
    code, out, err = plan(capsys, "gpt_debug", *GPT30M, "--gpus", "8", "--gpu", "h100-80gb", "--json")
    assert code == 0, err
    best = json.loads(out)["layouts"][0]
    assert (best["data_parallel_size"], best["tensor_parallel_size"], best["pipeline_parallel_size"]) == (8, 1, 1)
    assert "--nproc 1" not in out + err


def test_json_search_and_plot(capsys, tmp_path):
    png = tmp_path / "memory.png"
    code, out, err = plan(capsys, "gpt_debug", *GPT30M, *AUTO, "--gpus", "4", "--gpu", "h100-80gb", "--json",
                          "--plot", str(png))
    assert code == 0 and png.stat().st_size > 1000 and "wrote" in err
    data = json.loads(out)
    assert data["best"] == data["layouts"][0] and data["best"]["fits"]
    for key in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "micro_batch_size",
                "zero_stage", "activation_checkpoint", "step_time_s", "memory_per_gpu_bytes", "fits"):
        assert key in data["best"]
    degrees = {(e["data_parallel_size"], e["tensor_parallel_size"], e["pipeline_parallel_size"])
               for e in data["layouts"]}
    assert {(4, 1, 1), (1, 4, 1), (2, 2, 1)} <= degrees
    steps = [e["step_time_s"] * 16 / e["global_batch_size"] for e in data["layouts"] if e["fits"]]
    assert steps[0] == min(steps)  # ranked by throughput (every layout trains the same global batch here)


def test_without_auto_the_first_layout_is_the_configs(capsys):
    code, out, _ = plan(capsys, "gpt_debug", *GPT30M, "--gpus", "4", "--gpu", "a100-40gb", "--json",
                        "train.dist.pipeline_parallel_size=2", "train.dist.data_parallel_size=2",
                        "train.num_accumulation_steps=2")
    layouts = json.loads(out)["layouts"]
    assert code == 0 and len(layouts) == 1
    assert (layouts[0]["data_parallel_size"], layouts[0]["pipeline_parallel_size"]) == (2, 2)
    assert layouts[0]["micro_batch_size"] == 4 and layouts[0]["num_accumulation_steps"] == 2


def test_table_says_why_the_others_lost(capsys):
    code, out, _ = plan(capsys, "gpt_debug", *GPT30M, *AUTO, "--gpus", "4", "--gpu", "a100-80gb")
    assert code == 0 and "best" in out and "slower: " in out and "refuse at start-up" in out


def test_unknown_gpu_lists_the_known_ones(capsys):
    code, _, err = plan(capsys, "gpt_debug", "--gpu", "a100-90gb", "--gpus", "2")
    assert code == 2
    for name in ("unknown --gpu 'a100-90gb'", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu",
                 "--hardware-file"):
        assert name in err


def test_impossible_degrees_show_the_arithmetic(capsys):
    code, _, err = plan(capsys, "gpt_debug", "--gpu", "a100-80gb", "--gpus", "4", "train.dist.tensor_parallel_size=2",
                        "train.dist.pipeline_parallel_size=2", "train.dist.data_parallel_size=2")
    assert code == 2 and "dp 2 x tp 2 x pp 2 = 8" in err and "4" in err
    code, _, err = plan(capsys, "gpt_debug", "--gpu", "a100-80gb", "--gpus", "3", "train.dist.tensor_parallel_size=3",
                        "train.dist.data_parallel_size=1")
    assert code == 2 and "not whole" in err


def test_a_model_that_fits_nowhere_says_by_how_much(capsys):
    big = ["model.num_layers=48", "model.hidden_size=8192", "model.num_attention_heads=64", "model.vocab_size=51200",
           "model.max_position_embeddings=2048", "dataloader.train.seq_length=2048"]
    code, out, err = plan(capsys, "gpt2_small", *big, "--gpus", "2", "--gpu", "a100-40gb",
                          "train.dist.tensor_parallel_size=auto", "train.dist.data_parallel_size=auto",
                          "train.zero_optimization.stage=auto")
    assert code == 2 and "no layout fits" in err and "GiB more than" in err and "does not fit" in out


def test_micro_batch_auto_needs_a_global_batch(capsys):
    code, _, err = plan(capsys, "gpt_debug", "--gpu", "a100-80gb", "train.train_micro_batch_size=auto")
    assert code == 2 and "train.global_batch_size" in err


def test_a_user_device_from_a_yaml_file(capsys, tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("my-gpu:\n  bf16_tflops: 100\n  fp32_tflops: 10\n  memory_gb: 24\n  memory_bandwidth_gbs: 1000\n"
                    "  intra_node_bandwidth_gbs: 50\n  inter_node_bandwidth_gbs: 10\n  devices_per_node: 4\n")
    code, out, _ = plan(capsys, "gpt_debug", "--gpus", "2", "--gpu", "my-gpu", "--hardware-file", str(path), "--json",
                        "train.dist.data_parallel_size=2")
    best = json.loads(out)["best"]
    assert code == 0 and best["hardware"] == "my-gpu" and best["memory_limit_bytes"] == 24e9 - 3e9


@pytest.mark.parametrize("key, back", [("train.dist.data_parallel_size", "2"), ("train.dist.sequence_parallel", "True"),
                                       ("train.activation_checkpoint.enabled", "False"),
                                       ("train.zero_optimization.stage", "3"), ("train.train_micro_batch_size", "8")])
def test_auto_is_accepted_as_an_override_value(key, back):
    from dufu.config import LazyConfig, resolve_config_path

    def value(cfg):
        node = cfg
        for part in key.split("."):
            node = node[part]
        return node

    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(resolve_config_path("gpt_debug"))), [f"{key}=auto"])
    assert value(cfg) == "auto"
    LazyConfig.apply_overrides(cfg, [f"{key}={back}"])  # and back to a value of the key's own type
    assert str(value(cfg)) == back


def test_train_dist_auto_needs_no_plus():
    from dufu.config import LazyConfig, resolve_config_path

    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(resolve_config_path("gpt_debug"))), ["train.dist.auto=True"])
    assert cfg.train.dist.auto is True
