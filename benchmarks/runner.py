"""The shared runner of fp8jax's benchmarks: run specs, config overrides, child processes, JSON.

A run spec is ``config:level[:options]``, options joined by ``+``: ``gpt_1b3:O1``,
``gpt_1b3:O0:model.scan_layers=False+plain``; ``config@variant`` passes the variant to the
config's ``get_config`` (``qwen3_30b_a3b@1gpu:O2``, as ``--config ...qwen3_30b_a3b.py:1gpu``).
``key=value`` options, and every ``--set key=value`` flag, are config overrides applied
through ml_collections: the field must exist (a typo is a one-line error, not a new field) and
the value is parsed for the field's type. Other options are flags the benchmark reads
(``plain``). The order, last wins: the config file, the level, the benchmark's own settings
(``--quick``, ``--mesh``, ...), the run's options, ``--set``.

A benchmark that needs a fresh process per measurement (its own compiles and peak memory)
calls ``drive``: the parent reruns its own command with ``--child RUN`` once per run, the child
prints one JSON record after ``MARK``, the parent writes it to ``<out>/<name>_<run>.json``
and the benchmark prints a short ``table``. The trainer is reached through ``build`` only.

Importing this module imports neither jax, fp8jax nor ml_collections (``torch_reference`` runs
without them); the functions that need them import them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

MARK = "@@RESULT "  # prefix of the JSON record lines a child prints for its parent

# --quick: every model shrunk to a CPU smoke test.
QUICK = {
    "model.num_layers": 2,
    "model.d_model": 64,
    "model.num_heads": 2,
    "model.num_kv_heads": 2,
    "model.d_ff": 128,
    "model.vocab_size": 256,
    "model.max_len": 32,
    "seq_len": 32,
    "batch_size": 4,
    "model.dtype": "float32",
    "model.attention_impl": "xla",
}


def _config_error(message: str) -> Exception:
    from fp8jax import errors

    return errors.ConfigError(message)


def parse_run(run: str) -> tuple[str, str, list[str]]:
    """'gpt_1b3:O1[:model.scan_layers=False+plain]' -> (config, level, options)."""
    parts = run.split(":", 2)  # option values may hold ':' (paths)
    if len(parts) < 2 or not all(parts[:2]):
        raise ValueError(f"run {run!r}: expected config:level[:options]")
    return parts[0], parts[1], (parts[2].split("+") if len(parts) > 2 else [])


def step_settings(quick: bool = False, batch: int = 0, mesh: str = "-1,1,1") -> dict[str, Any]:
    """The settings of a train-step benchmark: the mesh ('data,fsdp,tensor' sizes, -1: the
    rest), ``batch`` (0: the config's) and, with ``quick``, the ``QUICK`` shapes."""
    data, fsdp, tensor = (int(v) for v in mesh.split(","))
    settings: dict[str, Any] = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
    if batch:
        settings["batch_size"] = batch
    if quick:
        settings.update(QUICK)
    return settings


def _set(config, values: Mapping[str, Any], what: Callable[[str], str]) -> None:
    """Set dotted ``values`` on ``config`` through ml_collections, the config locked so that an
    unknown field raises instead of being added; ``what(key)`` names the source in errors."""
    from ml_collections.config_flags import config_path

    locked = config.is_locked
    config.lock()
    try:
        for key, value in values.items():
            try:
                config_path.get_type(key, config)
            except (AttributeError, KeyError, IndexError, ValueError):
                raise _config_error(f"unknown config field {key!r} in {what(key)}") from None
            try:
                config.update_from_flattened_dict({key: value})
            except (TypeError, ValueError, KeyError) as e:
                raise _config_error(f"{what(key)}: {e}") from e
    finally:
        if not locked:
            config.unlock()


def _value(config, key: str, text: str):
    """``text`` for a str field; else a Python literal if it parses as one (else ``text``)."""
    from ml_collections.config_flags import config_path

    try:
        if config_path.get_type(key, config) is str:
            return text
    except (AttributeError, KeyError, IndexError, ValueError):
        return text  # unknown: _set reports it
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as bfloat16


def apply_overrides(config, assignments: Sequence[str]) -> None:
    """Apply ``key=value`` overrides (``model.scan_layers=False``) to an ml_collections config.

    Raises ``fp8jax.errors.ConfigError`` (one line) for an unknown field or a value of the
    wrong type; the config gains no field either way.
    """
    for text in assignments:
        if "=" not in text:
            raise _config_error(f"override {text!r}: expected key=value")
        key, raw = text.split("=", 1)
        _set(config, {key: _value(config, key, raw)}, lambda _k, t=text: f"override {t!r}")


def load(
    run: str,
    sets: Sequence[str] = (),
    settings: Mapping[str, Any] | None = None,
    flags: Collection[str] = (),
):
    """The ConfigDict of one run spec: config file, level, ``settings``, options, ``sets``.

    ``flags``: the bare options the benchmark knows (any other is an error).
    """
    from fp8jax.trainer import loop

    name, level, options = parse_run(run)
    unknown = [o for o in options if "=" not in o and o not in flags]
    if unknown:
        known = ", ".join(sorted(flags)) or "none"
        raise _config_error(f"run {run!r}: unknown option(s) {unknown} (flags here: {known})")
    name, _, variant = name.partition("@")
    config = loop.load_config(name, variant or None)
    _set(config, {"fp8.level": level, **(settings or {})}, lambda k: f"run {run!r} ({k})")
    apply_overrides(config, [o for o in options if "=" in o])
    apply_overrides(config, sets)
    return config


def build(config, plain: bool = False):
    """The trainer's ``loop.Setup`` for a ConfigDict: parsed once, then ``loop.setup``.

    ``plain``: ``train_step`` is the same pure step under a bare ``jax.jit`` (no shardings, no
    mesh), the unsharded reference for the sharded path's overhead.
    """
    import jax

    from fp8jax import spec
    from fp8jax.trainer import loop
    from fp8jax.trainer import step as step_lib

    run = spec.parse(config)
    s = loop.setup(run)
    if plain:
        fn = step_lib.make_train_step(s.model, s.tx, s.run, mesh=None)
        s = dataclasses.replace(s, train_step=jax.jit(fn, donate_argnums=0))
    return s


def parser(doc: str | None, child: bool = True, sets: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the shared flags: ``--out``, and ``--child``, ``--set``."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    out = os.environ.get("OUT") or "bench_out"
    p.add_argument("--out", default=out, help="output folder (default: $OUT, else bench_out)")
    if child:  # set by the parent on the child processes it starts
        p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if sets:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="config override for every run, e.g. --set model.scan_layers=False (repeatable)",
        )
    return p


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str] | None = None):
    """Parse, keep the arguments as ``.argv`` (children rerun them) and create ``--out``."""
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.out, exist_ok=True)  # a fresh $OUT subfolder is fine
    return a


def command(name: str, *args: str) -> list[str]:
    """``python -m benchmarks.<name> args...`` with this interpreter."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def emit(record: dict) -> None:
    """Print one record for the parent (in a child process)."""
    print(MARK + json.dumps(record), flush=True)


@dataclasses.dataclass
class Child:
    """What a child process left: its records, its stderr lines, and 'ok', 'exit N' or 'killed'."""

    records: list[dict]
    stderr: list[str]
    status: str


def spawn(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = False,
    on_record: Callable[[dict], None] | None = None,
) -> Child:
    """Run ``cmd`` to its end (killed after ``timeout`` s); collect the ``MARK`` records.

    ``echo``: pass its other output through as it comes (a long child shows its progress).
    """
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
        env=None if env is None else dict(env),
    )
    stderr: list[str] = []

    def drain():
        for line in proc.stderr:
            stderr.append(line.rstrip("\n"))
            if echo:
                sys.stderr.write(line)
                sys.stderr.flush()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    killed = threading.Event()
    timer = None
    if timeout:
        timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
        timer.start()
    records = []
    try:
        for line in proc.stdout:
            if line.startswith(MARK):
                records.append(json.loads(line[len(MARK) :]))
                if on_record is not None:
                    on_record(records[-1])
            elif echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    reader.join()
    status = f"killed after {timeout:.0f} s" if killed.is_set() else f"exit {rc}" if rc else "ok"
    return Child(records, stderr, status)


def run_child(
    cmd: Sequence[str], run: str, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> dict:
    """One child's record, or an error row for ``run``.

    A failed child's row names, first, its compile line with XLA's memory needs, then the
    exception and its last lines on stderr (its progress: a child cut by ``timeout`` has no
    exception).
    """
    child = spawn(cmd, env, timeout)
    if child.records:
        return child.records[0]
    lines = [ln for ln in child.stderr if ln.strip()]
    if child.status.startswith("killed"):
        lines.append(f"timed out after {timeout} s")
    # The exception's own line (XLA appends stack locations after it), then the last lines.
    raised = [ln for ln in lines if ln.split(":")[0].rsplit(".", 1)[-1].endswith("Error")][:1]
    compiled = [ln for ln in lines if "compiled in" in ln and "XLA temp" in ln][-1:]
    tail = raised + [ln for ln in lines[-2:] if ln not in raised + compiled]
    return {"run": run, "error": " | ".join(compiled + tail or ["?"])[:600]}


def safe_name(run: str) -> str:
    """A run spec as a file name: 'gpt_1b3:O1:model.x=True' -> 'gpt_1b3_O1_model-x-True'."""
    return run.replace(":", "_").replace("=", "-").replace("+", "_").replace(".", "-")


def write_json(out: str, stem: str, data) -> str:
    """Write ``data`` as ``<out>/<stem>.json``; return the path."""
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def drive(
    name: str,
    args: argparse.Namespace,
    measure: Callable[[str, argparse.Namespace], dict],
    runs: Sequence[str],
    *,
    check: Callable[[str], object] | None = None,
    env: Callable[[str], Mapping[str, str]] | None = None,
    timeout: float | None = None,
    stem: str | None = None,
) -> list[dict] | None:
    """Measure each run in a child process of its own; in the child, measure its run.

    The parent first calls ``check(run)`` on every run (a bad config override stops it with a
    one-line error before any child starts), then per run reruns its own command with
    ``--child=RUN`` (environment ``env(run)``), writes the record or error row to
    ``<out>/<stem or name>_<run>.json`` and prints it. Returns the rows; None in a child.
    """
    if args.child is not None:
        emit(measure(args.child, args))
        return None
    for run in runs:
        try:
            if check is not None:
                check(run)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    rows = []
    for run in runs:
        cmd = command(name, *args.argv, f"--child={run}")
        rows.append(run_child(cmd, run, env(run) if env else None, timeout))
        write_json(args.out, f"{stem or name}_{safe_name(run)}", rows[-1])
        print(json.dumps(rows[-1]), flush=True)
    return rows


# The throughput columns of a train-step table (benchmarks.step, benchmarks.torch_reference).
STEP_COLUMNS = {
    "ms": lambda r: f"{r['step_ms']:.1f}",
    "tok/s": lambda r: f"{r['tokens_per_s']:.0f}",
    "pipe ms": lambda r: f"{r['step_ms_pipelined']:.1f}",
    "pipe tok/s": lambda r: f"{r['tokens_per_s_pipelined']:.0f}",
    "MFU": lambda r: f"{r['mfu']:.1%}",
}


def table(rows: Sequence[dict], columns: Mapping[str, Callable[[dict], object]], first="run"):
    """Rows as aligned text, a column per ``columns`` entry (header -> cell of a row).

    A cell whose function raises KeyError, TypeError, ValueError or IndexError (a missing or
    None field) prints '-'; a row with an ``error`` prints it instead of cells.
    """

    def cell(fn, r):
        try:
            return str(fn(r))
        except (KeyError, TypeError, ValueError, IndexError):
            return "-"

    ok = {id(r): [cell(f, r) for f in columns.values()] for r in rows if "error" not in r}
    names = [str(r.get(first, "?")) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in ok.values()]) for i, h in enumerate(columns)]
    w0 = max([len(first), *map(len, names)])

    def line(name: str, cells) -> str:
        padded = (c.rjust(w) for c, w in zip(cells, widths, strict=True))
        return "  ".join([name.ljust(w0), *padded])

    out = [line(first, list(columns))]
    for name, r in zip(names, rows, strict=True):
        error = f"{name.ljust(w0)}  ERROR {str(r.get('error'))[:100]}"
        out.append(line(name, ok[id(r)]) if id(r) in ok else error)
    return "\n".join(out)
