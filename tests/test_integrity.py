"""Work is never lost and nothing non-finite passes: the work-dir lock, checkpoint checksums,
leftovers of killed runs, non-finite imports and exports, non-text corpora.

Every train.py run here is configs/tiny.py shrunk to one 64-wide layer on a 60 kB slice of the
shipped corpus; the runs that train resume one 4-step work dir (``trained``) shared by the
module, copied per test. The runs refused before training take seconds.
"""

import errno
import gzip
import hashlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from fp8jax import checksums, errors
from fp8jax.hf import io as hf_io
from fp8jax.trainer import metrics, workdir_lock

from fp8_testing import (
    TINY_RUN,
    novel,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = {
    **TINY_RUN,
    "num_train_steps": 4,
    "warmup_steps": 1,
    "checkpoint_every_steps": 2,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A folder for the module: the corpus and the JAX compilation cache."""
    root = tmp_path_factory.mktemp("integrity")
    (root / "corpus.txt").write_text(novel("pride-and-prejudice", 60_000))
    return root


@pytest.fixture(scope="module")
def env(base):
    """Environment of train.py subprocesses: CPU, one compilation cache for all of them, most
    XLA optimisations off (compiles dominate; no check here is numerical)."""
    e = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    e.update(
        JAX_PLATFORMS="cpu",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1",
        PYTHONPATH=str(ROOT),
        JAX_COMPILATION_CACHE_DIR=str(base / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return e


def train(workdir, base, env, **overrides) -> subprocess.CompletedProcess:
    """``python train.py --config configs/tiny.py --workdir=WORKDIR`` with ``SMALL``."""
    values = {**SMALL, "data.path": str(base / "corpus.txt"), **overrides}
    args = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.py",
        f"--workdir={workdir}",
        *[f"--config.{k}={v}" for k, v in values.items()],
    ]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def one_error_line(proc) -> str:
    """The single 'error: ...' line of a refused run (exit 2, no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), lines[-5:]
    assert sum(line.startswith("error: ") for line in lines) == 1, lines[-5:]
    return lines[-1]


@pytest.fixture(scope="module")
def trained(base, env):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    workdir = base / "trained"
    proc = train(workdir, base, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@pytest.fixture
def workdir(trained, tmp_path):
    """A copy of ``trained`` for one test to change."""
    copy = tmp_path / "work"
    shutil.copytree(trained, copy)
    return copy


def snapshot(workdir) -> dict:
    """Every file under ``workdir``: size, mtime and content hash."""
    out = {}
    for p in sorted(pathlib.Path(workdir).rglob("*")):
        if p.is_file():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(workdir))] = (p.stat().st_size, p.stat().st_mtime_ns, digest)
    return out


def train_steps(workdir) -> list[int]:
    """The steps of the training records of ``<workdir>/metrics.jsonl``, in file order."""
    import json

    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- the work-dir lock -----------------------------------------------------------------------

HOLD = """import sys, time
from fp8jax.trainer import workdir_lock
with workdir_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_second_process_on_a_live_workdir_is_refused_and_a_killed_ones_lock_is_not(
    workdir, base, env
):
    """A live process holds the work dir's lock (as a running train.py does): train.py on the
    same --workdir exits 2 with one line naming that process (pid, host, start time) and
    changes nothing there. Once the holder is killed (kill -9, so it never unlocks), train.py
    resumes with exit 0 and the lock file names the new process."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(workdir)
        line = one_error_line(train(workdir, base, env, num_train_steps=6))
        assert f"is in use by pid {holder.pid} on host {socket.gethostname()}, started" in line
        assert "pass another --workdir" in line
        assert snapshot(workdir) == before
    finally:
        holder.kill()
        holder.wait()
    proc = train(workdir, base, env, num_train_steps=6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert workdir_lock.owner(workdir).startswith("pid ")
    assert f"pid {holder.pid} " not in workdir_lock.owner(workdir)
    assert train_steps(workdir) == list(range(1, 7))


def test_lock_is_exclusive_in_process_and_released_on_exit(tmp_path):
    """Within one process: a second ``hold`` while the first is open is refused; after the
    first closes, a new one succeeds and records this process."""
    with workdir_lock.hold(tmp_path):
        assert workdir_lock.owner(tmp_path).startswith(f"pid {os.getpid()} on host")
        with pytest.raises(workdir_lock.WorkdirBusyError, match=f"pid {os.getpid()}"):
            with workdir_lock.hold(tmp_path):
                pass
    with workdir_lock.hold(tmp_path):
        pass


def test_ctrl_c_in_a_command_line_is_one_line(capsys, monkeypatch):
    """A Ctrl-C in generate, evaluate, prepare or lm_eval (``cli.user_errors``): one line and
    exit 130 (as a shell reports a Ctrl-C), not a traceback."""
    from fp8jax import cli

    monkeypatch.delenv("FP8JAX_DEBUG", raising=False)
    try:
        with cli.user_errors():
            raise KeyboardInterrupt
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:  # through to the interpreter: a traceback
        code = "KeyboardInterrupt"
    assert code == 130
    assert capsys.readouterr().err == "interrupted: Ctrl-C\n"


def test_work_dir_that_cannot_be_written_is_one_line(tmp_path):
    """A work dir whose lock file cannot be opened for writing (a read-only mount, another
    user's folder; here a folder in its place): a one-line ConfigError naming the work dir."""
    (tmp_path / workdir_lock.LOCK_FILE).mkdir()
    with pytest.raises(errors.ConfigError) as info:
        with workdir_lock.hold(tmp_path):
            pass
    assert str(info.value) == (
        f"cannot write in --workdir {tmp_path} (Is a directory); make it writable or pass a "
        "folder you can write"
    )


# --- checkpoint checksums --------------------------------------------------------------------


def _flip_a_bit(workdir, step: int) -> pathlib.Path:
    """Flip one bit in the middle of the biggest array file of ``step``, keeping its mtime."""
    state = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
    biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    stat = biggest.stat()
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x10
    biggest.write_bytes(bytes(data))
    os.utime(biggest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return biggest


def test_every_checkpoint_records_checksums_that_verify(trained):
    """Each kept step has a checksums.json covering every array file; they verify."""
    for step in (2, 4):
        step_dir = trained / "checkpoints" / str(step)
        assert (step_dir / checksums.CHECKSUMS).is_file()
        assert checksums.verify(str(step_dir)) is None


def test_checksums_cover_every_block_of_a_file_and_read_whole_file_manifests(tmp_path, monkeypatch):
    """A flipped bit in any block of a file split into blocks is named; a step recorded with
    one CRC-32 per file (no ``block_bytes``) verifies against zlib's CRC of the whole file."""
    import json
    import zlib

    monkeypatch.setattr(checksums, "BLOCK_BYTES", 1000)  # 2500 bytes: blocks of 1000, 1000, 500
    state = tmp_path / checksums.ARRAYS
    (state / "d").mkdir(parents=True)
    data = np.random.default_rng(0).bytes(2500)
    (state / "d" / "a").write_bytes(data)
    (state / "empty").write_bytes(b"")
    checksums.write(str(tmp_path))
    manifest = json.loads((tmp_path / checksums.CHECKSUMS).read_text())
    assert [len(v) for _, v in sorted(manifest["files"].items())] == [3, 1]
    assert checksums.verify(str(tmp_path)) is None
    for offset in (10, 1500, 2499):  # the first, the middle and the last block
        flipped = bytearray(data)
        flipped[offset] ^= 0x04
        (state / "d" / "a").write_bytes(bytes(flipped))
        assert "d/a differs" in checksums.verify(str(tmp_path))
    whole = {"state/d/a": f"{zlib.crc32(data):08x}", "state/empty": f"{zlib.crc32(b''):08x}"}
    (tmp_path / checksums.CHECKSUMS).write_text(json.dumps(dict(algorithm="crc32", files=whole)))
    assert "d/a differs" in checksums.verify(str(tmp_path))  # still flipped at 2499
    (state / "d" / "a").write_bytes(data)
    assert checksums.verify(str(tmp_path)) is None


def test_flipped_bit_in_a_checkpoint_is_refused_naming_the_older_step(workdir, base, env):
    """Flips one bit of an array file of the latest checkpoint (same size and mtime): the
    resume exits 2 with one line naming the step, the changed file and the fallback to step 2,
    and changes nothing."""
    changed = _flip_a_bit(workdir, 4)
    before = snapshot(workdir)
    line = one_error_line(train(workdir, base, env, num_train_steps=6))
    assert "checkpoints/4 changed on disk since it was saved (the CRC-32 of" in line, line
    assert changed.name in line and "to resume from step 2" in line, line
    assert snapshot(workdir) == before


def test_hf_load_and_export_of_a_changed_work_dir_are_refused_naming_the_file(
    workdir, tmp_path, capsys
):
    """``hf.load`` of a work dir, ``hf.export`` and ``python -m fp8jax.hf.export_cli`` verify the
    latest step's checksums: after one flipped bit each refuses in one line naming the step
    and the changed file, and no output folder is made."""
    from fp8jax.hf.export_cli import main as export_main

    hf_io.load(workdir)  # intact: it loads
    changed = _flip_a_bit(workdir, 4)
    step = workdir / "checkpoints" / "4"
    expected = f"checkpoint {step} changed on disk since it was saved (the CRC-32 of state/"
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.load(workdir)
    assert expected in str(info.value) and changed.name in str(info.value), info.value
    out = tmp_path / "out"
    with pytest.raises(errors.CheckpointError, match=changed.name):
        hf_io.export(workdir, out)
    assert export_main([str(workdir), str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), lines
    assert changed.name in lines[0] and not out.exists()


# --- a full disk -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, trained):
    """A tmpfs with room for the work dir's caches and logs and about 1.5 checkpoint steps."""
    mount = tmp_path / "disk"
    mount.mkdir()
    step_bytes = sum(
        p.stat().st_size for p in (trained / "checkpoints" / "2").rglob("*") if p.is_file()
    )
    rest = sum(
        p.stat().st_size for p in trained.rglob("*") if p.is_file() and "checkpoints" not in p.parts
    )
    size = rest + int(1.5 * step_bytes) + (256 << 10)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_stops_at_the_first_failed_save_keeping_the_last_checkpoint(
    small_disk, base, env
):
    """The work dir on a disk with room for one checkpoint step (a small tmpfs): the save of
    step 4 fails, and the run exits 2 with one line naming the step, the directory, the size of
    a step and the fix, no traceback; step 2 stays, complete and verified, and the partial
    step 4 is gone."""
    workdir = small_disk / "work"
    proc = train(workdir, base, env, num_train_steps=8)
    line = one_error_line(proc)
    directory = workdir / "checkpoints"
    assert f"saving checkpoint step 4 in {directory} failed (no space left on device)" in line
    assert "a step takes about" in line and "resume from step 2" in line, line
    assert sorted(p.name for p in directory.iterdir()) == ["2"]
    assert checksums.verify(str(directory / "2")) is None


@pytest.fixture
def tiny_disk(tmp_path):
    """A 16 kB tmpfs: room for a work dir's lock, not for the corpus' token cache (~50 kB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_while_encoding_the_token_cache_is_one_line(tiny_disk, base, env):
    """The token cache does not fit on the work dir's disk: exit 2 with one line naming the
    work dir, the space the cache needs and the fix; no staging folder (nor new work dir)."""
    workdir = tiny_disk / "work"
    line = one_error_line(train(workdir, base, env))
    assert f"no space left on the device of {workdir} while writing the token cache" in line
    assert "it needs about" in line and "pass a --workdir on a disk with room" in line, line
    assert list(tiny_disk.iterdir()) == []


def test_token_cache_disk_full_estimates_the_space_and_leaves_nothing(
    base, tmp_path, monkeypatch, capsys
):
    """In-process, the cache's writes fail with ENOSPC after 8 kB: one line (exit 2) naming the
    work dir and the cache's size, estimated within 20% of the cache a full build writes; the
    staging folder ``tokens.tmp<pid>`` is removed and no ``tokens/`` is left. The same where the
    tokenizer, written after the cache is encoded, finds no space."""
    import errno
    import re

    from fp8jax import cli
    from fp8jax.trainer import data

    from fp8_testing import data_run

    run = data_run(base / "corpus.txt", 512, batch_size=2, seq_len=32)
    full = data.build(run, tmp_path / "room")
    cache = sum(p.stat().st_size for p in (tmp_path / "room" / "tokens").glob("*.bin"))
    assert cache == full.num_train_tokens * 2 + len(full.val_tokens) * 2  # uint16 ids

    class FullDisk:
        """A file whose writes fail once 8 kB are written, as on a full disk."""

        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, b):
            if self.written + len(b) > 8192:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(b)
            return self.fh.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(data, "open", lambda *a, **k: FullDisk(open(*a, **k)), raising=False)
    workdir = tmp_path / "full"
    with pytest.raises(SystemExit) as exit_info, cli.user_errors():
        data.build(run, workdir)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no space left on the device"), lines
    assert f"of {workdir} while writing the token cache (tokens.tmp{os.getpid()}" in lines[0]
    needed = float(re.search(r"needs about ([0-9.]+) MB", lines[0]).group(1)) * 1e6
    assert 0.8 * cache <= needed <= 1.2 * cache, (needed, cache)
    assert not list(workdir.glob("tokens*")), list(workdir.iterdir())

    # The cache fits, the tokenizer written after it does not: one line too, nothing committed.
    from fp8jax import tokenizer as tokenizer_lib

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.undo()
    monkeypatch.setattr(tokenizer_lib, "save_cached", no_room)
    with pytest.raises(errors.DataError, match="while writing the tokenizer and the data record"):
        data.build(run, workdir)
    assert not list(workdir.glob("tokens*")), list(workdir.iterdir())


# --- leftovers -------------------------------------------------------------------------------


def test_resume_removes_dead_staging_and_repeats_no_metrics(workdir, base, env):
    """A run killed after step 4 but before its checkpoint (checkpoint 4 removed) left
    ``tokens.tmp<dead pid>/``: the resume from step 2 removes it (a live pid's staging stays),
    and metrics.jsonl holds steps 1..6 once each, not 3 and 4 twice."""
    shutil.rmtree(workdir / "checkpoints" / "4")
    dead = workdir / f"tokens.tmp{dead_pid()}"
    dead.mkdir()
    (dead / "train.bin").write_bytes(b"\0" * 1000)
    live = workdir / f"tokens.tmp{os.getpid()}"
    live.mkdir()
    assert train_steps(workdir) == [1, 2, 3, 4]
    proc = train(workdir, base, env, num_train_steps=6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint step 2" in proc.stderr
    assert not dead.exists() and live.is_dir()
    assert train_steps(workdir) == list(range(1, 7))


def test_drop_records_after_keeps_earlier_and_unparsed_lines(tmp_path):
    """``drop_records_after`` keeps records up to the step and lines that are not records."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "val_loss": 3}\nnot json\n{"step": 3}\n')
    assert metrics.drop_records_after(str(path), 2) == 1
    assert path.read_text() == '{"step": 1}\n{"step": 2, "val_loss": 3}\nnot json\n'
    assert metrics.drop_records_after(str(path), 2) == 0


# --- input that is not what it claims --------------------------------------------------------


def _binary(d: pathlib.Path) -> pathlib.Path:
    shutil.copyfile("/bin/ls", d / "ls.txt")
    return d / "ls.txt"


def _gzip_named_txt(d: pathlib.Path) -> pathlib.Path:
    (d / "book.txt").write_bytes(gzip.compress(b"It is a truth universally acknowledged. " * 500))
    return d / "book.txt"


def _truncated_gz(d: pathlib.Path) -> pathlib.Path:
    data = gzip.compress(("It is a truth universally acknowledged. " * 5000).encode())
    (d / "book.txt.gz").write_bytes(data[: len(data) // 2])
    return d / "book.txt.gz"


def _too_small(d: pathlib.Path) -> pathlib.Path:
    (d / "tiny.txt").write_text("It is a truth.\n")
    return d / "tiny.txt"


BAD_CORPUS = {
    # case: (make the corpus in a folder, fragments of the one-line error)
    "a copy of /bin/ls": (_binary, ["ls.txt is not a text file", "NUL bytes"]),
    "a .gz named .txt": (_gzip_named_txt, ["book.txt is not a text file"]),
    "a truncated .txt.gz": (_truncated_gz, ["book.txt.gz is not a complete gzip file"]),
    "too small for seq_len": (_too_small, ["fewer than seq_len+1"]),
}


@pytest.mark.parametrize("case", list(BAD_CORPUS))
def test_bad_corpus_is_one_line_and_leaves_no_new_workdir(case, base, env, tmp_path):
    """A corpus that is not text, a truncated gzip, or one too small: train.py on a new
    --workdir exits 2 with one line naming the file, and the work dir does not exist after."""
    make, fragments = BAD_CORPUS[case]
    path = make(tmp_path)
    workdir = tmp_path / "new" / "work"
    line = one_error_line(train(workdir, base, env, **{"data.path": str(path)}))
    for fragment in fragments:
        assert fragment in line, line
    assert not workdir.exists()


def test_workdir_that_is_a_file_is_one_line(base, env, tmp_path):
    """--workdir naming a file: exit 2, one line, the file unchanged."""
    path = tmp_path / "file"
    path.write_text("mine")
    line = one_error_line(train(path, base, env))
    assert f"--workdir {path} is a file, not a folder" in line
    assert path.read_text() == "mine"


def test_workdir_inside_another_runs_folders_is_one_line(trained, base, env, tmp_path):
    """--workdir inside another work dir's checkpoints/ (or tokens/, tensorboard/): exit 2,
    one line naming that run, its folder unchanged; a plain subfolder of a work dir, or a folder
    named tokens/ outside one, is a work dir like any other."""
    from fp8jax import provenance

    before = sorted(p.name for p in (trained / "checkpoints").iterdir())
    inside = trained / "checkpoints" / "mine"
    line = one_error_line(train(inside, base, env))
    assert f"--workdir {inside} is inside {trained / 'checkpoints'}" in line, line
    assert f"the run in {trained} manages" in line, line
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == before
    for name in ("tokens", "tensorboard"):
        with pytest.raises(errors.ConfigError, match=f"the {name}/ folder that the run in"):
            provenance.check_outside_managed(trained / name / "a" / "b", "--workdir")
    # Beside the run's folders, or in a tokens/ folder with no work dir around it: allowed.
    provenance.check_outside_managed(trained / "sub", "--workdir")
    (tmp_path / "tokens").mkdir()
    provenance.check_outside_managed(tmp_path / "tokens" / "w", "--workdir")


def test_a_workdir_under_home_is_expanded(base, env, tmp_path):
    """``--workdir=~/w`` (the shell leaves a ``~`` after ``=`` alone) trains in $HOME/w, not in
    a folder named ``~`` of the current one."""
    home = tmp_path / "home"
    home.mkdir()
    proc = train("~/w", base, {**env, "HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (home / "w" / "model.json").is_file() and (home / "w" / "checkpoints").is_dir()
    assert not (ROOT / "~").exists()


def test_compilation_cache_dir_that_cannot_be_created_is_one_line(tmp_path):
    """config.compilation_cache_dir naming a file: a one-line ConfigError naming the field
    (before, JAX warned at every compile and the run went on without its cache)."""
    import jax

    from fp8jax.trainer import loop

    path = tmp_path / "cache"
    path.write_text("mine")
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with pytest.raises(errors.ConfigError) as info:
            loop.use_compilation_cache(str(path))
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert str(info.value) == (
        f"config.compilation_cache_dir={str(path)!r} cannot hold compiled programs (a file, not a "
        "folder); name a folder you can write, or '' for no compilation cache"
    )
    assert path.read_text() == "mine"


# --- non-finite weights: import and export ---------------------------------------------------


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """``trained`` exported as a Hugging Face dir (float32)."""
    out = tmp_path_factory.mktemp("hf") / "model"
    hf_io.export(trained, out, dtype="float32")
    return out


def _poison(hf_dir: pathlib.Path, name: str, index, value) -> None:
    path = hf_dir / hf_io.SAFETENSORS
    tensors = safetensors.numpy.load_file(str(path))
    tensors[name][index] = value
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def _tensor_named(hf_dir: pathlib.Path, part: str) -> str:
    names = safetensors.numpy.load_file(str(hf_dir / hf_io.SAFETENSORS)).keys()
    return next(n for n in sorted(names) if part in n)


@pytest.mark.parametrize("part,value", [("wte", np.inf), ("attn.c_attn.weight", np.nan)])
def test_non_finite_weight_is_refused_at_import_naming_the_tensor(exported, part, value, tmp_path):
    """Inf in one embedding row (or NaN in one row of the QKV projection) of a HF dir:
    ``hf.load`` raises a one-line CheckpointError naming the tensor and its file."""
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    name = _tensor_named(copy, part)
    _poison(copy, name, (3,), value)
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.load(copy)
    msg = str(info.value)
    assert f"tensor {name} in {copy / hf_io.SAFETENSORS} holds" in msg and "NaN/Inf" in msg, msg


def test_train_init_from_a_non_finite_checkpoint_is_refused(exported, base, env, tmp_path):
    """train.py --config.init_from on a HF dir with Inf in one embedding row: exit 2, one line
    naming the tensor; no work dir is created."""
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    name = _tensor_named(copy, "wte")
    _poison(copy, name, (5,), np.inf)
    workdir = tmp_path / "work"
    line = one_error_line(train(workdir, base, env, init_from=str(copy)))
    assert f"tensor {name} in" in line and "NaN/Inf" in line, line
    assert not workdir.exists()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize(
    "dtype,scale,fragment",
    [
        ("bfloat16", np.nan, "non-finite weights cannot serve"),
        ("float16", 1e6, "past float16's range: export with --dtype bfloat16 or float32"),
    ],
)
def test_export_refuses_non_finite_output(exported, dtype, scale, fragment, tmp_path):
    """Params holding NaN, or finite f32 values past float16's range exported as float16: the
    export raises a one-line CheckpointError naming the tensor and leaves no output folder."""
    loaded = hf_io.load(exported)
    params = {**loaded.params, "embed": {"embedding": loaded.params["embed"]["embedding"] * scale}}
    out = tmp_path / "out"
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.save_hf(out, loaded.model_cfg, params, loaded.tokenizer, dtype=dtype)
    assert "holds" in str(info.value) and fragment in str(info.value), info.value
    assert not out.exists() and not list(tmp_path.glob(".out.tmp*"))


def test_init_from_names_the_architecture_fields_it_does_not_use(exported, tmp_path, caplog):
    """config.init_from takes the checkpoint's architecture: a model field the config sets
    otherwise (on the command line, say) is named in a warning, not dropped unseen."""
    import logging

    from fp8jax import spec
    from fp8jax.trainer import loop

    arch = hf_io.architecture(exported)
    width = arch["d_model"]
    c = loop.load_config("tiny")
    c.init_from, c.model.d_model, c.seq_len = str(exported), 2 * width, arch["max_len"]
    with caplog.at_level(logging.WARNING):
        run, _, _ = loop.from_checkpoint(spec.parse(c), str(tmp_path / "work"))
    assert run.model.d_model == width
    assert f"model.d_model={2 * width} (the checkpoint's: {width})" in caplog.text, caplog.text
    assert not (tmp_path / "work").exists()


def test_truncated_safetensors_is_one_line(exported, env, tmp_path):
    """model.safetensors cut to half its size: ``hf.load`` raises a one-line CheckpointError
    naming the file, and ``python -m fp8jax.hf.export_cli`` exits 2 with that line, no output."""
    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    path = copy / hf_io.SAFETENSORS
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(errors.CheckpointError, match="is not a readable safetensors file"):
        hf_io.load(copy)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8jax.hf.export_cli", str(copy), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    line = one_error_line(proc)
    assert f"{path} is not a readable safetensors file" in line and "re-download" in line
    assert not out.exists()


def test_truncated_safetensors_in_hf_fp8_is_one_line(exported, tmp_path, capsys):
    """``python -m fp8jax.hf.fp8`` on a model.safetensors cut short of the data its header
    names: exit 2 with one line naming the file and both sizes, no output folder."""
    from fp8jax.hf import fp8

    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    path = copy / hf_io.SAFETENSORS
    os.truncate(path, path.stat().st_size - 100)
    out = tmp_path / "out"
    assert fp8.main([str(copy), str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"error: {path} is truncated" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize(
    "name,text,fragment",
    [
        ("config.json", '{"architectures": ["GPT', "config.json is not valid JSON"),
        ("config.json", "[1]", "config.json holds a JSON list, not an object"),
        (hf_io.SAFETENSORS_INDEX, '{"weight_map": ', "index.json is not valid JSON"),
        (hf_io.SAFETENSORS_INDEX, '{"metadata": {}}', "index.json has no weight_map"),
    ],
)
def test_hf_fp8_on_a_corrupt_json_record_is_one_line(
    exported, tmp_path, capsys, name, text, fragment
):
    """``python -m fp8jax.hf.fp8`` on a dir whose config.json or shard index is cut short or
    not an object: exit 2 with one line naming the file, no output folder."""
    from fp8jax.hf import fp8

    copy = tmp_path / "model"
    shutil.copytree(exported, copy)
    (copy / name).write_text(text)
    out = tmp_path / "out"
    assert fp8.main([str(copy), str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {copy / name}"), lines
    assert fragment in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("source", ["trained", "exported"])
def test_unreadable_tokenizer_json_is_one_line(source, request, tmp_path):
    """A work dir's (or a Hugging Face dir's) tokenizer.json cut short: ``hf.load`` (and so
    generate, evaluate, lm_eval, hf.export, init_from) raises a one-line CheckpointError naming
    the file and how to restore it."""
    copy = tmp_path / "ckpt"
    shutil.copytree(request.getfixturevalue(source), copy)
    path = copy / "tokenizer.json"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.load(copy)
    msg = str(info.value)
    assert msg.startswith(f"{path} is not a readable tokenizer.json (") and "; restore" in msg


def _load_edited(source, tmp_path, name: str, key: str, value):
    """``(record, pytest.raises info)``: ``hf_io.load`` of a copy of ``source`` whose JSON
    record ``name`` has ``key`` set to ``value``, which must raise a CheckpointError."""
    import json

    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    record = copy / name
    record.write_text(json.dumps({**json.loads(record.read_text()), key: value}))
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.load(copy)
    return record, info


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("norm_eps", -1.0, "model.norm_eps=-1.0: use a finite number in (0, 1)"),
        ("rope_theta", float("nan"), "model.rope_theta=nan: use a finite number > 1"),
        ("qk_norm", "xyz", "unknown model.qk_norm 'xyz'"),
        ("moe", {"experts": 8}, "unexpected keyword argument 'experts'"),
    ],
)
def test_edited_model_record_is_one_line(trained, tmp_path, field, value, fragment):
    """A work dir's model.json edited to a value its config field refuses (a negative norm_eps
    generated NaN that was blamed on the weights) or a malformed MoE record: ``hf.load`` (and so
    generate, evaluate, the exports) raises a one-line CheckpointError naming the file."""
    record, info = _load_edited(trained, tmp_path, "model.json", field, value)
    msg = str(info.value)
    assert msg.startswith(f"{record} records an invalid model (") and fragment in msg, msg
    assert msg.endswith("; restore the file"), msg


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("layer_norm_epsilon", -1.0, "records an invalid model (model.norm_eps=-1.0: use a"),
        ("n_head", 0, "is malformed (ZeroDivisionError: integer modulo by zero)"),
    ],
)
def test_edited_hf_config_is_one_line(exported, tmp_path, key, value, fragment):
    """A Hugging Face config.json with a negative layer-norm epsilon (the loss was NaN, blamed
    on the weights) or no attention heads (a traceback): one line naming the file."""
    config, info = _load_edited(exported, tmp_path, "config.json", key, value)
    assert str(info.value).startswith(f"{config} {fragment}"), info.value


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


def test_output_folder_that_cannot_be_created_is_one_line(exported, tmp_path, monkeypatch, capsys):
    """An output folder whose parent refuses the staging folder (a read-only mount, another
    user's folder): ``python -m fp8jax.hf.export_cli`` and ``python -m fp8jax.hf.fp8`` exit 2
    with one line naming it and the fix, and write nothing."""
    from fp8jax.hf import export_cli, fp8

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "mkdir", _read_only)
        m.setattr(fp8.tempfile, "mkdtemp", _read_only)
        assert export_cli.main([str(exported), str(out)]) == 2
        assert fp8.main([str(exported), str(out)]) == 2
    line = (
        f"error: cannot create a folder beside {out} (Read-only file system); pass an output "
        "folder in a folder you can write to"
    )
    assert capsys.readouterr().err.strip().splitlines() == [line, line]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["SRC", "OUT", "--max_shard_gb", "inf"], "--max_shard_gb=inf: use a finite size > 0"),
        (["SRC", "OUT", "--max_shard_gb", "abc"], "--max_shard_gb: invalid float value: 'abc'"),
        (["SRC"], "the following arguments are required: out"),
    ],
)
def test_export_cli_bad_arguments_are_one_line(tmp_path, capsys, args, fragment):
    """``python -m fp8jax.hf.export_cli`` with a missing argument, a value that does not parse
    or an infinite shard size: exit 2 with one line (not argparse's usage, not a traceback)."""
    from fp8jax.hf import export_cli

    argv = [{"SRC": str(tmp_path / "src"), "OUT": str(tmp_path / "out")}.get(a, a) for a in args]
    assert export_cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not (tmp_path / "out").exists()


# --- memory: a run that cannot fit is refused before its first step --------------------------


def test_run_that_cannot_fit_in_memory_is_refused_before_the_first_step(
    base, tmp_path, monkeypatch
):
    """With the device's memory reported as 1 KiB (less than the compiled tiny step's peak),
    training stops after the compile with one line naming the step's and the device's GiB and
    the usual fixes; no step runs."""
    from fp8jax.diagnostics import memory
    from fp8jax.trainer import loop

    from fp8_testing import with_overrides

    monkeypatch.setattr(memory, "device_memory_limit", lambda: 2**10)
    config = with_overrides(
        loop.load_config("tiny"), {**SMALL, "data.path": str(base / "corpus.txt")}
    )
    config.compilation_cache_dir = ""
    workdir = tmp_path / "work"
    with pytest.raises(errors.ConfigError) as info:
        loop.train_and_evaluate(config, str(workdir))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("the train step needs"), msg
    for fragment in ("GiB per device", "more than the 0.00 GiB", "config.batch_size"):
        assert fragment in msg, msg
    assert "config.model.remat_policy" in msg and "config.mesh.fsdp" in msg, msg
    metrics_file = workdir / "metrics.jsonl"
    assert not metrics_file.exists() or not train_steps(workdir)
    assert not list((workdir / "checkpoints").glob("[0-9]*"))


# train.py with the end sample's compile never returning and the device reported as 1 KiB.
HANGING_SAMPLE = """
import sys, threading
from fp8jax.diagnostics import memory
from fp8jax.trainer import generate
class Blocked:  # the end sample's decoder: its background compile never returns
    def compile(self, *args):
        threading.Event().wait()
generate.decoder_for = lambda *args: Blocked()
memory.device_memory_limit = lambda: 2**10
from fp8jax import train
sys.argv[0] = "train.py"
train.run()
"""


def test_a_refused_run_exits_without_waiting_for_its_sample_compile(base, env, tmp_path):
    """A run refused after its end sample began compiling in the background (its step does not
    fit the device) exits 2 with its one line, not waiting for that compile (here: forever)."""
    values = {**SMALL, "data.path": str(base / "corpus.txt"), "sample_tokens": 4}
    args = [
        sys.executable,
        "-c",
        HANGING_SAMPLE,
        "--config",
        "configs/tiny.py",
        f"--workdir={tmp_path / 'work'}",
        *[f"--config.{k}={v}" for k, v in values.items()],
    ]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert one_error_line(proc).startswith("error: the train step needs")


def test_compiled_peak_within_the_device_passes(monkeypatch):
    """``check_fits`` passes a peak at the limit and where either figure is unknown."""
    from fp8jax.diagnostics import memory

    stats = {"argument": 10, "output": 5, "alias": 5, "temp": 90, "generated_code": 0}
    stats["peak"] = 100
    monkeypatch.setattr(memory, "device_memory_limit", lambda: 100)
    memory.check_fits(stats, "x", "fix")
    memory.check_fits(None, "x", "fix")
    monkeypatch.setattr(memory, "device_memory_limit", lambda: 99)
    with pytest.raises(errors.ConfigError, match="x needs .* GiB per device"):
        memory.check_fits(stats, "x", "fix")
    monkeypatch.setattr(memory, "device_memory_limit", lambda: None)
    memory.check_fits(stats, "x", "fix")


# --- Hugging Face edges: relative paths, fp8jax's own FP8 export -----------------------------


def test_relative_work_dir_paths_load_and_export(trained, tmp_path, monkeypatch):
    """``hf.load`` and ``hf.export`` take a work dir relative to the current directory."""
    monkeypatch.chdir(trained.parent)
    loaded = hf_io.load(trained.name)
    assert loaded.model_cfg.d_model == SMALL["model.d_model"]
    out = tmp_path / "out"
    hf_io.export(trained.name, out, dtype="float32")
    assert (out / hf_io.SAFETENSORS).is_file()


def test_fp8_serving_export_says_how_to_convert_it_back(exported, tmp_path, capsys):
    """Loading fp8jax's own FP8 serving export (``hf.fp8``) is refused in one line naming the
    command that converts it back; that command, run as printed, gives a dir that loads."""
    import shlex

    from fp8jax.hf import fp8

    served = tmp_path / "served"
    fp8.convert(exported, served, "fp8-block")
    with pytest.raises(errors.CheckpointError) as info:
        hf_io.load(served)
    msg = str(info.value)
    assert "FP8 serving export" in msg and "python -m fp8jax.hf.fp8" in msg, msg
    command = shlex.split(msg.split("convert it back first: ")[1])
    assert command[:3] == ["python", "-m", "fp8jax.hf.fp8"] and "--to" in command, command
    assert fp8.main(command[3:]) == 0, capsys.readouterr().err
    back = hf_io.load(command[4])
    assert back.model_cfg.d_model == SMALL["model.d_model"]
