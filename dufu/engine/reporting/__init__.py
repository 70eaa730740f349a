"""What people read of a run: the start-up summary, progress bar, metrics records (JSON lines, TensorBoard), loss
plots, the end summary, and the FLOP counts MFU is computed from."""
