"""A failing user hook raises an error that names the hook, chains the original exception and
keeps its traceback as text across pickling; a Module class passed where a callable belongs
(``loss_fn=nn.CrossEntropyLoss``) is refused at construction in one line. No Ray."""
from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actors_helpers import model_fn, optimizer_fn, tiny_data
from jabasray.actors.hooks import HookCall, JobHooks, probe_job, run_probe
from jabasray.errors import HookError


def _exploding_loss(outputs, targets):
    raise RuntimeError("boom in my loss")


class _Rows:
    """A map-style dataset that is not a TensorDataset (so batches go through collate_fn)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def _exploding_collate(rows):
    raise KeyError("label")


def _exploding_step(model, batch):
    return {"not": "a loss"}["loss"]


def _exploding_eval(model, batches):
    raise ZeroDivisionError("no samples")


def _exploding_model():
    raise RuntimeError("my model is broken")


def _exploding_optimizer(params):
    raise TypeError("lr missing")


@pytest.mark.parametrize("kw, hook, error, frame", [
    (dict(model_fn=_exploding_model), "model_fn", "RuntimeError: my model is broken", "_exploding_model"),
    (dict(optimizer_fn=_exploding_optimizer), "optimizer_fn", "TypeError: lr missing", "_exploding_optimizer"),
    (dict(loss_fn=_exploding_loss), "loss_fn", "RuntimeError: boom in my loss", "_exploding_loss"),
    (dict(hooks=JobHooks(collate_fn=_exploding_collate)), "collate_fn", "KeyError: 'label'", "_exploding_collate"),
    (dict(hooks=JobHooks(step_fn=_exploding_step)), "step_fn", "KeyError: 'loss'", "_exploding_step"),
    (dict(hooks=JobHooks(eval_fn=_exploding_eval), val=True), "eval_fn", "ZeroDivisionError: no samples",
     "_exploding_eval"),
])
def test_failing_hook_is_named_with_its_traceback(kw, hook, error, frame):
    ds, val = tiny_data(16)
    args = dict(model_fn=model_fn, optimizer_fn=optimizer_fn, loss_fn=F.cross_entropy, hooks=JobHooks(),
                dataset=_Rows(ds) if hook == "collate_fn" else ds,
                val_dataset=val if kw.pop("val", False) else None)
    args.update(kw)
    report = probe_job(**args)
    assert report.error == f"{hook} raised {error}"
    e = report.hook_error
    assert isinstance(e, HookError) and isinstance(e, ValueError) and e.hook == hook
    assert f"in {frame}" in e.traceback and e.traceback.strip().endswith(error.split(": ")[0] + (
        ": " + error.split(": ", 1)[1] if ": " in error else ""))
    assert type(e.__cause__).__name__ == error.split(":")[0]          # chained in this process
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)):
        back = loads(dumps(e))                                          # as Ray ships it
        assert (type(back), str(back), back.hook, back.traceback) == (HookError, str(e), hook, e.traceback)
    with pytest.raises(HookError, match=f"^{hook} raised ") as raised:     # run_probe raises it
        run_probe(args["model_fn"], args["optimizer_fn"], args["loss_fn"], args["hooks"], args["dataset"],
                  args["val_dataset"])
    assert raised.value.__cause__ is not None and "\n" not in str(raised.value)


def test_hook_call_passes_results_and_inner_hook_errors_through():
    call = HookCall("loss_fn", lambda a, b: a + b)
    assert call(2, 3) == 5
    inner = HookCall("collate_fn", _exploding_collate)
    outer = HookCall("step_fn", lambda rows: inner(rows))
    with pytest.raises(HookError) as info:
        outer([1])
    assert str(info.value) == "collate_fn raised KeyError: 'label'"
    loss = HookCall("loss_fn", nn.CrossEntropyLoss(label_smoothing=0.1))
    assert loss.label_smoothing == 0.1                                   # the module's attributes
    assert float(loss(torch.zeros(2, 3), torch.tensor([0, 1]))) > 0
    assert pickle.loads(cloudpickle.dumps(loss))(torch.zeros(2, 3), torch.tensor([0, 1])) == \
        loss(torch.zeros(2, 3), torch.tensor([0, 1]))


@pytest.mark.parametrize("name", ["loss_fn", "step_fn", "eval_fn", "collate_fn"])
def test_a_module_class_instead_of_an_instance_is_refused(name):
    from jabasray.actors.trainer import JabasTrainer

    ds, _ = tiny_data(600)
    with pytest.raises(ValueError) as e:
        JabasTrainer(model_fn, ds, **{name: nn.CrossEntropyLoss})
    assert str(e.value) == (f"{name} must be a callable such as a module instance, got the class "
                            f"torch.nn.modules.loss.CrossEntropyLoss; pass an instance: "
                            f"{name}=CrossEntropyLoss()")
    JabasTrainer(model_fn, ds, loss_fn=nn.CrossEntropyLoss())            # an instance is fine


def test_the_users_frames_alone_are_shown_under_the_one_line(tmp_path):
    """The error's note holds the frames of the user's files, in order, with their source
    lines, and none of jabasray's, torch's or the standard library's; it survives pickling."""
    from jabasray.errors import _library_dirs, user_frames
    from jabasray.actors.hooks import named

    lib = tmp_path / "site" / "lib.py"
    lib.parent.mkdir()
    lib.write_text("def call(fn):\n    return fn()\n")
    user = tmp_path / "job.py"
    user.write_text("def inner():\n    raise KeyError('x')\n\ndef step():\n    return inner()\n")
    import importlib.util
    mods = {}
    for name, path in (("site_lib", lib), ("user_job", user)):
        spec = importlib.util.spec_from_file_location(name, path)
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    call = named("step_fn", lambda: mods["site_lib"].call(mods["user_job"].step))
    with pytest.raises(HookError) as info:
        call()
    e = info.value
    frames = user_frames(e.traceback, library_dirs=_library_dirs() + (str(lib.parent) + "/",))
    shown = [line for line in frames.splitlines() if line.strip(" ^~")]   # 3.11's markers aside
    assert shown == [
        "your code, where it failed:",
        f'  File "{__file__}", line {call.fn.__code__.co_firstlineno}, in <lambda>',
        "    call = named(\"step_fn\", lambda: mods[\"site_lib\"].call(mods[\"user_job\"].step))",
        f'  File "{user}", line 5, in step',
        "    return inner()",
        f'  File "{user}", line 2, in inner',
        "    raise KeyError('x')",
    ]
    assert str(lib) not in frames and "hooks.py" not in frames
    assert e.__notes__ == [user_frames(e.traceback)] and f'"{user}", line 2, in inner' in e.__notes__[0]
    back = pickle.loads(cloudpickle.dumps(e))
    assert back.__notes__ == e.__notes__ and "\n" not in str(back)


class _LossObject:
    def __init__(self, smoothing):
        self.smoothing = smoothing

    def __call__(self, outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=self.smoothing)


@pytest.mark.parametrize("fn", [_exploding_loss, _LossObject(0.1), nn.CrossEntropyLoss()])
def test_a_named_hook_keeps_the_identity_and_profile_key_of_the_users_callable(fn):
    """The driver names every user callable; the run's identity and the profile cache key must
    not change with that (nor collide: two callable objects of one class differ by state)."""
    from jabasray.actors.job_identity import callable_identity
    from jabasray.profiler.measure import callable_fingerprint

    named_fn = HookCall("loss_fn", fn)
    assert callable_identity(named_fn) == callable_identity(fn)
    assert callable_fingerprint(named_fn) == callable_fingerprint(fn)
