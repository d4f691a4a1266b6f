"""Orbax checkpointing of the train state together with the data iterator position.

Orbax writes each step into a temporary directory and renames it when complete, so a crash
(even ``kill -9``) mid-save never leaves a half-written *latest* checkpoint; restore always
picks a finished one, and leftover temporary directories are removed on the next start.
A state holding NaN/Inf is never written, so the latest checkpoint is always a good state.

Saves are asynchronous: ``save`` returns once orbax has copied the arrays to host memory (so
the caller may donate the state to the next step) and the files are written by a background
thread; ``close`` (or ``save(wait=True)``) blocks until they are on disk. On restore, the
directory's step, the train state's step count and the data position must agree.

Every finished step gets a ``checksums.json``: the CRC-32 of each array file, computed
by a background thread once the step is final (the next save waits for it, ``close`` writes the
last). Restore verifies them first, so a flipped bit on disk is a one-line error naming the step
and the older checkpoint to fall back on, never a silent resume with different numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging as pylogging
import os
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from fp8jax import checksums
from fp8jax.errors import CheckpointMismatchError, CheckpointSaveError, UserError

__all__ = [
    "OFFSET_KEY",
    "SAVED_AS",
    "Checkpointer",
    "abstract_like",
    "data_state_problem",
    "non_finite_leaves",
]


class Checkpointer:
    """Save/restore ``(state, data_state)`` under ``<workdir>/checkpoints``, keeping the last K."""

    def __init__(self, workdir: str, keep: int = 2, every: int = 0):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        _remove_unfinished_writes(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=False,  # done above, before anything reads the directory
            enable_async_checkpointing=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data")
        )
        self.every = every
        self._writing = None  # step of the newest save handed to orbax
        self._unsummed = None  # newest saved step without checksums yet
        self._summing = None  # the thread writing the checksums of an earlier step
        self.refused: dict[int, list[str]] = {}  # steps not saved for NaN/Inf: their leaves
        self.failed = False  # a save failed (CheckpointSaveError raised): close stays quiet
        self._step_bytes = 0  # bytes of the newest state handed to orbax

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step, or None (a save still being written does not count)."""
        steps = self.manager.all_steps()  # orbax lists a step as soon as its write starts
        if self.manager.is_saving_in_progress():
            steps = [s for s in steps if s != self._writing]
        return max(steps, default=None)

    def due(self, step: int) -> bool:
        """Whether a periodic save falls on ``step`` (``checkpoint_every_steps``)."""
        return self.every > 0 and step % self.every == 0

    def save(
        self, step: int, state, data_state: dict, force: bool = False, wait: bool = False
    ) -> bool:
        """Save if ``step`` is due (or ``force``) and ``state`` is finite, in the background.

        Returns once the arrays are copied to host memory, so ``state`` may then be donated;
        ``wait=True`` also blocks until every save so far is complete on disk.
        """
        with self._failed_saves_reported():
            saved = self._start_save(step, state, data_state, force)
        if wait:
            self.wait()
        return saved

    def wait(self) -> None:
        """Block until every save so far is complete on disk (and its checksums written)."""
        with self._failed_saves_reported():
            self.manager.wait_until_finished()
        self._write_pending_checksums()

    @contextlib.contextmanager
    def _failed_saves_reported(self):
        """Turn the error of a failed background save (orbax raises it at the next save or
        wait) into a one-line CheckpointSaveError naming the step, the space and the fix."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:  # orbax/tensorstore raise many types for a failed write
            self.failed = True
            text = " ".join(str(e).split())
            reason = "no space left on device" if "No space left" in text else text[:200]
            # The partial step: free its space. The failed write's sibling writes may still be
            # landing in it, so the removal retries for a while and never hides the error.
            left = _remove_unfinished_writes(self.directory, settle_s=_SETTLE_S)
            good = self.latest_step()
            resume = f"resume from step {good}" if good is not None else "start over"
            also = f" and delete {', '.join(left)} there (partly written)" if left else ""
            raise CheckpointSaveError(
                f"saving checkpoint step {self._writing} in {self.directory} failed "
                f"({reason}); a step takes about {_size(self._step_bytes)} (times "
                f"keep_checkpoints + 1 while saving): free space there{also}, lower "
                f"config.keep_checkpoints or pass a --workdir on a disk with room, then rerun "
                f"to {resume}"
            ) from e

    def _start_save(self, step: int, state, data_state: dict, force: bool) -> bool:
        if not force and not self.due(step):
            return False
        if step in self.manager.all_steps():
            return False
        t0 = time.perf_counter()
        bad = non_finite_leaves(state)
        t1 = time.perf_counter()
        if bad:
            logging.error(
                "not checkpointing step %d: NaN/Inf in %s; the latest checkpoint stays step %s",
                step,
                ", ".join(bad[:3]),
                self.latest_step(),
            )
            self.refused[step] = bad
            return False
        # The loop step minus the data position: 0 unless a resume changed the batch size (the
        # iterator then rescales its position to keep the samples seen); restore checks it.
        data_state = {**data_state, OFFSET_KEY: step - int(data_state["step"])}
        self.manager.wait_until_finished()  # as save would: a failed save names its own step
        self._writing = step
        self._step_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        saved = self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )
        if saved:  # orbax's save waited for the previous one: that step is final now
            self._checksum_in_background(self._unsummed)
            self._unsummed = step
            logging.info(
                "saving checkpoint step %d to %s (finite check %.1f s, copy to host %.1f s; "
                "written in the background)",
                step,
                self.directory,
                t1 - t0,
                time.perf_counter() - t1,
            )
        return saved

    def _checksum_in_background(self, step: int | None) -> None:
        """Start writing ``step``'s checksums in a thread (after the previous such thread)."""
        if self._summing is not None:
            self._summing.join()
            self._summing = None
        if step is None or jax.process_index() != 0:
            return
        path = os.path.join(self.directory, str(step))
        self._summing = threading.Thread(
            target=checksums.write, args=(path,), name="fp8jax-checksums", daemon=True
        )
        self._summing.start()

    def _write_pending_checksums(self) -> None:
        """Finish every checksum file (call once orbax's saves are complete on disk)."""
        self._checksum_in_background(self._unsummed)
        self._unsummed = None
        if self._summing is not None:
            self._summing.join()
            self._summing = None

    def restore(self, abstract_state, step: int | None = None):
        """Restore ``(state, data_state)`` of ``step`` (default latest) into the abstract target."""
        step = self.latest_step() if step is None else step
        path = os.path.join(self.directory, str(step))
        changed = checksums.verify(path)
        if changed:
            raise CheckpointMismatchError(
                f"checkpoint {path} changed on disk since it was saved ({changed}); "
                f"{self._fallback(step)}"
            )
        target, renamed = self._checked_target(path, abstract_state)
        failure = None
        with _muted_background_errors() as failed:
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target),
                        data=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # orbax/tensorstore raise many types for unreadable files
                reason = (str(e).strip().splitlines() or [""])[0][:160]
                failure = f"{type(e).__name__}: {reason}"
                cause = "".join(traceback.format_exception(e))  # text: keeps no frames alive
            if failure:  # `e` and its frames are gone: orbax's unfinished reads can be freed
                failed()
        if failure:
            error = CheckpointMismatchError(
                f"checkpoint {path} is corrupt or incomplete ({failure}); {self._fallback(step)}"
            )
            error.add_note(f"orbax's error (FP8JAX_DEBUG=1 prints this):\n{cause}")
            raise error
        state = restored["state"]
        if renamed:
            # A field the checkpoint lacks (renamed None) is the target's own, empty, value.
            state = abstract_state.replace(
                **{
                    k: getattr(abstract_state, k)
                    if renamed.get(k, k) is None
                    else state[renamed.get(k, k)]
                    for k in _fields(abstract_state)
                }
            )
        bad = non_finite_leaves(state)
        if bad:
            raise CheckpointMismatchError(
                f"checkpoint {path} holds NaN/Inf in {bad[0]}; {self._fallback(step)}"
            )
        data_state = self._check_positions(step, state, restored["data"])
        return state, data_state

    def check(self, abstract_state, step: int | None = None) -> None:
        """Refuse (one-line CheckpointMismatchError) a step (default latest) whose saved arrays
        differ from ``abstract_state`` in names, shapes or dtypes, from its metadata alone: no
        array is read (a finished run's rerun, which uses none of them)."""
        step = self.latest_step() if step is None else step
        self._checked_target(os.path.join(self.directory, str(step)), abstract_state)

    @staticmethod
    def _checked_target(path: str, abstract_state):
        """``_as_saved``'s target of the step at ``path``; another model's step is refused."""
        target, renamed = _as_saved(path, abstract_state)
        mismatch = _mismatch(path, target)
        if mismatch:
            raise CheckpointMismatchError(
                f"checkpoint {path} was written by another model or config: {mismatch}; resume "
                f"with the config that wrote it or start a fresh --workdir"
            )
        return target, renamed

    def _check_positions(self, step: int, state, data_state) -> dict:
        """``data_state`` without the offset, if directory, state and data agree on ``step``."""
        path = os.path.join(self.directory, str(step))
        data_file = os.path.join(path, "data", "metadata")  # orbax's JsonSave file name
        problem = data_state_problem(data_state)
        if problem:
            raise CheckpointMismatchError(
                f"checkpoint {path} has a malformed data state in {data_file} ({problem}); "
                f"{self._fallback(step)}"
            )
        updates, skipped = (int(jax.device_get(x)) for x in (state.step, state.skipped))
        if updates + skipped != step:  # every loop step either updates or is skipped
            raise CheckpointMismatchError(
                f"checkpoint {path} is named step {step} but its train state has run "
                f"{updates + skipped} steps ({updates} updates + {skipped} skipped); rename it "
                f"to {self.directory}/{updates + skipped}, or {self._fallback(step)}"
            )
        data_state = dict(data_state)
        expected = step - data_state.pop(OFFSET_KEY, 0)
        if data_state["step"] != expected:
            raise CheckpointMismatchError(
                f"checkpoint {path} is step {step} but its data state puts the data at step "
                f"{data_state['step']}, not {expected}, so batches would be replayed or "
                f'skipped; set "step" in {data_file} back to {expected}, or '
                f"{self._fallback(step)}"
            )
        return data_state

    def _fallback(self, step: int) -> str:
        older = [s for s in self.manager.all_steps() if s < step]
        if older:
            return (
                f"move {self.directory}/{step} out of {self.directory} to resume from step "
                f"{max(older)}, or start a fresh --workdir"
            )
        return f"delete {self.directory}/{step} or start a fresh --workdir"

    def close(self):
        """Block until every save is complete on disk, then stop orbax's background threads."""
        try:
            if not self.failed:
                with self._failed_saves_reported():
                    self.manager.wait_until_finished()
                self._write_pending_checksums()
        finally:
            with contextlib.suppress(Exception) if self.failed else contextlib.nullcontext():
                self.manager.close()


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3g} MB"


# Seconds a failed save's cleanup keeps retrying while the save's other writes still land.
_SETTLE_S = 10.0


def _remove_unfinished_writes(directory: str, settle_s: float = 0.0) -> list[str]:
    """Delete the temporary directories of saves a killed run left unfinished.

    Orbax's own cleanup runs in a background thread that only a save waits for; done here, the
    directory is settled before the checkpointer lists or restores anything. One process
    deletes while the others wait at a barrier, as orbax does. With ``settle_s`` > 0 (after a
    failed save, whose other writes may still be adding files), a removal that fails is retried
    for up to that many seconds and the names still there are returned instead of raised.
    """
    left = []
    if jax.process_index() == 0 and os.path.isdir(directory):
        for name in ocp.path.step.tmp_checkpoints(directory):  # names, in every orbax >= 0.11
            if not _rmtree_settled(epath.Path(directory) / name, settle_s):
                left.append(name)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("fp8jax: checkpoint directory settled")
    return left


def _rmtree_settled(path: epath.Path, settle_s: float) -> bool:
    """Remove ``path``, retrying while writers still add to it for up to ``settle_s`` seconds;
    whether it is gone (raises the removal's error when ``settle_s`` is 0)."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            path.rmtree()
            return True
        except OSError:
            if not path.exists():
                return True  # removed meanwhile by its writer's own cleanup
            if settle_s <= 0:
                raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)


# Train-state fields a checkpoint may hold under another name: the objective's state was 'ref'
# (DPO's frozen reference; {} in every other run), so those checkpoints restore unchanged. A
# field a checkpoint lacks whose value holds no arrays (``moe_state`` of a dense model, written
# before the field existed) restores as that empty value.
SAVED_AS = {"objective": "ref"}


def _fields(state) -> list[str]:
    """The field names of a train state (a dataclass), or a dict's keys."""
    if isinstance(state, dict):
        return list(state)
    return [f.name for f in dataclasses.fields(state)]


def _as_saved(path: str, abstract_state):
    """``(target, renamed)``: the restore target named as the checkpoint in ``path`` names the
    fields (a dict of the fields, ``renamed``: field -> saved name, None for an empty field the
    checkpoint lacks), or ``abstract_state`` and {} when the names agree."""
    try:
        saved = set(ocp.StandardCheckpointHandler().metadata(epath.Path(path) / "state").tree)
    except Exception:  # unreadable metadata: restore reports the checkpoint as corrupt
        return abstract_state, {}
    if not dataclasses.is_dataclass(abstract_state):
        return abstract_state, {}
    names = _fields(abstract_state)
    renamed = {
        new: old
        for new, old in SAVED_AS.items()
        if new in names and new not in saved and old in saved
    }
    for k in names:
        if k not in saved and k not in renamed and not jax.tree.leaves(getattr(abstract_state, k)):
            renamed[k] = None
    if not renamed:
        return abstract_state, {}
    target = {renamed.get(k, k): getattr(abstract_state, k) for k in names}
    return {k: v for k, v in target.items() if k is not None}, renamed


OFFSET_KEY = "loop_step_offset"  # added to the saved data state: loop step - data position


def data_state_problem(data_state) -> str | None:
    """What is wrong with a restored data state (see ``TrainIterator.get_state``), or None."""

    def is_int(x, low):
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    if not isinstance(data_state, dict):
        return f"a JSON object was expected, not {type(data_state).__name__}"
    if not is_int(data_state.get("step"), 0):
        return f"'step' must be an integer >= 0, not {data_state.get('step')!r}"
    if "batch_size" in data_state and not is_int(data_state["batch_size"], 1):
        return f"'batch_size' must be an integer >= 1, not {data_state['batch_size']!r}"
    if not is_int(data_state.get(OFFSET_KEY, 0), -(1 << 62)):
        return f"{OFFSET_KEY!r} must be an integer, not {data_state[OFFSET_KEY]!r}"
    return None


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with shardings) describing ``tree``, for restore targets."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


@jax.jit
def _finite_flags(tree):
    return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def non_finite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` that hold NaN or Inf."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    floats = [(p, x) for p, x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    if not floats:
        return []
    flags = jax.device_get(_finite_flags([x for _, x in floats]))
    return [_dotted(p) for (p, _), ok in zip(floats, flags, strict=True) if not ok]


def _dotted(path) -> str:
    """'params.blocks.mlp.wi.kernel' for a key path (orbax names arrays the same way)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _mismatch(path: str, abstract_state) -> str | None:
    """How the saved arrays differ from ``abstract_state`` (names, shapes, dtypes), or None."""
    try:
        meta = ocp.StandardCheckpointHandler().metadata(epath.Path(path) / "state")
        saved = ocp.tree.to_flat_dict(meta)
    except Exception:  # unreadable metadata: restore reports the checkpoint as corrupt
        return None
    wanted = ocp.tree.to_flat_dict(abstract_state)
    name = ".".join
    spec = lambda x: f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    problems = []
    differ = [k for k in wanted if k in saved and spec(saved[k]) != spec(wanted[k])]
    if differ:
        k = differ[0]
        problems.append(f"{name(k)} is {spec(saved[k])} there but {spec(wanted[k])} here")
    missing = [k for k in wanted if k not in saved]
    if missing:
        problems.append(f"it lacks {name(missing[0])}")
    extra = [k for k in saved if k not in wanted]
    if extra:
        problems.append(f"it holds {name(extra[0])}, which this config has no use for")
    count = len(differ) + len(missing) + len(extra)
    if count > len(problems):
        problems.append(f"{count - len(problems)} more arrays differ")
    return ", ".join(problems) or None


@contextlib.contextmanager
def _muted_background_errors():
    """Silence tracebacks that orbax's I/O threads print while a restore reads, for its length.

    After the first unreadable array every other pending read fails too, each printing a
    multi-page TensorStore traceback from a background thread; the one exception we re-raise
    already says what is wrong. The caller that caught a failure (and dropped the exception,
    whose frames hold orbax's tasks) calls the yielded ``failed()``: it frees those tasks while
    still muted. On leaving, the hooks are the caller's again. Reads still in flight when a
    restore gives up may later report asyncio's 'Event loop is closed' through
    ``sys.unraisablehook``; the command line drops those (``fp8jax.cli``).
    """
    hooks = sys.unraisablehook, threading.excepthook
    sys.unraisablehook = threading.excepthook = lambda *args: None
    try:
        yield _collect_orphans
    finally:
        sys.unraisablehook, threading.excepthook = hooks


def _collect_orphans() -> None:
    """Let the reads a failed restore left in flight finish, and free them, quietly.

    Freeing orbax's abandoned tasks and coroutines makes asyncio log 'Task exception was never
    retrieved' and Python report each unawaited coroutine; done here, under the muted hooks and
    with asyncio's logger off, rather than at interpreter exit after the one-line error.
    """
    asyncio_log = pylogging.getLogger("asyncio")
    disabled, asyncio_log.disabled = asyncio_log.disabled, True
    try:
        for _ in range(3):
            time.sleep(0.05)  # local reads finish in milliseconds
            gc.collect()
    finally:
        asyncio_log.disabled = disabled
