"""Checkpointer: restore checks step names against the state and the data position; saves are
asynchronous, own their copy of the state, and a kill mid-write keeps the previous checkpoint.

Every test uses a hand-made ``TrainState`` of one 4x4 array, so no model is built or compiled.
"""

import asyncio
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from fp8jax import errors
from fp8jax.trainer import checkpoint as checkpoint_lib
from fp8jax.trainer import data as data_lib
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_state(updates: int, skipped: int = 0) -> step_lib.TrainState:
    """A train state after ``updates`` optimizer steps and ``skipped`` skipped ones."""
    zero = jnp.zeros((), jnp.int32)
    w = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) + updates  # differs per step
    return step_lib.TrainState(jnp.int32(updates), {"w": w}, {}, {}, zero, jnp.int32(skipped))


def save(workdir, step: int, state, data_state: dict) -> None:
    ckpt = Checkpointer(str(workdir))
    try:
        assert ckpt.save(step, state, data_state, force=True, wait=True)
    finally:
        ckpt.close()


def restore(workdir, step: int | None = None):
    ckpt = Checkpointer(str(workdir))
    try:
        return ckpt.restore(abstract_like(tiny_state(0)), step)
    finally:
        ckpt.close()


def snapshot(workdir) -> dict:
    """Every file under ``workdir`` with its bytes and mtime."""
    return {
        str(p): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(pathlib.Path(workdir).rglob("*"))
        if p.is_file()
    }


def data_file(workdir, step: int) -> pathlib.Path:
    return pathlib.Path(workdir) / "checkpoints" / str(step) / "data" / "metadata"


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- restore: directory step, state step count and data position must agree ----------------


def test_restore_counts_skipped_steps_as_loop_steps(tmp_path):
    """Saves loop step 11 of a run that updated 6 times and skipped 5 non-finite steps.

    It restores: the loop step is updates + skipped, and the data state comes back as saved.
    """
    save(tmp_path, 11, tiny_state(6, skipped=5), {"step": 11, "batch_size": 4})
    state, data = restore(tmp_path)
    assert (int(state.step), int(state.skipped)) == (6, 5)
    assert data == {"step": 11, "batch_size": 4}


def test_restore_rejects_a_renamed_checkpoint_and_changes_nothing(tmp_path):
    """Injects a rename of checkpoint directory 20 (18 updates + 2 skipped) to 25."""
    save(tmp_path, 20, tiny_state(18, skipped=2), {"step": 20})
    ckpts = tmp_path / "checkpoints"
    (ckpts / "20").rename(ckpts / "25")
    before = snapshot(tmp_path)
    with pytest.raises(errors.CheckpointMismatchError) as info:
        restore(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert "named step 25" in msg and "has run 20 steps (18 updates + 2 skipped)" in msg, msg
    assert f"rename it to {ckpts}/20" in msg, msg
    assert snapshot(tmp_path) == before


def test_restore_rejects_an_edited_data_position_and_changes_nothing(tmp_path):
    """Injects an edit of the saved data position of step 20 from 20 to 15 (replaying 5)."""
    save(tmp_path, 20, tiny_state(20), {"step": 20})
    path = data_file(tmp_path, 20)
    path.write_text(path.read_text().replace('"step": 20', '"step": 15'))
    before = snapshot(tmp_path)
    with pytest.raises(errors.CheckpointMismatchError) as info:
        restore(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert "puts the data at step 15, not 20" in msg and f"in {path} back to 20" in msg, msg
    assert snapshot(tmp_path) == before


MALFORMED = {
    "not JSON": ("{step: 20", "is corrupt or incomplete"),
    "a list": ("[20]", "a JSON object was expected, not list"),
    "no step": ('{"seed": 0}', "'step' must be an integer >= 0, not None"),
    "step as text": ('{"step": "20"}', "'step' must be an integer >= 0, not '20'"),
    "negative step": ('{"step": -1}', "'step' must be an integer >= 0, not -1"),
    "bad batch size": ('{"step": 20, "batch_size": "x"}', "'batch_size' must be an integer"),
    "bad offset": ('{"step": 20, "loop_step_offset": 0.5}', "'loop_step_offset' must be"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_restore_rejects_a_malformed_data_state_in_one_line(case, tmp_path):
    """Injects a data-state file that is not JSON, or JSON without a usable position."""
    text, fragment = MALFORMED[case]
    save(tmp_path, 20, tiny_state(20), {"step": 20})
    data_file(tmp_path, 20).write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(errors.CheckpointMismatchError) as info:
        restore(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and fragment in msg and "checkpoints/20" in msg, msg
    assert snapshot(tmp_path) == before


def test_positions_stay_consistent_after_a_resume_with_another_batch_size(tmp_path):
    """Saves step 40 at batch size 4, resumes an iterator at batch size 8 (position 20), runs
    one step and saves step 41: the data position 21 is accepted, and an edit to it is not.
    """
    save(tmp_path, 40, tiny_state(40), {"step": 40, "batch_size": 4})
    _, data = restore(tmp_path)
    it = data_lib.TrainIterator(list(range(100)), {"batch_size": 8})
    it.set_state(data)
    assert it.step == 40 * 4 // 8
    next(it)
    save(tmp_path, 41, tiny_state(41), it.get_state())
    _, data = restore(tmp_path, 41)
    assert data == {"batch_size": 8, "step": 21}
    path = data_file(tmp_path, 41)
    path.write_text(path.read_text().replace('"step": 21', '"step": 41'))
    with pytest.raises(errors.CheckpointMismatchError, match="at step 41, not 21"):
        restore(tmp_path, 41)


# --- asynchronous saves ----------------------------------------------------------------------


@pytest.fixture
def gated_json_writes(monkeypatch):
    """Orbax's JSON writes (the data state) wait until the returned event is set (60 s max)."""
    gate = threading.Event()
    write = ocp.handlers.JsonCheckpointHandler._save_fn

    async def gated(self, item, directory):
        await asyncio.to_thread(gate.wait, 60)
        await write(self, item, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", gated)
    yield gate
    gate.set()


@pytest.fixture
def racing_failed_save(monkeypatch):
    """A function that makes the next saves fail as a full disk does while their writes still
    land: orbax's JSON write (the data state) raises ENOSPC, and the partial step's removal
    finds its directory not empty (a sibling write adding a file after the listing) the given
    number of times in a row before it succeeds."""
    rmtree = type(epath.Path("/")).rmtree
    races = [0]

    async def full(self, item, directory):
        raise OSError(28, "No space left on device")

    def racing(self, *args, **kwargs):
        if races[0] > 0 and ".orbax-checkpoint-tmp" in self.name:
            races[0] -= 1
            raise OSError(39, f"Directory not empty: '{self.name}'")
        return rmtree(self, *args, **kwargs)

    def arm(times: int) -> None:
        races[0] = times
        monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full)
        monkeypatch.setattr(type(epath.Path("/")), "rmtree", racing)
        monkeypatch.setattr(checkpoint_lib, "_SETTLE_S", 1.0)

    yield arm
    races[0] = 0


@pytest.mark.parametrize("races", [1, 10**6], ids=["settles", "stays"])
def test_a_failed_save_is_one_error_while_its_writes_still_land(
    tmp_path, racing_failed_save, races
):
    """Step 2's save fails for lack of space while its other writes still add files: ``wait``
    raises the one-line CheckpointSaveError (not the removal's own error), step 1 stays; the
    partial step is removed once its writes settle, else the error names it for deletion."""
    save(tmp_path, 1, tiny_state(1), {"step": 1})
    ckpt = Checkpointer(str(tmp_path))
    racing_failed_save(races)
    try:
        ckpt.save(2, tiny_state(2), {"step": 2}, force=True)
        with pytest.raises(errors.CheckpointSaveError) as info:
            ckpt.wait()
    finally:
        ckpt.close()
    message = str(info.value)
    directory = tmp_path / "checkpoints"
    left = sorted(p.name for p in directory.iterdir() if p.name != "1")
    assert "\n" not in message and "failed (no space left on device)" in message, message
    assert "resume from step 1" in message, message
    if races == 1:
        assert left == [] and "partly written" not in message, (left, message)
    else:
        assert left and all(f"delete {name}" in message for name in left), (left, message)
        racing_failed_save(0)  # the writes settled: the next run's start removes the leftover
    assert restore(tmp_path)[1] == {"step": 1}
    assert sorted(p.name for p in directory.iterdir()) == ["1"]


def test_save_returns_before_the_write_and_keeps_its_own_copy(tmp_path, gated_json_writes):
    """Holds the write of step 2 back, donates the saved state to a jitted update meanwhile,
    then lets the write finish.

    ``save`` returned with the write in flight: orbax reports a save in progress, step 2 is not
    on disk and ``latest_step`` is still 1. The checkpoint then holds step 2's values, not the
    donated buffers' new contents.
    """
    gated_json_writes.set()
    save(tmp_path, 1, tiny_state(1), {"step": 1})
    gated_json_writes.clear()
    ckpt = Checkpointer(str(tmp_path))
    try:
        state = tiny_state(2)
        # A copy, not device_get: on CPU that returns views, and a view blocks the donation.
        expected = jax.tree.map(lambda x: np.array(x, copy=True), state)
        assert ckpt.save(2, state, {"step": 2}, force=True)
        assert ckpt.manager.is_saving_in_progress()
        assert ckpt.latest_step() == 1
        assert not (tmp_path / "checkpoints" / "2").exists()
        bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 100, s), donate_argnums=0)
        bumped = jax.block_until_ready(bump(state))
        del state
        gated_json_writes.set()
    finally:
        ckpt.close()
    assert int(bumped.step) == 102  # the update ran (in place, where the platform allows)
    restored, data = restore(tmp_path)
    assert data == {"step": 2}
    assert_trees_equal(restored, expected)


KILLED_WRITER = """
import asyncio, pathlib, sys, threading
import orbax.checkpoint as ocp
sys.path.insert(0, sys.argv[2])
from test_checkpoint import tiny_state
from fp8jax.trainer.checkpoint import Checkpointer

ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, tiny_state(1), {"step": 1}, force=True, wait=True)

async def never(self, item, directory):
    await asyncio.to_thread(threading.Event().wait)

ocp.handlers.JsonCheckpointHandler._save_fn = never
ckpt.save(2, tiny_state(2), {"step": 2}, force=True)
pathlib.Path(sys.argv[1], "writing").write_text("step 2")
threading.Event().wait()
"""


def test_kill9_during_an_async_write_restores_the_previous_checkpoint(tmp_path):
    """Injects SIGKILL into a process whose save of step 2 returned but is still writing.

    The write had begun, yet the latest checkpoint is step 1 and it restores whole; opening a
    checkpointer on the directory removes the unfinished write before it returns.
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(ROOT / "tests")]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "save() did not return while writing"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    ckpts = tmp_path / "checkpoints"
    # The write had begun: orbax's temporary directory (or, where orbax writes in place and
    # marks completion with a commit file instead, the unmarked directory) of step 2 exists.
    assert any(p.name.split(".")[0] == "2" for p in ckpts.iterdir())
    ckpt = Checkpointer(str(tmp_path))
    try:
        # Gone once the checkpointer is open, not later in a background thread.
        assert sorted(p.name for p in ckpts.iterdir()) == ["1"]
        assert ckpt.latest_step() == 1
    finally:
        ckpt.close()
    state, data = restore(tmp_path)
    assert data == {"step": 1}
    assert_trees_equal(state, jax.device_get(tiny_state(1)))
