"""`dufu <command> ...`: the usage text, the table of subcommands and ``main``, which runs one and presents its
errors (an optional package that is not installed among them: the one line that says what to install). Each
subcommand parses its own arguments in a module of this package (dufu.cli.train, dufu.cli.eval, ...)."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import textwrap
import traceback

import dufu
from dufu.errors import DistributedFailure, DufuError

USAGE = """dufu <command> [...]    (dufu --version: the versions of dufu, torch and Python)

commands:
  train [CONFIG] [--resume | --resume-step N | --resume-from CKPT_DIR] [--override-saved KEY]
        [--nproc N] [--show-config] [key=value ...]
                      train; CONFIG is a .py/.yaml file or a packaged recipe name (default: "default");
                      --nproc N starts N processes through torchrun (multi-node: --nnodes, --node-rank,
                      --master-addr, --master-port)
  slurm [CONFIG] [key=value ...] --nodes N --gpus-per-node G [--partition P] [--time T] [--account A]
        [--output-dir D] [--submit]
                      write (and submit) an sbatch script that trains under srun, saves and requeues itself
                      before the time limit and resumes (docs/cluster.md); `srun dufu train ...` reads Slurm's
                      rendezvous by itself
  plan [CONFIG] [key=value ...] --gpus N --gpu NAME [--gpus-per-node 8] [--json] [--plot FILE.png]
                      predict per-device peak memory and step time of the config's layout; with `auto` values
                      (e.g. train.dist.tensor_parallel_size=auto), rank the layouts that fit (dufu plan -h)
  eval SOURCE [--nproc N] [--whole-split | --data FILE] [--json] [key=value ...]
                      validation loss, perplexity and accuracy of a run/checkpoint or a Hugging Face directory,
                      in any layout (dufu eval -h)
  generate SOURCE --prompt TEXT [--prompt ...] [--num-beams K] [--stop S] [--max-memory SIZE]
                      generate text (several prompts, sampling or beams, stop strings, T5) from a run/checkpoint,
                      a Hugging Face directory or a quantized directory (dufu generate -h)
  prune SOURCE OUTPUT_DIR --heads-keep F --ffn-keep F [--importance magnitude|first-order]
                      structured pruning of attention heads and FFN neurons: a smaller model of the same family
                      (docs/pruning.md)
  quantize SOURCE --scheme int8-weight|int8-dynamic|int4-weight --output DIR
                      post-training quantization on torchao (docs/quantization.md)
  configs [WORD ...]  list the packaged recipes (those whose name or description holds every WORD)
  convert CKPT (--to-hf DIR | --to-torch FILE.pt)
                      a sharded checkpoint (or a run's output_dir) as a Hugging Face directory or one file
  preprocess ...      tokenize text/jsonl into a memory-mapped token file (dufu preprocess -h)
  lighthouse [--bind [::]:29510] [--min-replicas N] [--join-timeout S]
                      the coordinator of fault-tolerant replica groups, train.fault_tolerance (docs/faults.md)
  diagnose OUTPUT_DIR
                      which rank did not join which collective, from a hung run's flight-recorder dumps
                      (docs/faults.md)
"""


def _print_error(err: BaseException) -> None:
    msg = " ".join(str(err).split())
    if isinstance(err, MissingPackage):  # one line: what is missing and the command that installs it
        print(f"error: {msg}", file=sys.stderr)
        return
    print("\n".join(textwrap.wrap(f"error: {msg}", width=100, break_long_words=False, break_on_hyphens=False)),
          file=sys.stderr)


# Optional packages (pyproject.toml's [project.optional-dependencies]): package -> the extra that installs it alone,
# or None where no extra does (torchao is only in the `test` and `bench` extras, which bring much more).
OPTIONAL_PACKAGES = {"torchao": "quant", "torchft": "ft", "datasets": "hf"}


def install_command(package: str) -> str:
    """The pip command that installs an optional ``package`` beside the installed torch (pinned, so that pip does
    not replace it): ``pip install "dufu[ft]" torch==2.13.0``."""
    try:
        torch = "torch==" + importlib.metadata.version("torch").split("+")[0]  # 2.13.0+cpu: the same release
    except importlib.metadata.PackageNotFoundError:
        torch = "torch"
    extra = OPTIONAL_PACKAGES[package]
    return f'pip install "dufu[{extra}]" {torch}' if extra else f"pip install {package} {torch}"


class MissingPackage(DufuError):
    """An optional package that a command needs is not installed (printed as one line, exit code 2)."""

    def __init__(self, package: str, command: str):
        super().__init__(f"dufu {command} needs {package}, which is not installed: {install_command(package)}")
        self.package = package


def require_package(package: str, command: str) -> None:
    """Refuse, before any work, a command whose optional ``package`` (a key of OPTIONAL_PACKAGES) is missing."""
    if importlib.util.find_spec(package) is None:
        raise MissingPackage(package, command)


def missing_package(err: ModuleNotFoundError, command: str) -> DufuError | None:
    """The error to print for an import of an optional package that failed, or None for any other module (a
    missing module of dufu's own dependencies is a broken install, and its traceback is the report)."""
    package = (err.name or "").split(".")[0]
    if package not in OPTIONAL_PACKAGES:
        return None
    if importlib.util.find_spec(package) is None:
        return MissingPackage(package, command)
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "of an unknown version"
    return DufuError(f"dufu {command} needs {err.name}, which the installed {package} {version} lacks; upgrade "
                     f"it: {install_command(package)} --upgrade")


def version_text() -> str:
    """``dufu --version``: dufu's version, and torch's and Python's (from package metadata: torch is not imported)."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return f"dufu {dufu.__version__} (torch {torch}, Python {platform.python_version()})"


# command -> the module whose ``main(argv)`` runs it, imported when that command runs: several import torch at
# their top (2-3 s), which `dufu --help` and every other command do without.
COMMANDS = {"train": "dufu.cli.train", "eval": "dufu.cli.eval", "configs": "dufu.cli.configs",
            "preprocess": "dufu.data.preprocess", "convert": "dufu.cli.convert", "generate": "dufu.cli.generate",
            "plan": "dufu.cli.plan", "prune": "dufu.cli.prune", "quantize": "dufu.cli.quantize",
            "lighthouse": "dufu.cli.lighthouse", "diagnose": "dufu.cli.diagnose",
            "slurm": "dufu.cli.slurm"}


# Set when a command ended because a collective with the other ranks failed (another rank died or hung): this
# rank's exit is a consequence, and dufu/__main__ lets the failed rank's exit be seen first.
peer_failed = False


def run(argv: list[str] | None = None) -> int:
    """:func:`main` as ``python -m dufu`` runs it: the exit code of however it ends (``SystemExit``'s code, its
    message printed; 130 for Ctrl-C; 1 for an uncaught exception, its traceback printed as Python would)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:
        code = 130  # the shell's code for an interrupted command
    except BaseException:  # noqa: BLE001 - printed as Python would; the caller decides how the process ends
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    return code


def command() -> None:
    """The ``dufu`` console script, and ``python -m dufu``: :func:`run`, then an exit that never lets the interpreter
    tear down a live gloo process group (that can abort a rank after its work is done; ``srun dufu train`` runs the
    workers through this script)."""
    code = run()
    if "torch.distributed" in sys.modules:  # only a process that may have a process group pays for the import
        from dufu.parallel.launch import exit_process

        # A rank that stops because a peer failed leaves a moment later: torchrun's agent (polling every 0.1 s)
        # names the failure it sees first, which must be the peer's (e.g. "killed by SIGKILL"), not this consequence.
        exit_process(code, linger_seconds=1.0 if peer_failed else 0.0)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_text())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        _print_error(DufuError(
            f"unknown command '{command}'{f'; did you mean {close[0]!r}?' if close else '.'} "
            f"Commands: {', '.join(COMMANDS)}."
        ))
        return 2
    try:
        return importlib.import_module(COMMANDS[command]).main(rest) or 0
    except DufuError as err:
        # In a multi-process job, one copy of a config error; but every rank's own view of a failure.
        if os.environ.get("RANK", "0") == "0" or isinstance(err, DistributedFailure):
            _print_error(err)
        global peer_failed
        peer_failed = isinstance(err, DistributedFailure)
        return 2
    except ModuleNotFoundError as err:  # an optional package imported where the work needs it (torchao, torchft, ...)
        error = missing_package(err, command)
        if error is None:
            raise
        if os.environ.get("RANK", "0") == "0":
            _print_error(error)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dufu configs | head`: the reader has gone; the output left over goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command the pipe ended
