"""FSDP2's mixed-precision policy under data parallelism and ZeRO (dufu.parallel.data_parallel), on one process:
which dtypes each ``train.amp.param_dtype`` / ``reduce_dtype`` gives for each compute dtype, and the settings
refused at start-up. The runs that use the policy are tests/parallel/test_loss_parity.py's bf16 and fp16 layouts
(parity with one process, the dtypes seen while training)."""

from __future__ import annotations

import pytest
import torch

from dufu.config.overrides import apply_overrides
from dufu.errors import ConfigError
from dufu.parallel.data_parallel import mixed_precision_policy
from dufu_testing import load_config

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("compute, param, reduce, expected", [
    # (compute dtype, train.amp.param_dtype, train.amp.reduce_dtype) -> (gather dtype, reduce dtype); None: no policy
    (None, "auto", "fp32", None),  # an fp32 run: FSDP's defaults
    (None, "fp32", "fp32", None),
    (BF16, "auto", "fp32", (BF16, FP32)),  # the default of a bf16 run: gather bf16, reduce fp32
    (FP16, "auto", "fp32", (FP16, FP32)),
    (BF16, "bf16", "fp32", (BF16, FP32)),
    (BF16, "fp32", "fp32", None),  # as before the policy: autocast casts in every forward
    (BF16, "auto", "bf16", (BF16, BF16)),  # torchtitan's cheapest: reduce in the compute dtype too
    (BF16, "fp32", "bf16", (None, BF16)),  # fp32 gathers, bf16 reduction
])
def test_policy_for_each_setting(compute, param, reduce, expected):
    policy = mixed_precision_policy(compute, param, reduce)
    if expected is None:
        assert policy is None
        return
    assert (policy.param_dtype, policy.reduce_dtype) == expected
    assert policy.cast_forward_inputs and policy.output_dtype is None  # FSDP's defaults


@pytest.mark.parametrize("compute, param, reduce, message", [
    (BF16, "fp16", "fp32", r"train.amp.param_dtype = 'fp16', but the run computes in bf16.*param_dtype=auto"),
    (None, "bf16", "fp32", r"train.amp.param_dtype = 'bf16', but the run computes in fp32.*enabled=bf16"),
    (BF16, "auto", "fp16", r"train.amp.reduce_dtype = 'fp16', but the run computes in bf16.*reduce_dtype=fp32"),
    (None, "auto", "bf16", r"train.amp.reduce_dtype = 'bf16', but the run computes in fp32"),
    (BF16, "float32", "fp32", r"train.amp.param_dtype = 'float32' is not a dtype name.*'auto', 'fp32'"),
    (BF16, "auto", "auto", r"train.amp.reduce_dtype = 'auto' is not a dtype name.*'fp32'"),
])
def test_settings_the_policy_refuses(compute, param, reduce, message):
    with pytest.raises(ValueError, match=message):
        mixed_precision_policy(compute, param, reduce)


def test_the_schema_refuses_other_words_and_takes_the_dtype_names():
    cfg = load_config("gpt_debug")
    apply_overrides(cfg, ["train.amp.param_dtype=BF16", "train.amp.reduce_dtype=fp32"])
    assert (cfg.train.amp.param_dtype, cfg.train.amp.reduce_dtype) == ("bf16", "fp32")
    assert load_config("gpt_debug").train.amp.param_dtype == "auto"
    with pytest.raises(ConfigError, match=r"train.amp.param_dtype.*'auto' or 'fp32' or 'bf16' or 'fp16'"):
        apply_overrides(load_config("gpt_debug"), ["train.amp.param_dtype=int8"])
    with pytest.raises(ConfigError, match=r"train.amp.reduce_dtype.*'fp32' or 'bf16' or 'fp16'"):
        apply_overrides(load_config("gpt_debug"), ["train.amp.reduce_dtype=auto"])
