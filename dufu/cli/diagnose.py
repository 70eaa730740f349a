"""`dufu diagnose OUTPUT_DIR`: the command line of :func:`dufu.engine.diagnose.explain_flight_recorder`, which reads a
run's flight-recorder dumps (written by NCCL when a collective timed out) and says which rank did not join which
collective."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu diagnose",
        description="Which rank did not join which collective, from the flight-recorder dumps of a hung run "
        "(docs/faults.md#hangs-timeouts-and-the-flight-recorder).")
    parser.add_argument("path", help="a run's output_dir, or a directory of dumps (OUTPUT_DIR/flight_recorder)")
    args = parser.parse_args(argv)
    from dufu.engine.diagnose import explain_flight_recorder  # imports torch: not for --help

    print(explain_flight_recorder(args.path))
    return 0
