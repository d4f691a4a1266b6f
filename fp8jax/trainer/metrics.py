"""Console, TensorBoard and metrics.jsonl logging of a run; FP8 health summaries.

``RunLog`` is what the loop writes through; ``NonFiniteGuard`` watches the skipped steps.
"""

from __future__ import annotations

import contextlib
import json
import logging as pylogging
import os
import sys
import time

import jax
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from fp8jax import errors
from fp8jax.diagnostics import memory
from fp8jax.nn import state as fp8_state

__all__ = [
    "HEALTH_WARN_SHARE",
    "MOE_DROP_WARN_SHARE",
    "NonFiniteGuard",
    "RunLog",
    "Writer",
    "drop_records_after",
    "fmt",
    "fp8_health",
    "fp8_worst",
    "log_memory",
    "logs_above_bar",
    "quiet_library_logs",
]


class _QuietLibraries:
    """Drop INFO records from orbax/grain (they log every save and read at INFO)."""

    def filter(self, record) -> bool:
        noisy = any(n in record.pathname for n in ("/orbax/", "/grain/"))
        if noisy and record.exc_info:  # a failed background write: its one-line error follows
            record.exc_info = record.exc_text = None
        return record.levelno >= 30 or not noisy


def quiet_library_logs():
    """Keep the console readable: our INFO lines, libraries' warnings only."""
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
        handler.addFilter(_QuietLibraries())


class _AboveBar(pylogging.Handler):
    """Writes records with ``tqdm.write``, so they print above an open progress bar."""

    def __init__(self, like: pylogging.Handler):
        super().__init__(like.level)
        self.like = like
        self.filters = list(like.filters)

    def emit(self, record) -> None:
        try:
            tqdm.write(self.like.format(record), file=sys.stderr)
        except Exception:  # as logging.Handler.emit: a broken record must not stop the run
            self.handleError(record)


@contextlib.contextmanager
def logs_above_bar():
    """While open, absl's console log lines print above the tqdm bar instead of through it."""
    root, absl_handler = pylogging.getLogger(), logging.get_absl_handler()
    if absl_handler not in root.handlers:  # logging set up some other way: leave it alone
        yield
        return
    handler = _AboveBar(absl_handler)
    root.removeHandler(absl_handler)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.addHandler(absl_handler)


class Writer:
    """TensorBoard scalars (tensorboardX) under ``<workdir>/tensorboard``; no-op if disabled."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._w = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._w = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def scalars(self, step: int, values: dict):
        """Write a dict of scalars at ``step``."""
        if self._w is None:
            return
        for k, v in values.items():
            v = np.asarray(jax.device_get(v))
            if v.size == 1 and np.issubdtype(v.dtype, np.number) and np.isfinite(v):
                self._w.add_scalar(k, float(v), step)
        self._w.flush()

    def close(self):
        """Flush and close the event file."""
        if self._w is not None:
            self._w.close()


def fmt(values: dict) -> str:
    """``k=v`` pairs with 4 significant digits for floats; strings as they are."""
    parts = []
    for k, v in values.items():
        if isinstance(v, str):
            parts.append(f"{k}={v}")
            continue
        v = np.asarray(jax.device_get(v))
        parts.append(f"{k}={float(v):.4g}" if v.size == 1 else f"{k}={v.tolist()}")
    return " ".join(parts)


def log_memory(compiled) -> dict[str, int] | None:
    """Log the compiled train step's memory analysis before step 0; return it (or None)."""
    mem = memory.compiled_memory(compiled)
    if mem:
        parts = ", ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in mem.items())
        logging.info("train step memory: %s", parts)
    return mem


def _stat_leaves(stats):
    """``(name, kind, values[layers])`` per sown health leaf; ``kind`` 'saturated' or 'flushed'.

    ``sow`` stores each value as a one-element tuple, so a leaf's path ends in that tuple's
    index; stacked (``nn.scan``) layers give one value per layer.
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        keys = [k for k in path if hasattr(k, "key")]
        kind = next(
            (s for s in ("saturated", "flushed") if keys and str(keys[-1].key).endswith(f"_{s}")),
            None,
        )
        name = "/".join(str(k.key) for k in keys)
        out.append((name, kind, np.asarray(jax.device_get(leaf), np.float64).reshape(-1)))
    return out


def fp8_health(state, stats) -> dict:
    """Per-layer amax, scale and saturation / flush-to-zero shares as flat scalars.

    Stacked layers get a ``_<layer>`` suffix: ``fp8_stats/blocks/mlp/wi/x_saturated_1``.
    """
    out = {f"fp8/{k}": float(v) for k, v in jax.device_get(fp8_state.summarize(state.fp8)).items()}
    for name, _, values in _stat_leaves(stats):
        if values.size == 1:
            out[f"fp8_stats/{name}"] = float(values[0])
        else:
            out.update({f"fp8_stats/{name}_{i}": float(v) for i, v in enumerate(values)})
    return out


def fp8_worst(stats) -> dict:
    """The largest saturated and flushed shares over every FP8 operand, and where they are.

    ``{'fp8_max_saturated': share, 'fp8_max_saturated_at': 'blocks/mlp/.../x_saturated_1',
    'fp8_max_flushed': ..., 'fp8_max_flushed_at': ...}``; a NaN share stays NaN (it wins).
    """
    leaves = _stat_leaves(stats)
    out = {}
    for kind in ("saturated", "flushed"):
        shares = [
            (float(v), name if values.size == 1 else f"{name}_{i}")
            for name, k, values in leaves
            if k == kind
            for i, v in enumerate(values)
        ]
        nan = [s for s in shares if np.isnan(s[0])]
        worst, where = nan[0] if nan else max(shares, default=(0.0, ""))
        out[f"fp8_max_{kind}"], out[f"fp8_max_{kind}_at"] = worst, where
    return out


class NonFiniteGuard:
    """Warns about each skipped step; raises NonFiniteLossError after ``max_bad`` in a row."""

    def __init__(self, max_bad: int):
        self.max_bad, self.checked = max_bad, 0

    def check(self, step: int, metrics) -> None:
        """Read ``metrics``' count of consecutive skipped steps (once per step)."""
        if step <= self.checked:
            return
        self.checked = step
        bad = int(jax.device_get(metrics["bad_steps"]))
        if bad == 0:
            return
        loss, gnorm = float(metrics["loss"]), float(metrics["grad_norm"])
        lr = float(metrics["learning_rate"])
        logging.warning(
            "step %d: non-finite loss, gradients or learning rate (loss=%s, grad_norm=%s, "
            "learning_rate=%s): update skipped, %d in a row, %d in total",
            step,
            loss,
            gnorm,
            lr,
            bad,
            int(metrics["skipped_steps"]),
        )
        if bad >= self.max_bad:
            raise errors.NonFiniteLossError(
                f"{bad} consecutive non-finite steps ({step - bad + 1}..{step}, last loss={loss}, "
                f"grad_norm={gnorm})"
            )


# A larger share of an operand's FP8 values clipped or flushed than these is logged as a
# warning. Clipped: delayed scaling keeps healthy operands far below 0.1% (a clip only while an
# amax grows). Flushed: SwiGLU's product puts values at zero's doorstep by construction, and with
# its amax at E4M3's max 0.07-0.18% of the down projection's input still fall below the smallest
# subnormal (moe_tiny and its dense twin at O1, 200 steps), carrying under 3e-6 of the amax
# each; a scale 16x too small (fp8.margin=4) flushes 1.4%, an outlier-set one most values.
HEALTH_WARN_SHARE = {"saturated": 1e-3, "flushed": 1e-2}


# A larger share of the token-expert pairs that 'capacity' dispatch drops than this is logged as
# a warning: past it, most of each MoE layer's input skips its experts.
MOE_DROP_WARN_SHARE = 0.5


class RunLog:
    """Metrics to the console, TensorBoard and ``<workdir>/metrics.jsonl`` (a JSON per line).

    ``num_steps`` sizes the progress bar, ``tokens_per_step`` turns step times into tokens/s.
    """

    def __init__(self, workdir: str, num_steps: int, tokens_per_step: int, step: int):
        main = jax.process_index() == 0
        self.writer = Writer(workdir, enabled=main)
        # One os.write per record on an O_APPEND file: a kill leaves whole lines only.
        path = os.path.join(workdir, "metrics.jsonl")
        if main:
            drop_records_after(path, step)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if main else None
        self.bar = tqdm(total=num_steps, initial=step, desc="train", unit="step", disable=not main)
        self._redirect = contextlib.ExitStack()
        if main:
            self._redirect.enter_context(logs_above_bar())
        self.tokens_per_step = tokens_per_step
        self.last_step, self.t_last = step, time.perf_counter()
        self.summary = {}
        self.seen = set()

    def train(self, step: int, metrics) -> None:
        """Log a train step's metrics with the tokens/s since the last call."""
        row = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        row["tokens_per_s"] = (
            (step - self.last_step) * self.tokens_per_step / max(now - self.t_last, 1e-9)
        )
        self.last_step, self.t_last = step, now
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        self._emit(step, "train", row)
        self.summary.update({f"train_{k}": v for k, v in row.items()})
        if row.get("moe_dropped", 0.0) > MOE_DROP_WARN_SHARE:
            logging.warning(
                "step %d: MoE capacity dispatch dropped %.3g of the token-expert pairs (more than "
                "%.2g): those tokens skip their experts; raise model.moe.capacity_factor or set "
                "model.moe.dispatch='dropless'",
                step,
                row["moe_dropped"],
                MOE_DROP_WARN_SHARE,
            )

    def first(self, what: str) -> None:
        """Log ``what`` the first time it is seen (a compile the console would otherwise hide)."""
        if what not in self.seen:
            self.seen.add(what)
            logging.info("first %s", what)

    def eval(self, step: int, values: dict) -> None:
        """Log validation metrics."""
        self._emit(step, "eval", values)
        self.summary.update(values)

    def fp8(self, step: int, health: dict, worst: dict) -> None:
        """Log FP8 health (``fp8_health``, ``fp8_worst``); warn on a large clipped share."""
        self.writer.scalars(step, health)
        self.writer.scalars(step, worst)  # the two shares; the "_at" names are not scalars
        logging.info("step %d: %s", step, fmt(worst))
        for kind in ("saturated", "flushed"):
            share = worst[f"fp8_max_{kind}"]
            if not share <= HEALTH_WARN_SHARE[kind]:  # NaN too
                logging.warning(
                    "step %d: %.3g of %s's FP8 values %s (more than %.2g): its scale is off or "
                    "an outlier sets it; see fp8_stats/* in TensorBoard (fp8.margin, "
                    "fp8.history_len, fp8.recipe='current')",
                    step,
                    share,
                    worst[f"fp8_max_{kind}_at"],
                    "clip at the format max" if kind == "saturated" else "flush to zero",
                    HEALTH_WARN_SHARE[kind],
                )
        self._append({"step": step, **worst})

    def _emit(self, step: int, prefix: str, values: dict) -> None:
        self.writer.scalars(step, {f"{prefix}/{k}": v for k, v in values.items()})
        logging.info("step %d: %s", step, fmt(values))
        self._append({"step": step, **values})

    def _append(self, record: dict) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        """Close the bar, the event file and metrics.jsonl."""
        self._redirect.close()
        self.bar.close()
        self.writer.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def drop_records_after(path: str, step: int) -> int:
    """Remove the records of ``path`` (metrics.jsonl) past ``step``: a resume redoes those steps.

    A run killed or stopped after its last checkpoint logged steps that the resume runs again;
    without this the file would hold them twice. Rewritten atomically; returns how many went.
    """
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return 0

    def past(line: bytes) -> bool:
        try:
            return json.loads(line).get("step", 0) > step
        except (ValueError, AttributeError, TypeError):  # not a record: keep it as it is
            return False

    kept = [line for line in lines if not past(line)]
    if len(kept) < len(lines):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        logging.info("dropped %d records of %s past step %d", len(lines) - len(kept), path, step)
    return len(lines) - len(kept)
