"""``dufu train`` (one process, or a torchrun worker) with the fp16 loss scaler's settings taken from
``$DUFU_TEST_LOSS_SCALER`` (``init_scale=256,growth_interval=2``): dufu fixes them (growth every 2000 steps),
and a test needs to see the scale grow within a few steps."""

import os
import sys

from dufu.cli import main
from dufu.engine.loss_scaler import DynamicLossScaler

_settings = {k: float(v) if k.endswith("scale") else int(v)
             for k, v in (item.split("=") for item in os.environ["DUFU_TEST_LOSS_SCALER"].split(","))}
_original_init = DynamicLossScaler.__init__


def _init(self, *args, **kwargs):
    _original_init(self, *args, **{**kwargs, **_settings})


DynamicLossScaler.__init__ = _init
sys.exit(main(sys.argv[1:]))
