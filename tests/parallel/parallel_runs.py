"""Older name of the parity helpers (tests/parity.py), kept for the modules that still import it."""

from parity import PARITY_ARGS, assert_matches_reference, final_model_state, losses  # noqa: F401
from launch import assert_ok  # noqa: F401
