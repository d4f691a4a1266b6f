"""A real two-process run: ``jax.distributed`` on localhost with CPU (gloo) collectives.

Two worker processes with 2 CPU devices each form one 4-device data-parallel mesh, read their own
rows of every global batch (``trainer.data``'s process sharding) and train the tiny model at O1
(FP8 gradient reduction across the processes) for a few steps; the losses must match one process
driving the same 4-device mesh. The workers are this file run as a script.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3
DEVICES_PER_PROCESS = 2
LOSS_RTOL = 1e-5  # same mesh, same replicas: only f32 summation order may differ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, **{k: str(v) for k, v in extra.items()})
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _worker_cmd(*args) -> list[str]:
    return [sys.executable, str(pathlib.Path(__file__).resolve()), *map(str, args)]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    port = _free_port()
    procs = [
        subprocess.Popen(
            _worker_cmd("worker", tmp_path / f"p{pid}.json"),
            # The README's multi-host launch, with both "hosts" on localhost.
            env=_env(
                DEVICES_PER_PROCESS,
                JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                JAX_NUM_PROCESSES=2,
                JAX_PROCESS_ID=pid,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    single = subprocess.run(
        _worker_cmd("single", tmp_path / "single.json"),
        env=_env(2 * DEVICES_PER_PROCESS),
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        logs.append(out)
    assert single.returncode == 0, single.stdout + single.stderr
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    one = json.loads((tmp_path / "single.json").read_text())
    two = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    print("one process:", one, "\ntwo processes:", two)
    assert two[0]["process_count"] == 2 and two[0]["global_devices"] == 4
    assert one["process_count"] == 1 and one["global_devices"] == 4
    for t in two:
        assert t["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)
        assert t["grad_norms"] == pytest.approx(one["grad_norms"], rel=LOSS_RTOL)
    assert one["losses"][-1] < one["losses"][0]  # it trains
    assert "comm_mu" in one["last_metrics"]  # the FP8 gradient reduction ran


def _worker(mode: str, out: str) -> None:
    """Train ``STEPS`` steps of the tiny model over every visible device; write the losses."""

    import jax
    import numpy as np

    from fp8jax import spec
    from fp8jax.parallel import sharding
    from fp8jax.trainer import data as data_lib
    from fp8jax.trainer import loop as train_lib

    if mode == "worker":
        sharding.initialize_distributed()  # what train.py does for config.distributed
    jax.config.update("jax_disable_most_optimizations", True)  # compiles dominate here

    sys.path.insert(0, str(ROOT / "tests"))
    from sharded_checks import tiny_config

    config = tiny_config("O1", data=-1)  # every device (across processes) is a replica
    config.batch_size = 8
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, 50_000)
    dataset = data_lib.Dataset(
        None,
        tokens.astype(np.int32),
        tokens[:1000].astype(np.int32),
        seed=config.seed,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
    )
    it = dataset.train_iter()  # this process's rows of each global batch
    env = train_lib.setup(spec.parse(config))
    state = env.init(jax.random.PRNGKey(config.seed))
    losses, grad_norms, m = [], [], {}
    for _ in range(STEPS):
        batch = sharding.put_batch(next(it), env.batch_sharding)
        state, metrics = env.train_step(state, batch)
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        losses.append(m["loss"])
        grad_norms.append(m["grad_norm"])
    result = dict(
        losses=losses,
        grad_norms=grad_norms,
        last_metrics=m,
        process_count=jax.process_count(),
        global_devices=jax.device_count(),
    )
    pathlib.Path(out).write_text(json.dumps(result))
    if mode == "worker":
        jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
