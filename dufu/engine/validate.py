"""Start-up checks of the config, run before any work and before anything is written."""

from __future__ import annotations

from dufu.engine.precision import check_setting
from dufu.engine.schema import validate_train
from dufu.parallel.activation_checkpoint import check_mode
from dufu.parallel.compile import check_compile_setting
from dufu.errors import ConfigError

NAMESPACES = ("model", "train", "optim", "dataloader", "tokenization")


def _positive_int(value, key: str, allow_none: bool = False, allow_zero: bool = False):
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (value > 0 or (allow_zero and value == 0))
    if not ok:
        raise ConfigError(
            f"{key} = {value!r} must be a {'non-negative' if allow_zero else 'positive'} integer"
            f"{' or None' if allow_none else ''}; set it with {key}=N."
        )


def validate_config(cfg) -> None:
    """Check the config once, at start-up: the train schema (keys and types, defaults filled in:
    :func:`dufu.engine.schema.validate_train`), then the ranges and the words other modules own."""
    missing = [ns for ns in NAMESPACES if ns not in cfg]
    if missing:
        raise ConfigError(
            f"the config lacks the namespace(s) {', '.join(missing)}; a dufu config defines "
            f"{', '.join(NAMESPACES)} (as LiBai's do). Import them from a packaged recipe, e.g. "
            "`from dufu.config import get_config; train = get_config('common/train.py').train`."
        )
    validate_train(cfg)  # every train key present, of its schema's type (dufu.engine.schema)
    t = cfg.train
    _positive_int(t.train_iter, "train.train_iter")
    _positive_int(t.train_micro_batch_size, "train.train_micro_batch_size")
    _positive_int(t.global_batch_size, "train.global_batch_size", allow_none=True)
    _positive_int(t.num_accumulation_steps, "train.num_accumulation_steps", allow_none=True)
    _positive_int(t.log_period, "train.log_period")
    _positive_int(t.gc_period, "train.gc_period", allow_zero=True)
    _positive_int(t.checkpointer.period, "train.checkpointer.period", allow_zero=True)
    _positive_int(t.evaluation.eval_period, "train.evaluation.eval_period")
    _positive_int(t.stop_at_iter, "train.stop_at_iter", allow_none=True)
    minutes = t.stop_after_minutes
    if minutes is not None and minutes <= 0:
        raise ConfigError(f"train.stop_after_minutes = {minutes!r} must be a positive number of minutes or None.")
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(
            f"train.nan_policy = {t.nan_policy!r} is not known; use \"stop\" (stop and name the tensor) or "
            "\"skip\" (skip the update and count it)."
        )
    try:
        check_setting(t.amp.enabled, t.amp.dtype)
        check_mode(t.activation_checkpoint.mode)
        check_compile_setting(t.compile.enabled)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.zero_optimization.stage not in (1, 2, 3):
        raise ConfigError(
            f"train.zero_optimization.stage = {t.zero_optimization.stage!r}: ZeRO stages are 1 (optimizer state), "
            "2 (+ gradients) and 3 (+ parameters). Set train.zero_optimization.stage=1, 2 or 3."
        )
    if not t.output_dir:
        raise ConfigError("train.output_dir must be a non-empty path string, e.g. train.output_dir=output/my_run.")


def resolve_batch_sizes(micro: int, global_: int | None, accum: int | None, data_parallel_size: int) -> tuple[int, int, int]:
    """Megatron/LiBai batch arithmetic: global = micro x data_parallel_size x accumulation.

    Any two determine the third (with only ``micro`` given, accumulation is 1).
    Returns (micro, global, accumulation).
    """
    per_step = micro * data_parallel_size
    if global_ is None and accum is None:
        accum = 1
    if global_ is None:
        global_ = per_step * accum
    elif accum is None:
        if global_ % per_step != 0:
            raise ConfigError(
                f"train.global_batch_size {global_} is not divisible by train_micro_batch_size {micro} x "
                f"data_parallel_size {data_parallel_size} = {per_step}, so no whole number of accumulation steps "
                f"gives it. Use a global batch that is a multiple of {per_step} "
                f"(e.g. {max(per_step, global_ // per_step * per_step)}), or change the micro batch size."
            )
        accum = global_ // per_step
    if global_ != per_step * accum:
        raise ConfigError(
            f"inconsistent batch sizes: train_micro_batch_size {micro} x data_parallel_size {data_parallel_size} x "
            f"num_accumulation_steps {accum} = {per_step * accum}, but global_batch_size is {global_}. "
            "Set any two of them and leave the third as None (it is then derived)."
        )
    return micro, global_, accum
