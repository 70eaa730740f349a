"""Optimizers dufu adds to torch's: Muon for the hidden layers' matrices, with AdamW for the other parameters."""

from dufu.optim.muon import Muon, muon_param_groups, zeropower_via_newtonschulz

__all__ = ["Muon", "muon_param_groups", "zeropower_via_newtonschulz"]
