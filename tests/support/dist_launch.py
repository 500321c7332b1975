"""Run one worker script as a ``torch.distributed`` job of several CPU processes (gloo).

Each rank is a separate ``python`` process with the environment ``torch.distributed``
and accelerate read (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``).  Everything stays on the loopback interface: the rendezvous address is
127.0.0.1 and gloo is pinned to ``lo``.  A job that does not finish within ``timeout``
seconds is killed (every rank, by its own process id) and the test fails with the tail of
each rank's output, so a collective that hangs never stalls CI.

Every rank writes ``rank<r>.json`` into the output folder; :func:`run_ranks` returns those
documents, ordered by rank.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent


def require_distributed(*modules: str) -> None:
    """Skip the calling test module unless ``modules`` import and torch.distributed has gloo."""
    import pytest

    for name in modules:
        pytest.importorskip(name)
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict:
    """The environment of one rank: the parent's, plus rendezvous, loopback-only gloo,
    one thread per rank (the CI machine has two cores) and offline Hugging Face."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        # our checkout first, then tests/ for the helpers the workers import (the package support)
        PYTHONPATH=os.pathsep.join(
            [str(REPO / "src"), str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        ),
    )
    env.pop("LIK_DISABLE", None)  # the workers set it themselves where they test it
    return env


def run_ranks(worker: Path, out_dir: Path, args=(), world_size: int = 2, timeout: float = 240.0) -> list[dict]:
    """Start ``world_size`` ranks of ``python worker out_dir *args`` and wait for all.

    Raises ``AssertionError`` (with every rank's output tail) when a rank exits non-zero,
    when the job runs past ``timeout`` seconds (all ranks are killed first), or when a
    rank wrote no result.  Returns the ``rank<r>.json`` documents, ordered by rank.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(out_dir), *map(str, args)],
                env=rank_env(rank, world_size, port),
                cwd=str(REPO),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(remaining, 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:  # only the processes started here, each by its own pid
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tails = []
    for rank, log in enumerate(logs):
        log.seek(0)
        tails.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{log.read()[-4000:]}")
        log.close()
    report = "\n".join(tails)
    if timed_out:
        raise AssertionError(f"distributed job timed out after {timeout:.0f} s; ranks killed\n{report}")
    if any(proc.returncode != 0 for proc in procs):
        raise AssertionError(f"a rank failed\n{report}")
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"rank {rank} wrote no result\n{report}")
        results.append(json.loads(path.read_text()))
    return results


def assert_gloo_job(ranks: list[dict], world_size: int) -> None:
    """Every rank of a gloo job of ``world_size`` processes reported, in rank order."""
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert all(r["world_size"] == world_size and r["backend"] == "gloo" for r in ranks)


def write_result(out_dir: str, rank: int, result: dict) -> None:
    """Worker side: write this rank's result document."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)
