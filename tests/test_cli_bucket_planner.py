"""`jabasray train --bucket-planner size|libra` reaches DriverOptions (no Ray: the trainer is
replaced by a recorder); a bad value is a one-line error with exit code 2."""
from __future__ import annotations

import pytest

from jabasray.cli import main


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, want", [([], "size"), (["--bucket-planner", "libra"], "libra"),
                                        (["--bucket-planner", "size"], "size")])
def test_bucket_planner_reaches_the_driver_options(argv, want, tmp_path, monkeypatch):
    import jabasray.actors.trainer as trainer

    seen = {}

    class Recorder:
        def __init__(self, *args, options=None, **kw):
            seen["options"] = options
            raise _Stop

    monkeypatch.setattr(trainer, "JabasTrainer", Recorder)
    monkeypatch.setattr(trainer, "ensure_ray", lambda *a, **kw: False)
    with pytest.raises(_Stop):
        main(["train", "--storage-path", str(tmp_path), "--no-progress", *argv])
    assert seen["options"].bucket_planner == want


def test_bad_bucket_planner_is_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--storage-path", str(tmp_path), "--bucket-planner", "fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--bucket-planner: invalid choice: 'fast'" in err and "'size', 'libra'" in err
