"""Knowledge distillation (dufu.engine.distill): the soft loss is the KL it claims to be, the hard part is the
model's own loss, and a distilled run gives one process's losses in other layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dufu.engine.distill import Distillation, kd_loss
from dufu.errors import ConfigError
from dufu_testing import FAST, load_config, train, train_config, train_losses

STUDENT = str(Path(__file__).with_name("gpt_distill_debug.py"))


def test_kd_loss_is_the_softened_kl_over_targets():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    target = torch.randint(0, 11, (2, 5))
    target[0, 1] = target[1, 4] = -100
    T = 3.0
    keep = target != -100
    expected = F.kl_div(F.log_softmax(s[keep] / T, -1), F.log_softmax(t[keep] / T, -1), log_target=True,
                        reduction="batchmean") * T**2
    assert kd_loss(s, t, target, T).item() == pytest.approx(expected.item(), rel=1e-6)
    assert kd_loss(t, t, target, T).item() == pytest.approx(0.0, abs=1e-6)


def test_distillation_checks_its_settings(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Distillation(teacher=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="positive temperature"):
        Distillation(teacher=str(tmp_path), temperature=0)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        Distillation(teacher=str(tmp_path), kd_weight=1.5)


def _student(debug_run, tmp_path, name, *overrides, nproc=1):
    return train(tmp_path / name, [f"distill.teacher={debug_run.output_dir}", "train.train_iter=3",
                                   "train.log_period=1", "train.global_batch_size=8", *overrides],
                 recipe=STUDENT) if nproc == 1 else None


def test_the_hard_part_is_the_models_loss_and_a_perfect_student_has_no_soft_loss(debug_run, tmp_path):
    """kd_weight=0: the losses of the same student without a teacher. kd_weight=1 with the teacher itself as the
    student (its architecture and weights): the KL of two equal distributions, 0, at the first step."""
    hard_only = _student(debug_run, tmp_path, "hard", "distill.kd_weight=0.0")
    cfg = load_config(STUDENT, [*FAST, "train.train_iter=3", "train.log_period=1", "train.global_batch_size=8"])
    del cfg["distill"]
    plain = train_config(cfg, tmp_path / "plain")
    assert hard_only.losses == pytest.approx(plain.losses, abs=1e-6)
    same = _student(debug_run, tmp_path, "same", "distill.kd_weight=1.0", "model.hidden_size=64",
                    "model.num_layers=2", "model.num_attention_heads=4", f"model.pretrained={debug_run.output_dir}")
    assert same.losses[1] == pytest.approx(0.0, abs=1e-5)
    mixed = _student(debug_run, tmp_path, "mixed")
    assert 0 < mixed.losses[1] < plain.losses[1]  # half of a cross entropy plus a (smaller) KL


LAYOUTS = {
    "tp2-sp": ("train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"),
    "dp2-zero3": ("train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
                  "train.zero_optimization.stage=3"),
    "pp2": ("train.dist.pipeline_parallel_size=2", "model.num_layers=2", "train.train_micro_batch_size=2"),
}


@pytest.fixture(scope="module")
def two_process_runs(debug_run, shared_runs):
    """Each layout's 2-process run, all in one launch (tests/parity.py's SharedRuns)."""
    from parity import Spec

    args = (f"distill.teacher={debug_run.output_dir}", "train.train_iter=3", "train.log_period=1",
            "train.global_batch_size=8")
    return shared_runs({name: Spec(2, (*args, *layout), config=STUDENT, base=()) for name, layout in LAYOUTS.items()},
                       uses={"test_distillation_in_two_processes_equals_one": lambda p: p["name"]})


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_distillation_in_two_processes_equals_one(debug_run, tmp_path, name, two_process_runs):
    """Under pipelining the teacher runs its own forward-only schedule and its logits reach the student's last
    stage inside the target (4 micro-batches of 2 here)."""
    layout = LAYOUTS[name]
    same_model = [o for o in layout if o.startswith(("model.", "train.train_micro"))]
    one = _student(debug_run, tmp_path, "one", *same_model)
    out = two_process_runs.output_dir(name)
    assert train_losses(out) == pytest.approx(one.losses, abs=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused_at_start_up(debug_run, tmp_path):
    from dufu.engine.preflight import plan_run

    cfg = load_config(STUDENT, [f"distill.teacher={debug_run.output_dir}", "model.vocab_size=512",
                                f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="vocabulary of 384 tokens, the student 512"):
        plan_run(cfg, world_size=1)
