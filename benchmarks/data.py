"""The data pipeline at corpus scale: encoding throughput per format and worker count, and the
time to the first train step on text (encoding, then the shared cache) and on token shards.

    python -m benchmarks.data --size-mb 10240 --workers 1,4,16 --row-timeout 300 --out "$OUT"
    python -m benchmarks.data --size-mb 64 --workers 1,2 --out /tmp/data   # 2 CPU cores
    python -m benchmarks.data --quick --out /tmp/data_quick                 # CPU smoke test

1. A synthetic corpus of ``--size-mb`` MB, generated in parallel into part files of at most 64
   MB (never whole in memory): documents of a title line and paragraphs of sentences drawn with
   a seeded RNG from a pool of 2^18 shared by all parts and 2^14 of the part's own, built on
   the shipped novels (their sentences; with numbers, dates, prices and percentages; upper-
   and title-cased; word salad drawn by word frequency and uniformly; list lines), so a BPE
   sees varied text. The formats
   (``--formats``): ``folder`` (the part files), ``txt`` (the same bytes as one file),
   ``jsonl`` (a line per document) and ``parquet`` (a ``text`` column, a file per part; needs
   pyarrow). The corpus stays in ``--work-dir`` for a later call with the same size and seed;
   the shards, caches and work dirs there are removed at the end.
2. The tokenizer: ``--tokenizer`` (a tokenizer.json or a Hugging Face model dir), else a
   byte-level BPE of ``--vocab`` ids learned on the shipped corpus.
3. Per format and ``--workers`` count (stage ``prepare``): ``python -m fp8jax.prepare`` in a
   fresh process; wall time from its start to its exit (imports and the corpus fingerprint
   included), MB/s of text, MB/s per worker process, MB per CPU-second, the processes the
   encoder used (its log line: a corpus of one 16 MB range is encoded by one; one process
   encodes with the tokenizer's own threads), the ids and the shards' bytes.
4. ``train.py --config`` (``configs/tiny.py``) to its first step (stage ``train``) on the
   ``txt`` corpus (else the folder) as ``data.format='text'`` in a fresh work dir and a fresh
   shared cache (``data.cache_dir``): it encodes (``data.encode_workers=--train-workers``);
   the same command in another fresh work dir: it reuses the cache and encodes nothing (the
   encoder's log line is absent); ``data.format='tokens'`` on the shards of step 3 (the
   folder's at the most workers; without stage ``prepare``, prepared for it). The time to
   first step is from the process' start to its first ``step N: ... loss=`` line, compile
   included (no compilation cache: each run compiles the same step); then its process group
   is killed (what follows is not measured). ``data s`` is from its ``data source`` line to
   its ``initialising`` line.

Memory and CPU: a thread samples the process tree of each run (the process and every
descendant, the encoder's fork server and workers included) every 0.2 s from /proc; it keeps
the peak of the summed PSS (each shared page counted once, split between the processes that map
it; the memory-mapped token files' resident pages included) and of the summed RSS (shared pages
counted in every process), and each process' CPU seconds (user + system) at its last sample. A
peak shorter than the interval, and a process' last 0.2 s of CPU, can be missed.
``--row-timeout`` kills a run's process group after that long (a prepare row keeps the MB its
progress bar reached and the rate so far). Each row is printed and ``<out>/data.json``
rewritten as soon as it is measured; a table at the end.
"""

from __future__ import annotations

import collections
import gzip
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks import runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "fp8jax" / "data"
FORMATS = ("txt", "folder", "jsonl", "parquet")
_GENERATOR = 2  # the corpus generator's version (a corpus of another is generated again)
_POOL = 1 << 18  # sentences every part's documents are drawn from (about 27 MB)
_PART_POOL = 1 << 14  # and sentences of each part's own (1 in 17 of its sentences)
_PART_MAX = 64 << 20  # bytes of a part file, at most
_PART_MIN = 1 << 20  # bytes of a part file, at least (a corpus smaller than that: one part)
_SAMPLE_S = 0.2  # seconds between memory samples

STEP = re.compile(r"step (\d+): .*\bloss=")
ENCODED = re.compile(r"encoded ([\d.]+) MB in ([\d.]+)s \(([\d.]+) MB/s, (\d+) process")
PROGRESS = re.compile(r"encoding: .*?\| *([\d.]+)([kMGT]?)/")  # tqdm's bytes done so far
COMPILED = re.compile(r"train step compiled in ([\d.]+) s")
REUSED = re.compile(r"reusing token cache")
# the token cache's ids: just encoded (train, val), or reused (train)
CACHE_TOKENS = re.compile(
    r"encoded (\d+) train \+ (\d+) val tokens|reusing token cache .*\((\d+) train"
)
DATA = (re.compile(r"data source: "), re.compile(r"initialising .* parameters"))  # data built
# --quick: a smaller model than configs/tiny.py's, for a quicker compile
QUICK_SETS = (
    "fp8.level=O0",
    "model.num_layers=1",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.d_ff=64",
    "model.max_len=16",
    "seq_len=16",
    "batch_size=2",
)


# --- the corpus ---------------------------------------------------------------------------


def _shipped_text() -> str:
    return "\n\n".join(
        gzip.open(f, "rt", encoding="utf-8").read() for f in sorted(SHIPPED.glob("*.txt.gz"))
    )


def _sources() -> tuple[list[str], list[str], np.ndarray]:
    """The shipped novels' sentences, their words and each word's frequency."""
    text = _shipped_text()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    sentences = [
        s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if 20 <= len(s) <= 400
    ]
    counts = collections.Counter(re.findall(r"[A-Za-z']+", text.lower()))
    words = sorted(counts)
    return sentences, words, np.asarray([counts[w] for w in words], np.float64)


def _pool(rng: np.random.Generator, n: int, sentences, words, freq) -> list[str]:
    """``n`` sentences of many kinds, drawn by ``rng``: the novels' own; with a number, a
    date, a price or a percentage; upper- or title-cased; word salad drawn by the words'
    frequency or uniformly (rarer words); list lines of words and numbers."""
    kinds = rng.choice(7, size=n, p=[0.45, 0.12, 0.06, 0.06, 0.13, 0.1, 0.08]).tolist()
    picks = rng.integers(0, len(sentences), n).tolist()
    ints = rng.integers(0, 1 << 40, (n, 6)).tolist()  # the numbers each kind may use
    cdf = np.cumsum(freq) / freq.sum()
    lengths = rng.integers(4, 25, n).tolist()
    salad = rng.random(n * 24)
    out = []
    for i, (k, pick, r) in enumerate(zip(kinds, picks, ints, strict=True)):
        s = sentences[pick]
        if k == 1:
            extra = (
                f"{r[1] % 10 ** (1 + r[2] % 7)}",
                f"{1 + r[1] % 28} {_MONTHS[r[2] % 12]} {1600 + r[3] % 500}",
                f"${r[1] % 5000}.{r[2] % 100:02d}",
                f"{r[1] % 100}.{r[2] % 10}%",
            )[r[0] % 4]
            s = f"{s[:-1]} ({extra}){s[-1]}"
        elif k == 2:
            s = s.upper()
        elif k == 3:
            s = s.title()
        elif k in (4, 5):
            u = salad[i * 24 : i * 24 + lengths[i]]
            ws = np.searchsorted(cdf, u) if k == 4 else (u * len(words)).astype(int)
            s = " ".join(words[min(j, len(words) - 1)] for j in ws.tolist())
            s = s[0].upper() + s[1:] + ".?"[r[0] % 5 == 0]
        elif k == 6:
            w = [words[v % len(words)] for v in r[3:6]]
            s = f"{r[0] % 1000}. {w[0]}-{w[1]}: {r[1] % 10**6} x {r[2] % 10**4 / 100:.2f} ({w[2]})"
        out.append(s)
    return out


_MONTHS = "January February March April May June July August September October November December"
_MONTHS = _MONTHS.split()


def _documents(rng: np.random.Generator, pool: list[str], size: int, first: int) -> list[str]:
    """Documents of about ``size`` characters in total: a title line and 1-12 paragraphs of
    1-8 sentences each, numbered from ``first``."""
    docs, done, doc = [], 0, first
    while done < size:
        lens = rng.integers(1, 9, int(rng.integers(1, 13))).tolist()
        picks = rng.integers(0, len(pool), sum(lens)).tolist()
        title = " ".join(pool[picks[0]].split()[:6]).rstrip(".,;:!?")
        paragraphs, at = [f"Document {doc}: {title}"], 0
        for k in lens:
            paragraphs.append(" ".join([pool[j] for j in picks[at : at + k]]))
            at += k
        docs.append("\n\n".join(paragraphs))
        done += len(docs[-1]) + 2
        doc += 1
    return docs


def _part(task: tuple) -> int:
    """Write part ``index`` of the corpus: its .txt (and .jsonl, .parquet) files."""
    index, size, seed, root, formats = task
    rng = np.random.default_rng([seed, index])
    own = _pool(rng, _PART_POOL, *_SOURCES)  # sentences (numbers, salad) of this part alone
    docs = _documents(rng, _SHARED_POOL + own, size, index * 10**7)
    name = f"part_{index:05d}"
    text = "".join(d + "\n\n" for d in docs)
    (root / "folder" / f"{name}.txt").write_text(text, encoding="utf-8")
    if "jsonl" in formats:
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        (root / "jsonl_parts" / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    if "parquet" in formats:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), root / "parquet" / f"{name}.parquet")
    return len(text.encode())


_SOURCES: tuple = ()  # the novels' sentences and words, read before the processes fork
_SHARED_POOL: list[str] = []  # the sentences every part draws from, drawn before the fork


def _concat(parts: list[pathlib.Path], out: pathlib.Path) -> None:
    with open(out, "wb") as dst:
        for f in parts:
            with open(f, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)


def corpus(root: pathlib.Path, size_mb: float, seed: int, formats: list[str], cores: int) -> dict:
    """Generate (or reuse) the corpus in ``root``; returns its record (paths and sizes)."""
    global _SOURCES, _SHARED_POOL
    formats = sorted({*formats, "folder"})  # the part files are always there
    want = dict(generator=_GENERATOR, size_mb=size_mb, seed=seed, formats=formats)
    record_path = root / "corpus.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        same = all(record.get(k) == want[k] for k in ("generator", "size_mb", "seed"))
        if same and set(formats) <= set(record.get("formats", ())):
            print(f"reusing the corpus in {root}", flush=True)
            return record
    shutil.rmtree(root, ignore_errors=True)
    for d in ("folder", "jsonl_parts", "parquet"):
        (root / d).mkdir(parents=True)
    t0 = time.perf_counter()
    total = int(size_mb * 1e6)
    part = min(_PART_MAX, max(_PART_MIN, total // 64))
    sizes = [part] * (total // part) + ([total % part] if total % part else [])
    _SOURCES = _sources()
    _SHARED_POOL = _pool(np.random.default_rng([seed, 1 << 30]), _POOL, *_SOURCES)
    tasks = [(i, s, seed, root, formats) for i, s in enumerate(sizes)]
    written = 0
    with multiprocessing.get_context("fork").Pool(cores) as pool:
        for n in pool.imap(_part, tasks):
            written += n
            print(f"corpus: {written / 1e6:.0f} of {total / 1e6:.0f} MB", flush=True)
    parts = sorted((root / "folder").iterdir())
    paths = {"folder": root / "folder"}
    if "txt" in formats:
        paths["txt"] = root / "corpus.txt"
        _concat(parts, paths["txt"])
    if "jsonl" in formats:
        paths["jsonl"] = root / "corpus.jsonl"
        _concat(sorted((root / "jsonl_parts").iterdir()), paths["jsonl"])
    shutil.rmtree(root / "jsonl_parts")
    if "parquet" in formats:
        paths["parquet"] = root / "parquet"
    record = dict(
        want,
        paths={k: str(v) for k, v in paths.items()},
        bytes={k: _size(v) for k, v in paths.items()},
        files=len(parts),
        seconds=round(time.perf_counter() - t0, 2),
    )
    record_path.write_text(json.dumps(record, indent=1))
    print(f"corpus: {written / 1e6:.1f} MB in {record['seconds']:.1f} s", flush=True)
    return record


def _size(path: pathlib.Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --- measuring a process tree -------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK")  # /proc/<pid>/stat's CPU times are in these


def _processes() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Every process' children and its CPU seconds (user and system) so far, from /proc."""
    kids, cpu = collections.defaultdict(list), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ppid, ticks = int(fields[1]), int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
        kids[ppid].append(int(entry.name))
        cpu[int(entry.name)] = ticks / _TICK
    return kids, cpu


def _memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in bytes; (0, 0) once it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return pss, rss


class TreePeak(threading.Thread):
    """Samples the memory of a process and its descendants until ``stop``: the peaks of the
    summed PSS and RSS, the most processes seen at once, and the CPU seconds of every process
    of the tree at its last sample (``cpu_s``)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.pss, self.rss, self.procs = pid, 0, 0, 0
        self.cpu: dict[int, float] = {}
        self._done = threading.Event()

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the tree's processes, each as last sampled."""
        return sum(self.cpu.values())

    def sample(self) -> None:
        (kids, cpu), tree, todo = _processes(), [], [self.pid]
        while todo:
            p = todo.pop()
            tree.append(p)
            todo += kids.get(p, [])
        mem = [_memory(p) for p in tree]
        self.pss = max(self.pss, sum(m[0] for m in mem))
        self.rss = max(self.rss, sum(m[1] for m in mem))
        self.procs = max(self.procs, sum(1 for m in mem if m[1]))
        self.cpu.update((p, cpu[p]) for p in tree if p in cpu)

    def run(self) -> None:
        while not self._done.wait(_SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()


def _units(number: str, prefix: str) -> float:
    return float(number) * {"": 1e-6, "k": 1e-3, "M": 1.0, "G": 1e3, "T": 1e6}[prefix]


def measure(
    cmd: list[str], log: pathlib.Path, env: dict, timeout: float = 0, first_step: bool = False
) -> dict:
    """Run ``cmd`` (output to ``log``); its wall time, exit code, memory peaks, the time its
    first train step line came, and the trainer's or encoder's log lines of interest. After
    ``timeout`` s (0: none) its process group is killed; the row then keeps the encoder's
    progress (MB done) and its error says so. ``first_step``: kill it at its first train step
    line (exit code 0 then)."""
    t0 = time.perf_counter()
    step_at = None
    lines, data = [], [None, None]
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,  # universal newlines: each of tqdm's '\r' updates is a line
        errors="replace",
        start_new_session=True,  # its own process group: the encoder's workers die with it
    ) as proc:
        peak = TreePeak(proc.pid)
        peak.start()
        killed = threading.Event()
        timer = threading.Timer(timeout, lambda: (killed.set(), os.killpg(proc.pid, 9)))
        if timeout:
            timer.start()
        for line in proc.stdout:
            t = time.perf_counter() - t0
            lines.append(f"{t:9.3f} {line}")
            if step_at is None and STEP.search(line):
                step_at = t
                if first_step:
                    os.killpg(proc.pid, 9)
            for k, pattern in enumerate(DATA):
                if data[k] is None and pattern.search(line):
                    data[k] = t
        rc = proc.wait()
        if first_step and step_at is not None and not killed.is_set():
            rc = 0  # killed here, at its first step
        wall = time.perf_counter() - t0
        timer.cancel()
        peak.stop()
    text = "".join(lines)
    log.write_text(text)
    r = dict(
        rc=rc,
        wall_s=round(wall, 3),
        peak_pss_mb=round(peak.pss / 1e6, 1),
        peak_rss_mb=round(peak.rss / 1e6, 1),
        cpu_s=round(peak.cpu_s, 2),
        max_processes=peak.procs,
        first_step_s=None if step_at is None else round(step_at, 3),
        data_s=None if None in data else round(data[1] - data[0], 3),
        log=str(log),
    )
    if m := ENCODED.search(text):
        r.update(encoded_mb=float(m[1]), encode_s=float(m[2]), processes=int(m[4]))
    else:
        r.update(encoded_mb=0.0)
    if m := COMPILED.search(text):
        r["compile_s"] = float(m[1])
    r["reused_cache"] = bool(REUSED.search(text))
    if m := CACHE_TOKENS.search(text):
        r["cache_tokens"] = int(m[1]) + int(m[2]) if m[1] else None
        r["cache_train_tokens"] = int(m[1] or m[3])
    if done := PROGRESS.findall(text):
        r["progress_mb"] = round(_units(*done[-1]), 1)
    if killed.is_set():
        done_mb = r.get("progress_mb", 0)
        # With progress, a row of its own (its rate so far); without, an error.
        r["cut" if done_mb else "error"] = f"killed after {timeout:g} s, {done_mb} MB encoded"
        r["encoded_mb"] = done_mb
    elif rc:
        tail = [ln.split(" ", 1)[-1].strip() for ln in lines[-3:]]
        r["error"] = f"exit {rc}: " + " | ".join(tail)[-400:]
    return r


# --- the benchmark ------------------------------------------------------------------------


def _tokenizer(args, work: pathlib.Path) -> str:
    """The tokenizer's path: ``--tokenizer``, else a BPE learned on the shipped corpus."""
    if args.tokenizer:
        return str(pathlib.Path(args.tokenizer).resolve())
    from fp8jax import tokenizer as tokenizer_lib

    path = work / f"tokenizer_{args.vocab}.json"
    if not path.is_file():
        t0 = time.perf_counter()
        tok = tokenizer_lib.train([_shipped_text()], vocab_size=args.vocab)
        tok.save(path)
        print(f"tokenizer: {tok.vocab_size} ids in {time.perf_counter() - t0:.1f} s", flush=True)
    return str(path)


class Results:
    """The rows so far, written to ``<out>/data.json`` at each new one."""

    def __init__(self, out: str, header: dict):
        self.out, self.header, self.rows = out, header, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        runner.write_json(self.out, "data", {**self.header, "rows": self.rows})
        print(json.dumps(row), flush=True)


def prepare_rows(
    args, formats, workers, record: dict, tok: str, work: pathlib.Path, env: dict, results: Results
):
    """One ``fp8jax.prepare`` row per format and worker count; returns the shards kept for
    the training on tokens: those at the most workers of the first format of ``_KEEP`` (each
    folder file or .jsonl line is a document; one .txt file is one, so its shards have no
    document end to draw a validation split at)."""
    kept, most = {}, max(workers)
    logs = pathlib.Path(args.out).resolve() / "logs"
    for fmt in formats:
        src = record["paths"][fmt]
        mb = record["bytes"][fmt] / 1e6
        for w in workers:
            shards = work / f"shards_{fmt}_w{w}"
            shutil.rmtree(shards, ignore_errors=True)
            # INFO verbosity: the encoder's "encoded ... MB" line gives the processes it used.
            cmd = [sys.executable, "-m", "fp8jax.prepare", src, "--tokenizer", tok, "-v", "0"]
            cmd += ["--out", str(shards), "--workers", str(w)]
            print(f"prepare {fmt} x {w} workers ...", flush=True)
            r = measure(cmd, logs / f"prepare_{fmt}_w{w}.txt", env, args.row_timeout)
            for stage in work.glob(f".{shards.name}.tmp*"):  # a killed run's staging folder
                shutil.rmtree(stage, ignore_errors=True)
            row = dict(stage="prepare", format=fmt, workers=w, size_mb=round(mb, 1), **r)
            if "cut" in r:  # by --row-timeout: the rate so far
                row["mb_per_s"] = round(r["progress_mb"] / r["wall_s"], 2)
                row["mb_per_s_per_worker"] = round(row["mb_per_s"] / w, 2)
                row["mb_per_cpu_s"] = round(r["progress_mb"] / r["cpu_s"], 2)
            if not r["rc"]:
                manifest = json.loads((shards / "prepare.json").read_text())
                bins = sorted(shards.glob("*.bin"))
                row.update(
                    tokens=manifest["tokens"],
                    dtype=manifest["dtype"],
                    shards=len(bins),
                    shard_bytes=sum(f.stat().st_size for f in bins),
                    cache_mb=round(_size(shards) / 1e6, 1),
                    prepare_s=manifest["seconds"],
                    mb_per_s=round(mb / r["wall_s"], 2),
                    mb_per_s_per_worker=round(mb / r["wall_s"] / r.get("processes", 1), 2),
                    mb_per_cpu_s=round(mb / r["cpu_s"], 2) if r["cpu_s"] else None,
                )
            results.add(row)
            if w == most and not r["rc"] and not kept and fmt in _KEEP:
                kept[fmt] = shards
            else:
                shutil.rmtree(shards, ignore_errors=True)  # a 10 GB corpus' shards take 5 GB
    return next(iter(kept.values()), None)


_KEEP = ("folder", "jsonl", "parquet")  # formats whose shards hold several documents


def train_rows(args, record, tok, shards, work: pathlib.Path, env: dict, results: Results) -> None:
    """Time to first step: text (encoding, then the shared cache), then the token shards."""
    fmt = "txt" if "txt" in record["paths"] else "folder"
    cache = work / "train_cache"
    logs = pathlib.Path(args.out).resolve() / "logs"
    shutil.rmtree(cache, ignore_errors=True)
    common = [
        sys.executable,
        "train.py",
        f"--config={args.config}",
        "--config.num_train_steps=2",
        "--config.log_every_steps=1",
        "--config.eval_every_steps=1000000",
        "--config.eval_batches=1",
        "--config.checkpoint_every_steps=0",
        "--config.sample_tokens=0",
        "--config.compilation_cache_dir=",
        *(f"--config.{kv}" for kv in (*(QUICK_SETS if args.quick else ()), *args.set)),
    ]
    text = [
        "--config.data.format=text",
        f"--config.data.path={record['paths'][fmt]}",
        f"--config.data.tokenizer={tok}",
        f"--config.data.cache_dir={cache}",
        f"--config.data.encode_workers={args.train_workers}",
    ]
    runs = [("text", text), ("text_cached", text)]
    if shards is not None:
        tokens = [
            "--config.data.format=tokens",
            f"--config.data.path={shards}",
            f"--config.data.tokenizer={shards / 'tokenizer'}",
        ]
        runs.append(("tokens", tokens))
    mb = record["bytes"][fmt] / 1e6
    for name, flags in runs:
        workdir = work / f"work_{name}"
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"train {name} ...", flush=True)
        cmd = [*common, f"--workdir={workdir}", *flags]
        r = measure(cmd, logs / f"train_{name}.txt", env, args.row_timeout, first_step=True)
        row = dict(stage="train", format=name, workers=args.train_workers, size_mb=round(mb, 1))
        row.update(r)
        if name.startswith("text"):
            row["cache_mb"] = round(_size(cache) / 1e6, 1) if cache.exists() else 0.0
        elif shards is not None:
            row["cache_mb"] = round(_size(shards) / 1e6, 1)
        results.add(row)
        shutil.rmtree(workdir, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)


DEFAULTS = dict(size_mb=256.0, workers=[1, 2, 4, 8, 16], vocab=16384)
QUICK = dict(size_mb=4.0, workers=[1, 2], vocab=512)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


COLUMNS = {
    "MB": lambda r: f"{r['size_mb']:.0f}",
    "workers": lambda r: r["workers"] or "all",
    "procs": lambda r: r.get("processes", "-") if r["encoded_mb"] else "-",
    "wall s": lambda r: f"{r['wall_s']:.1f}",
    "MB/s": lambda r: f"{r['mb_per_s']:.2f}",
    "MB/s/proc": lambda r: f"{r['mb_per_s_per_worker']:.2f}",
    "CPU s": lambda r: f"{r['cpu_s']:.1f}",
    "MB/CPU-s": lambda r: f"{r['mb_per_cpu_s']:.2f}",
    "encoded MB": lambda r: f"{r['encoded_mb']:.0f}",
    "data s": lambda r: f"{r['data_s']:.1f}",
    "1st step s": lambda r: f"{r['first_step_s']:.1f}",
    "peak PSS MB": lambda r: f"{r['peak_pss_mb']:.0f}",
    "peak RSS MB": lambda r: f"{r['peak_rss_mb']:.0f}",
    "cache MB": lambda r: f"{r['cache_mb']:.0f}",
}


def main(argv=None) -> int:
    p = runner.parser(__doc__, child=False, sets=True)
    p.add_argument("--size-mb", type=float, default=None, help="corpus MB (1e6 bytes; 256)")
    p.add_argument("--workers", type=_ints, default=None, help="e.g. 1,4,16 (1,2,4,8,16)")
    p.add_argument("--formats", default="txt,folder", help=f"of {','.join(FORMATS)}")
    p.add_argument("--tokenizer", default="", help="tokenizer.json or HF dir ('': learn a BPE)")
    p.add_argument("--vocab", type=int, default=None, help="ids of the learned BPE (16384)")
    p.add_argument("--config", default="configs/tiny.py", help="train.py's config")
    p.add_argument("--train-workers", type=int, default=0, help="data.encode_workers (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--row-timeout",
        type=float,
        default=0,
        help="kill a run after this many s (0: never); a prepare row keeps its rate so far",
    )
    p.add_argument(
        "--work-dir",
        default=os.path.join(tempfile.gettempdir(), "fp8jax_bench_data"),
        help="the corpus (kept for reuse), shards, caches and work dirs (removed at the end)",
    )
    p.add_argument("--stages", default="prepare,train", help="of prepare,train")
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke test: by default 4 MB, workers 1,2, a BPE of 512 ids, a smaller model "
        "at O0",
    )
    args = runner.parse_args(p, argv)
    defaults = QUICK if args.quick else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.formats = [f for f in args.formats.split(",") if f]
    stages = set(args.stages.split(","))
    bad = [f for f in args.formats if f not in FORMATS] + sorted(stages - {"prepare", "train"})
    if bad or not args.workers or min(args.workers) < 1 or args.size_mb <= 0:
        raise SystemExit(
            f"error: bad --formats/--stages {bad} or --workers {args.workers} or --size-mb; "
            f"formats are {','.join(FORMATS)}, stages prepare,train, workers counts >= 1"
        )
    out = pathlib.Path(args.out).resolve()
    (out / "logs").mkdir(exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    # The checkout first, then whatever the caller's path holds (packages installed beside it).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    work = pathlib.Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    root = work / f"corpus_{args.size_mb:g}MB_seed{args.seed}"
    record = corpus(root, args.size_mb, args.seed, args.formats, cores)
    tok = _tokenizer(args, work)
    kept = ("paths", "bytes", "files", "seconds")
    header = dict(cores=cores, corpus={k: record[k] for k in kept})
    header.update(tokenizer=tok, config=args.config, argv=args.argv)
    results = Results(str(out), header)
    shards = None
    if "prepare" in stages:
        shards = prepare_rows(args, args.formats, args.workers, record, tok, work, env, results)
    if "train" in stages and shards is None:  # the shards to train on: folder, most workers
        formats = [f for f in _KEEP if f in record["paths"]][:1]
        most = [max(args.workers)]
        shards = prepare_rows(args, formats, most, record, tok, work, env, results)
    if "train" in stages:
        train_rows(args, record, tok, shards, work, env, results)
    if shards is not None:
        shutil.rmtree(shards, ignore_errors=True)
    rows = [
        {"run": f"{r['stage']} {r['format']}{' (cut)' * ('cut' in r)}", **r} for r in results.rows
    ]
    print(f"\n{cores} CPU cores, corpus {record['bytes']} bytes, tokenizer {tok}")
    print(runner.table(rows, COLUMNS))
    return 0 if all(not r["rc"] or "cut" in r for r in results.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
