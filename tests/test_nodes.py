"""Where users train: several nodes under torchrun, SIGTERM before a job is killed, a
peer that dies, and the hosts a plan's ranks must run on (docs/runtime.md, "Several
nodes"). Two torchrun launchers on 127.0.0.1 stand for two nodes (static rendezvous: the
node rank numbers the processes, as on a cluster)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RUN_1F1B = ["pipelang", "run", "1f1b", "-p", "D=2", "-p", "N=2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nodes(command: list[str], nodes: int = 2, procs: int = 2) -> list[subprocess.Popen[str]]:
    """One torchrun launcher per node, all on this machine, started together."""
    port = str(_port())
    return [
        subprocess.Popen(
            [
                *TORCHRUN,
                *("--nnodes", str(nodes), "--nproc-per-node", str(procs)),
                *("--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", port),
                *command,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for k in range(nodes)
    ]


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 180) -> list[tuple[int, str]]:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def _hosts(tmp_path: Path, hosts: list[str]) -> str:
    path = tmp_path / "hosts.txt"
    path.write_text("# rank order\n" + "\n".join(hosts) + "\n")
    return str(path)


@pytest.mark.slow
def test_two_nodes_train_dp_across_them_check_save_and_resume(tmp_path: Path) -> None:
    """Four processes on two launchers, `--dp 2` across them (copy k on node k): the run
    passes --check bit for bit and saves; a second run on both resumes from it."""
    hosts = _hosts(tmp_path, [socket.gethostname()] * 4)
    save = str(tmp_path / "ckpt")
    common = [*RUN_1F1B, "--dp", "2", "--check", "--rank-hosts", hosts, "--save", save]
    first = _finish(_nodes(["--no-python", *common, "--steps", "2"]))
    assert [code for code, _ in first] == [0, 0], first
    assert "check OK" in first[0][1] and "(bitwise equal)" in first[0][1], first[0][1]
    assert (tmp_path / "ckpt" / "step-2" / "pipelang.json").is_file()
    second = _finish(_nodes(["--no-python", *common, "--steps", "4", "--resume", save]))
    assert [code for code, _ in second] == [0, 0], second
    assert "check OK" in second[0][1] and "(bitwise equal)" in second[0][1], second[0][1]
    assert "internal error" not in first[0][1] + second[0][1]
    assert (tmp_path / "ckpt" / "step-4" / "pipelang.json").is_file()


@pytest.mark.slow
def test_the_torchrun_example_runs_on_two_nodes() -> None:
    """Two data-parallel copies of a 2-rank zero-bubble pipeline (its backward split),
    one per node: the gradients match one process's (tests/test_torch_api.py runs
    Chimera on one node)."""
    results = _finish(_nodes(["examples/train_with_torchrun.py", "zb-h1", "D=2", "N=4"]))
    assert [code for code, _ in results] == [0, 0], results
    found = re.search(r"gradients against one process: largest difference (\S+)", results[0][1])
    assert found is not None, results[0][1]
    assert float(found[1]) < 1e-6 and "CHECK FAILED" not in results[0][1]


@pytest.mark.slow
def test_ranks_on_other_hosts_than_the_file_says_stop_before_training(tmp_path: Path) -> None:
    hosts = _hosts(tmp_path, [socket.gethostname(), "elsewhere"])
    node = _finish(_nodes(["--no-python", *RUN_1F1B, "--rank-hosts", hosts], 1, 2))
    code, out = node[0]
    assert code != 0
    assert out.count("error: --rank-hosts") == 1, out  # rank 0 says it, once
    assert "rank 1 runs on" in out and "not elsewhere" in out and "--node-rank" in out
    assert "step 1/" not in out


@pytest.mark.slow
def test_a_rank_that_dies_under_torchrun_is_named_by_the_others() -> None:
    """kill -9 of one rank: each survivor prints one line (the rank it was talking to,
    or the peer's address for a collective) and exits within the timeout."""
    (launcher,) = _nodes(["--no-python", *RUN_1F1B[:3], "-p", "D=3", "-p", "N=3",
                          "--steps", "100000", "--timeout", "30"], 1, 3)  # fmt: skip
    assert launcher.stdout is not None
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if "step 3/" in line:
            break
    ranks = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    victim = sorted(int(pid) for pid in ranks.stdout.split())[1]  # local rank 1
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    out = "".join(lines) + launcher.communicate(timeout=120)[0]
    assert time.monotonic() - start < 60
    assert launcher.returncode != 0
    errors = [line for line in out.splitlines() if line.startswith("error: rank")]
    assert sorted(e.split()[2] for e in errors) == ["0", "2"], out
    assert all("went away" in e and "step" in e for e in errors), errors
    # A survivor stopped in a transfer names rank 1; one stopped in the step's loss sum
    # (a collective: which one depends on when the kill lands) names the peer's address.
    assert all("rank 1 went away" in e or "the peer at " in e for e in errors), errors
    assert "internal error" not in out and "this is a bug" not in out


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_a_step_saves_and_exits_143(tmp_path: Path) -> None:
    """What SLURM and Kubernetes send before they kill: the launcher passes it on, every
    rank stops after the same step, the checkpoint of that step is written, and the
    resumed run passes --check bit for bit."""
    save = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "pipelang.cli", *RUN_1F1B[1:], "--save", str(save)]
    proc = subprocess.Popen(
        [*argv, "--steps", "100000", "--save-every", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(save / "step-1" / "pipelang.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    stopped = [line for line in err.splitlines() if line.startswith("terminated (SIGTERM)")]
    assert len(stopped) == 1, err
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert f"its checkpoint is {save}/step-{step}: go on with --resume {save}" in stopped[0]
    assert (save / f"step-{step}" / "pipelang.json").is_file()
    assert "leaked semaphore" not in err and "Traceback" not in err
    resumed = subprocess.run(
        [*argv, "--steps", str(step + 2), "--resume", str(save), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "(bitwise equal)" in resumed.stdout


@pytest.mark.slow
def test_sigterm_under_torchrun_saves_the_step_every_rank_stopped_at(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    (launcher,) = _nodes(
        ["--no-python", *RUN_1F1B, "--steps", "100000", "--save", str(save),
         "--save-every", "1"], 1, 2)  # fmt: skip
    _wait_for(save / "step-1" / "pipelang.json", launcher)
    launcher.send_signal(signal.SIGTERM)  # torchrun passes it to its ranks
    out = launcher.communicate(timeout=90)[0]
    stopped = [line for line in out.splitlines() if line.startswith("terminated (SIGTERM)")]
    assert len(stopped) == 1, out  # rank 0 reports
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert (save / f"step-{step}" / "pipelang.json").is_file()
    assert "internal error" not in out


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_to_a_local_run_stops_its_threads_and_exits_143(signals: int) -> None:
    """Every rank a thread of this process: they stop (a waiting one at once, a computing
    one before its next step) before Python exits, which would end a thread still inside
    torch with pthread_exit, and std::terminate (status -6, not 143). A second SIGTERM
    while it exits is ignored (it was killed by it: -15)."""
    argv = [sys.executable, "-m", "pipelang.cli", *RUN_1F1B[1:5], "-p", "N=4"]
    proc = subprocess.Popen(
        [*argv, "--backend", "local", "--steps", "100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # a few steps in: the threads are inside torch's kernels
        seen.append(line)
        if line.startswith("step 3/"):
            break
    assert proc.poll() is None, seen
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    err = proc.communicate(timeout=60)[1]
    assert (proc.returncode, err.strip()) == (143, "terminated (SIGTERM): every rank stopped")


@pytest.mark.slow
def test_sigterm_during_set_up_says_so_and_exits_143(tmp_path: Path) -> None:
    """SIGTERM while the launcher loads the model (its import is still sleeping): one
    line, that nothing was saved, exit 143; the process loading the model goes too."""
    marker = tmp_path / "importing"
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(marker)!r}).write_text(str(__import__('os').getpid()))\n"
        "time.sleep(60)\n"
        "def layers():\n    pass\n"
    )
    save = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "pipelang.cli", *RUN_1F1B[1:], "--model", "slow.py:layers"]
    proc = subprocess.Popen(
        [*argv, "--save", str(save)], stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143, err
    assert err.startswith("terminated (SIGTERM) during set-up, before any step: nothing was saved")
    assert len(err.strip().splitlines()) == 1, err
    with pytest.raises(ProcessLookupError):  # the model's loader did not outlive the run
        os.kill(int(marker.read_text()), 0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"vm extra-word\n", "hosts.txt:1: one host name per line"),
        (b"h" * 900_000 + b"\nh\n", f"not `{'h' * 30}...{'h' * 15}` (900,000 characters)"),
        (b"\xff\xfe\x00garbage", "cannot read it"),
        (b"a\n" * (600 * 1024), "over 1 MiB, not a list of hosts"),
        (b"# only a comment\n", "names 0 hosts, the run has 2 processes"),
    ],
)
def test_a_bad_hosts_file_is_one_usage_error(
    content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hostile or wrong `--rank-hosts` files: read with a size cap, never evaluated, one
    line of error before any rank starts (exit 2)."""
    from pipelang.cli import main

    path = tmp_path / "hosts.txt"
    path.write_bytes(content)
    argv = ["run", "1f1b", "-p", "D=2", "-p", "N=2", "--rank-hosts", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert len(err) < 400  # a long name is cut, not echoed whole
