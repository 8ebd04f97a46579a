"""A user's own model (issue 17 item 1): stages that hand on several tensors, modules split
by torch's `pipe_split()` or a `split_spec`, a loss of the model's own.

Oracles: `--check`'s one-process reference, a loss computed here by hand from the same
weights and batches, and the packed boundary's own round trip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional

from pipelang.backends.models import ModelSpec
from pipelang.backends.user_models import Boundary
from pipelang.cli import main
from tests.helpers import pipelang_cmd, read_checkpoint, run, stdlib

MODELS = """
import torch
from torch import nn
from torch.nn import functional
from torch.distributed.pipelining import SplitPoint, pipe_split


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)

    def forward(self, ids):
        return self.emb(ids), ids % 3 != 0  # hidden states and a mask


class Middle(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask):
        return {"x": torch.tanh(self.fc(x)) * mask.unsqueeze(-1), "mask": mask}


class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, x, mask):
        return self.fc(x) + mask.unsqueeze(-1)


def several():  # a tuple, then a dict: unpacked into arguments, as asked
    return {"model": [Masked(), Middle(), Last()], "unpack": True}


def several_whole():  # the same stages handed each value whole: Middle takes two
    return [Masked(), Middle(), Last()]


class DictEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)

    def forward(self, ids):
        return {"h": self.emb(ids), "mask": ids % 3 != 0}


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, state):
        return {"h": torch.tanh(self.fc(state["h"])) * state["mask"].unsqueeze(-1),
                "mask": state["mask"]}


class DictHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, state):
        return self.fc(state["h"])


def dict_stages():  # trains in one process as `x = stage(x)`
    return [DictEmbed(), DictBlock(), DictHead()]


def dict_stages_unpacked():
    return {"model": dict_stages(), "unpack": True}


class Split(nn.Module):
    def __init__(self, marked=True):
        super().__init__()
        self.marked = marked
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        mask = ids > 3
        for i, layer in enumerate(self.layers):
            if i == 1 and self.marked:
                pipe_split()
            x = torch.tanh(layer(x)) * mask.unsqueeze(-1) + x
        return self.head(x)


def marked():
    return Split()


def by_spec():
    return {"model": Split(marked=False), "split_spec": {"layers.1": SplitPoint.BEGINNING}}


def smoothed(output, targets):
    flat = output.reshape(-1, 64)
    return functional.cross_entropy(flat, targets.reshape(-1), label_smoothing=0.2)


def own_loss():
    return {"model": nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)), "loss": smoothed}


def hands_on_a_string():
    return [nn.Embedding(64, 16), Hands(), nn.Linear(16, 64)]


def ends_in_a_tuple():
    return [nn.Embedding(64, 16), Hands()]


class Hands(nn.Module):
    def forward(self, x):
        return x, "not a tensor"


def no_model():
    return {"loss": smoothed}


def odd_key():
    return {"model": nn.Sequential(nn.Embedding(64, 16)), "optimiser": "adam"}


def bad_spec():
    return {"model": Split(marked=False), "split_spec": {"layers.1": "beginning"}}


def tied_stages():  # the embedding is the head's weight: stage 0 and stage 2
    emb = nn.Embedding(64, 16)
    head = nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    return [emb, nn.Sequential(nn.Linear(16, 16), nn.Tanh()), head]


def tied_layers():  # split by pipelang; the Tanh-only stages hold no weights
    emb = nn.Embedding(64, 16)
    head = nn.Linear(16, 64, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), head)


class TiedSplit(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        pipe_split()
        return self.head(torch.tanh(x))


def tied_split():
    return TiedSplit()


def loss_not_callable():
    return {"model": nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)), "loss": 3}
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_boundary_packs_a_tree_of_tensors_into_one_and_back() -> None:
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    value = {"x": hidden, "extra": (mask, torch.arange(6).view(2, 3))}
    boundary = Boundary.of(value, "test")
    flat = boundary.pack(value)
    assert flat.shape == (24 + 6 + 6,) and flat.dtype == torch.float32  # ints: float32
    back = boundary.unpack(flat.detach().requires_grad_(True))
    assert isinstance(back, dict) and torch.equal(back["x"], hidden.detach())
    assert back["extra"][0].dtype == torch.bool and torch.equal(back["extra"][0], mask)
    assert torch.equal(back["extra"][1], torch.arange(6).view(2, 3))
    halves = Boundary.of((hidden.bfloat16(), hidden.bfloat16()), "test")
    assert halves.dtype == torch.bfloat16  # floats alone keep their dtype
    grad_in = torch.randn(2, 3, 4)
    out = boundary.unpack(boundary.pack(value))
    assert isinstance(out, dict)
    (out["x"] * grad_in).sum().backward()
    assert hidden.grad is not None and torch.equal(hidden.grad, grad_in)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("func", "ranks", "options"),
    [
        ("several", 3, ("--backend", "gloo")),  # a tuple, then a dict, with a bool mask
        ("several", 3, ("--backend", "local", "--graphs")),  # the stream executor
        ("several", 3, ("--mixed-precision", "bfloat16")),
        ("dict_stages", 3, ("--backend", "gloo")),  # a dict handed on whole
        ("marked", 2, ("--backend", "gloo")),  # pipe_split(): torch's pipeline() splits
        ("by_spec", 2, ("--backend", "gloo")),  # a split_spec
        ("own_loss", 2, ("--backend", "gloo")),
    ],
)
def test_a_user_model_trains_like_one_process(
    func: str,
    ranks: int,
    options: tuple[str, ...],
    models: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    program = stdlib("1f1b", D=ranks, N=4)
    assert run(program, "--model", f"models.py:{func}", "--check", *options) == 0
    assert "check OK" in capsys.readouterr().out


def test_the_models_own_loss_is_the_one_trained(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first step's loss equals label-smoothed cross-entropy computed here."""
    spec = ModelSpec("models.py:own_loss")
    model = spec.build()
    full = nn.Sequential(*model.layers)
    losses = []
    for mb in range(4):
        ids, targets = model.batch(0, mb, torch.device("cpu"))
        logits = full(ids).reshape(-1, 64)
        losses.append(functional.cross_entropy(logits, targets.reshape(-1), label_smoothing=0.2))
    expected = float(torch.stack(losses).mean().detach())
    assert run(stdlib("1f1b", D=2, N=4), "--model", "models.py:own_loss", "--steps", "1") == 0
    assert f"loss {expected:.4f}" in capsys.readouterr().err


@pytest.mark.slow  # each case loads the model in a child process first
@pytest.mark.parametrize(
    ("func", "ranks", "message"),
    [
        ("hands_on_a_string", 3, "layer 1 returns Tensor, str; a stage may hand the next only"),
        ("ends_in_a_tuple", 2, "the last layer returns tuple, not one tensor (the logits"),
        ("no_model", 2, "the dict `no_model()` returns needs a `model`"),
        ("odd_key", 2, "unknown: optimiser"),
        ("bad_spec", 2, "`split_spec` must map module names to"),
        ("loss_not_callable", 2, "its `loss` is not callable"),
        ("marked", 3, "gives 2 stages (a list of stage modules, or split at pipe_split()"),
        ("tied_split", 2, "its module ties weights (one parameter under several names)"),
        (
            "several_whole",
            3,
            "stage 1 (Middle) fails on what stage 0 returns (a tuple of 2): TypeError: ",
        ),
        ("several_whole", 3, 'return {"model": ..., "unpack": True}'),
        (
            "dict_stages_unpacked",
            3,
            "stage 1 (DictBlock) fails on what stage 0 returns (a dict of h, mask): "
            "TypeError: DictBlock.forward() got an unexpected keyword argument 'h'",
        ),
    ],
)
def test_a_user_model_that_cannot_run_says_why(
    func: str, ranks: int, message: str, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "1f1b", "-p", f"D={ranks}", "-p", "N=2", "--model", f"models.py:{func}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("error: ")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "ranks", "func", "options"),
    [
        ("1f1b", 3, "tied_stages", ()),
        ("zbv", 2, "tied_layers", ()),  # rank 0 holds both uses (stages 0 and 3)
        ("chimera", 4, "tied_layers", ("--clip-grad", "0.3")),  # replicas; counted once
        ("chimera", 4, "tied_layers", ("--backend", "local", "--graphs", "--clip-grad", "0.3")),
        ("chimera", 4, "tied_layers", ("--dp", "2")),
        ("chimera", 4, "tied_layers", ("--mixed-precision", "bfloat16")),
    ],
)
def test_tied_weights_train_like_one_shared_parameter(
    schedule: str,
    ranks: int,
    func: str,
    options: tuple[str, ...],
    models: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each stage copy holds its own tensor of a tied weight; summing the uses'
    gradients at `step` makes them train as the one parameter the reference shares (with
    SGD a missing or doubled sum fails the tolerance)."""
    program = stdlib(schedule, D=ranks, N=4)
    model = ("--model", f"models.py:{func}", "--optimizer", "sgd", "--steps", "3")
    assert run(program, *model, "--check", *options) == 0
    out = capsys.readouterr().out
    assert "check OK" in out
    assert "(bitwise equal)" in out, out  # the reference sums the uses as the run does


def test_the_copies_of_a_tied_weight_stay_bitwise_equal(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ("--model", "models.py:tied_layers", "--steps", "3", "--save", str(models / "ck"))
    assert run(stdlib("chimera", D=4, N=4), *model) == 0
    saved = read_checkpoint(models / "ck" / "step-3")
    assert torch.equal(saved["model.0.weight"], saved["model.5.weight"])
    assert torch.equal(saved["optim.0.weight.exp_avg"], saved["optim.5.weight.exp_avg"])


def test_asynchronous_schedules_refuse_tied_weights(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "pipedream", "-p", "D=3", "--model", "models.py:tied_stages"]
    assert main(argv) == 1
    assert "ties weights across stages" in capsys.readouterr().err


# ---- a model file that misbehaves (issue 44 item 12) ------------------------------------------

LAYERS = """
import torch
from torch import nn


class Layer(nn.Linear):
    def forward(self, x):
        {forward}
        return super().forward(x)


def layers():
    return nn.Sequential(nn.Embedding(64, 16), Layer(16, 16), nn.Linear(16, 64))
"""


def _model_file(tmp_path: Path, at_import: str = "", forward: str = "pass") -> str:
    """A model file whose import runs `at_import` and whose middle layer's forward runs
    `forward` first."""
    (tmp_path / "bad.py").write_text(at_import + "\n" + LAYERS.replace("{forward}", forward))
    return "bad.py:layers"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("at_import", "forward", "message"),
    [
        (
            "while True:\n    pass",
            "pass",
            "error: `--model bad.py:layers`: loading it (importing its module, calling its "
            "function, running it once on the meta device) did not finish within 2 s "
            "(--timeout); does its code loop or wait as it loads?",
        ),
        (
            "import os\nos._exit(0)",
            "pass",
            "error: `--model bad.py:layers`: loading the model (importing its module, calling "
            "its function, running it once on the meta device) ended the process (exit status "
            "0) before it finished; a model's code may not end the process",
        ),
        (
            "raise KeyboardInterrupt",
            "pass",
            "error: `--model bad.py:layers`: importing `bad.py` failed: KeyboardInterrupt",
        ),
        (
            "class Stop(BaseException):\n    pass\nraise Stop('mine')",
            "pass",
            "error: `--model bad.py:layers`: importing `bad.py` failed: Stop: mine",
        ),
        (
            "raise RuntimeError('v' * 5000)",
            "pass",
            "error: `--model bad.py:layers`: importing `bad.py` failed: RuntimeError: "
            + "v" * 200
            + "... (5,000 characters)",
        ),
        (
            "",
            "import sys; sys.exit(0)",
            "error: `--model bad.py:layers`: layer 1 (Layer) fails on what layer 0 returns (a "
            "tensor [4, 32, 16]): called sys.exit(0)",
        ),
    ],
)
def test_a_model_file_that_hangs_exits_or_interrupts_as_it_loads_fails_with_one_line(
    at_import: str, forward: str, message: str, tmp_path: Path
) -> None:
    """Loaded in a child process under --timeout first: a loop at import is stopped, an
    os._exit(0) or sys.exit(0) is a failure (it was exit 0, having trained nothing), a
    KeyboardInterrupt or BaseException is one line (a silent 130, a traceback)."""
    model = _model_file(tmp_path, at_import, forward)
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--backend", "local", "--model", model]
    proc = pipelang_cmd(*argv, "--timeout", "2", "--steps", "1", cwd=tmp_path, timeout=90)
    assert (proc.returncode, proc.stderr.strip()) == (1, message)


@pytest.mark.slow
def test_a_rank_whose_model_ends_its_process_with_status_0_fails_the_run(tmp_path: Path) -> None:
    """os._exit(0) in a forward on a real batch (not the meta device's): the rank's
    process ends without its result, and the launcher names it rather than waiting."""
    model = _model_file(tmp_path, forward="if x.device.type != 'meta': import os; os._exit(0)")
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--model", model, "--timeout", "20"]
    proc = pipelang_cmd(*argv, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == (
        "error: rank 0 failed at step 0, action 4 `r0.compute F0@0/main`: the process ended "
        "(exit status 0) before it finished its steps\nstopped the other ranks (1)\n"
    )


def test_a_run_that_reports_fewer_steps_than_it_was_given_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The launcher's last check: whatever ended it, a run that did not finish its steps
    never exits 0."""
    from pipelang.backends.config import RunConfig
    from pipelang.backends.launch import report
    from pipelang.backends.report import Outcome

    assert report(stdlib("1f1b", D=2, N=2), RunConfig(steps=3), Outcome([], [1.0])) == 1
    assert capsys.readouterr().err.strip() == (
        "error: the run ended after 1 of its 3 steps and no rank said why; a run that does "
        "not finish its steps fails"
    )
