"""Training through failures: preemption (SIGTERM/SIGUSR1 save and exit), elastic restarts, torchft replica groups
(a hook of the training loop), and the test faults that prove them (``DUFU_FAULT``)."""
