"""`jabasray train --script` picks up the real-job hooks a script defines (no training)."""
from __future__ import annotations

import pytest

from jabasray.commands.train import load_script, script_hooks


def test_script_hooks_are_passed_through_and_dataset_fn_replaces_dataset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "def model_fn(): return torch.nn.Linear(4, 2)\n"
        "def dataset_fn(): return [(torch.zeros(4), 0)]\n"
        "def step_fn(model, batch): return model(batch[0]).sum()\n"
        "def eval_fn(model, batches): return {'n': 1.0}\n"
        "def lr_scheduler_fn(opt): return torch.optim.lr_scheduler.StepLR(opt, 1)\n"
        "lr_scheduler_interval = 'epoch'\n"
        "num_data_workers = 2\n")
    hooks = script_hooks(load_script(str(script)))
    assert sorted(hooks) == ["dataset_fn", "eval_fn", "lr_scheduler_fn", "lr_scheduler_interval",
                             "num_data_workers", "step_fn"]
    assert hooks["num_data_workers"] == 2 and hooks["lr_scheduler_interval"] == "epoch"
    bad = tmp_path / "bad.py"
    bad.write_text("def model_fn(): pass\n")
    with pytest.raises(ValueError, match=r"must define dataset\(\) or dataset_fn\(\)"):
        load_script(str(bad))
