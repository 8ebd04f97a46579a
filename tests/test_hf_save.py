"""`run --model hf:DIR --save-hf OUT_DIR` (issue 42): the trained model as a Hugging Face
checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

Oracle, independent of the writer: the same run's `--save` checkpoint (pipelang's own
DCP files, named by layer), loaded into pipelang's layers of DIR's model, whose logits are
transformers' own (tests/test_hf_models.py); `from_pretrained(OUT_DIR)` must give the
same logits, with no missing or unexpected keys. Local and torchrun runs write what the
gloo run wrote, tensor for tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip(
    "transformers", reason="the hf extra is not installed: pip install pipelang[hf]"
)

import safetensors.torch
import transformers

from pipelang.backends.hf_config import INDEX
from pipelang.backends.models import ModelSpec
from tests.helpers import free_port, pipelang_here, run_in_process
from tests.test_hf_models import SEQ, checkpoints  # noqa: F401 (a fixture)


def _argv(directory: Path, schedule: str = "1f1b", ranks: int = 2) -> list[str]:
    return [
        "run",
        schedule,
        "-p",
        f"D={ranks}",
        "-p",
        "N=4",
        "--model",
        f"hf:{directory}",
        *SEQ,
        "--steps",
        "2",
        "--optimizer",
        "adam",
    ]


def _checkpointed(directory: Path, step: Path, dtype: torch.dtype) -> list[nn.Module]:
    """pipelang's layers of DIR's model holding the parameters of a `--save` checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = step.parent / "whole.pt"
    dcp_to_torch_save(step, whole)
    saved = torch.load(whole, weights_only=True)
    layers = ModelSpec(f"hf:{directory}", seq_len=16).build().layers
    state = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    model = nn.Sequential(*layers).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return layers


def _reloaded(out: Path, dtype: torch.dtype = torch.float32) -> Any:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=dtype
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "schedule", "ranks", "extra"),
    [
        ("gpt2", "chimera", 4, ()),  # tied: written once; two copies of each stage
        ("llama", "1f1b", 2, ("--mixed-precision", "bfloat16")),  # the fp32 masters
        ("llama", "1f1b", 2, ("--dp", "2", "--shard")),  # gathered from both copies
    ],
)
def test_the_written_model_is_the_last_steps(
    name: str,
    schedule: str,
    ranks: int,
    extra: tuple[str, ...],
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """gloo, 2 steps of Adam, `--save CK --save-hf OUT`: transformers loads OUT with
    no key missing or unexpected, and its logits are those of the checkpoint's
    parameters (not the input's); one shard per stage, the index naming each tensor."""
    directory = checkpoints[name]
    argv = [*_argv(directory, schedule, ranks), *extra, "--save", "ck", "--save-hf", "out"]
    proc = pipelang_here(*argv, "--backend", "gloo", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    stages = 4 if schedule == "chimera" else 2
    index = json.loads((out / INDEX).read_text())
    assert proc.stderr.strip().splitlines()[-1] == (
        f"wrote the trained model to out as a Hugging Face checkpoint ({stages} shards, "
        f"{len(index['weight_map'])} tensors): AutoModelForCausalLM.from_pretrained('out')"
    )
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{k:05d}-of-{stages:05d}.safetensors" for k in range(1, stages + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", INDEX, *shards]
    )
    assert (out / "config.json").read_bytes() == (directory / "config.json").read_bytes()
    written = {}
    for shard in shards:
        written |= safetensors.torch.load_file(out / shard)
    assert {t.dtype for t in written.values()} == {torch.float32}  # mixed: the masters
    layers = _checkpointed(directory, tmp_path / "ck" / "step-2", torch.float32)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = nn.Sequential(*layers)(ids)
        got = _reloaded(out)(input_ids=ids).logits
        before = transformers.AutoModelForCausalLM.from_pretrained(directory)(input_ids=ids)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, before.logits, atol=1e-3)  # trained: not the input


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX).read_text())
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        found |= safetensors.torch.load_file(out / shard)
    return found


@pytest.mark.slow
def test_local_and_torchrun_write_what_gloo_writes(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same run on `local` (ranks are threads), over gloo and under torchrun (two
    processes started as torchrun starts them): the same tensors, bit for bit."""
    directory = checkpoints["llama-tied"]
    argv = [*_argv(directory), "--save-hf"]
    status, _, err = run_in_process([*argv, str(tmp_path / "local"), "--backend", "local"])
    assert status == 0, err
    gloo = pipelang_here(*argv, "gloo", "--backend", "gloo", cwd=tmp_path, timeout=300)
    assert gloo.returncode == 0, gloo.stderr
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipelang.cli", *argv, "torchrun", "--backend", "gloo"],
            cwd=tmp_path,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        _, said = proc.communicate(timeout=300)
        assert proc.returncode == 0, said
    expected = _tensors(tmp_path / "gloo")
    assert "lm_head.weight" not in expected and "model.embed_tokens.weight" in expected
    for run in ("local", "torchrun"):
        got = _tensors(tmp_path / run)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), run
    _reloaded(tmp_path / "torchrun")


# ---- refused ----------------------------------------------------------------------------------


def _refusal(argv: list[str]) -> tuple[int, str]:
    status, _, err = run_in_process(argv)
    return status, err.strip().splitlines()[-1]


def test_save_hf_needs_an_hf_model(tmp_path: Path) -> None:
    status, err = _refusal(["run", "1f1b", "--save-hf", str(tmp_path / "out")])
    assert status == 2
    assert err == (
        "pipelang run: error: --save-hf writes a Hugging Face checkpoint of --model hf:DIR; "
        "the model is `gpt:tiny`: give --save DIR for pipelang's own checkpoints"
    )
    assert not (tmp_path / "out").exists()


def test_save_hf_writes_over_nothing(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """A directory holding anything, a file, or a place that cannot be made: one usage
    error before any step, and nothing written."""
    argv = _argv(checkpoints["llama"])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    cases = {
        full: f"--save-hf `{full}` is not empty; pipelang writes over nothing: give a new "
        "or empty directory",
        tmp_path / "file": f"--save-hf `{tmp_path / 'file'}` is a file, not a directory",
        tmp_path / "file" / "out": f"--save-hf: cannot write to `{tmp_path / 'file' / 'out'}`: "
        "Not a directory",
    }
    for out, message in cases.items():
        status, err = _refusal([*argv, "--backend", "local", "--save-hf", str(out)])
        assert status == 2 and err == f"pipelang run: error: {message}", err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
