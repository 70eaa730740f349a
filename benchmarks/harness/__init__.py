"""What every benchmark shares, one module per job:

* :mod:`harness.machine` -- the machine and code a result was measured on (CPU model from ``/proc/cpuinfo``, cores,
  memory, versions, the dufu commit, and the fp32 and bf16 matmul peaks measured the way dufu measures them);
* :mod:`harness.proc` -- ``/proc`` readers: resident memory and its high-water mark, the machine's busy time;
* :mod:`harness.launch` -- starting training jobs (``dufu train``, torchrun workers) and reading what they logged;
* :mod:`harness.hooks` -- hook objects a benchmark attaches to the Trainer (``train.hooks`` or ``Trainer(hooks=)``);
* :mod:`harness.memory` -- a job's per-rank peak memory by phase (build, train, checkpoint), measured by a hook;
* :mod:`harness.profile` -- a profiled step split by kind of op;
* :mod:`harness.results` -- dated ``.json`` and ``.md`` files in ``benchmarks/results`` with the machine inside.

Scripts import it as ``harness`` (``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``); workers
started by :mod:`harness.launch` get ``benchmarks/`` on ``PYTHONPATH``, so ``train.hooks`` can name its hooks.
Importing the package imports nothing else.
"""
