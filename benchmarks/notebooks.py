"""PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
python3 benchmarks/notebooks.py --out "$OUT"

Runs the colab/ notebooks' code cells as a plain script and records their key numbers.
This is not Jupyter: each notebook's code cells (less the first, install cell; IPython magics
dropped) run in order in one namespace, in a fresh process per notebook, with MPLBACKEND=Agg and
``plt.show()`` saving PNGs. For machines without Jupyter (the GPU one); tests/ run the notebooks
for real through nbclient on CPU. Output in --out: notebooks.json (per notebook: ok/error, wall
and per-cell seconds, its nbXX_results.json), notebook_figures.zip, notebooks_log.txt.
``--only 01,03`` picks notebooks; ``--notebooks PATH...`` runs other .ipynb files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nb_key(path: str) -> str:
    """'colab/01_fp8_....ipynb' -> 'nb01' (the notebooks' own nbXX_results.json naming)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    m = re.match(r"(\d+)_", stem)
    return f"nb{m.group(1)}" if m else stem


def code_cells(path: str) -> list[tuple[int, str]]:
    """(index among all cells, source without magics) of every code cell after the first."""
    with open(path) as f:
        cells = json.load(f)["cells"]
    code = [(i, c["source"]) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    out = []
    for i, src in code[1:]:  # the first code cell pip-installs / clones: fp8jax is on PYTHONPATH
        src = "".join(src) if isinstance(src, list) else src
        # `pass` keeps an indented block that held only a magic valid
        lines = [re.sub(r"^(\s*)[%!].*$", r"\1pass", ln) for ln in src.splitlines()]
        out.append((i, "\n".join(lines) + "\n"))
    return out


def child(path: str, key: str, figdir: str, report_path: str) -> int:
    """Execute the cells in this process; the report is rewritten after every cell."""
    import linecache

    import matplotlib.pyplot as plt

    report = {"cells": [], "figures": []}

    def save_figures(*_args, **_kwargs):
        # inline Jupyter shows every open figure at the end of a cell: save them all, then close
        for num in plt.get_fignums():
            name = f"{key}_fig{len(report['figures']) + 1}.png"
            plt.figure(num).savefig(os.path.join(figdir, name), dpi=100, bbox_inches="tight")
            report["figures"].append(name)
        plt.close("all")

    def dump(**extra):
        with open(report_path, "w") as f:
            json.dump({**report, **extra}, f)

    plt.show = save_figures
    namespace = {"__name__": "__main__"}
    for index, src in code_cells(path):
        dump(running=index)  # names the cell if the process dies in it (crash, OOM, timeout)
        filename = f"<{key} cell {index}>"
        # registered so tracebacks show the cell's source lines
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        print(f"\n##### {key} cell {index}", flush=True)
        t0 = time.perf_counter()
        try:
            exec(compile(src, filename, "exec"), namespace)
            save_figures()
        except BaseException as e:  # noqa: B036 - SystemExit/KeyboardInterrupt in a cell fail too
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            print(tb, file=sys.stderr, flush=True)
            report["error"] = {"cell": index, "traceback": tb}
        report["cells"].append({"cell": index, "seconds": round(time.perf_counter() - t0, 3)})
        dump()
        if "error" in report:
            return 1
        print(f"##### {key} cell {index}: {report['cells'][-1]['seconds']:.2f} s", flush=True)
    return 0


def run_one(path: str, key: str, work: str, figdir: str, log, timeout_s: float) -> dict:
    """Run one notebook in a fresh process, tee its output, gather its report and results."""
    workdir, report_path = os.path.join(work, key), os.path.join(work, f"{key}_report.json")
    os.makedirs(workdir, exist_ok=True)
    env = dict(os.environ, MPLBACKEND="Agg", FP8JAX_NB_WORKDIR=workdir, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, key, figdir, report_path]
    header = f"\n========== {key}: {path}\n"
    print(header, end="", flush=True)
    log.write(header)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    timer = threading.Timer(timeout_s, proc.kill)
    if timeout_s > 0:
        timer.start()
    for line in proc.stdout:
        sys.stdout.write(line)
        log.write(line)
    rc, wall_s = proc.wait(), round(time.perf_counter() - t0, 2)
    timer.cancel()
    rec = dict(name=key, notebook=path, ok=rc == 0, rc=rc, wall_s=wall_s)
    if os.path.isfile(report_path):
        with open(report_path) as f:
            rec.update(json.load(f))
    running = rec.pop("running", None)
    if rc != 0 and "error" not in rec:  # died without reaching the cell's except clause
        late = 0 < timeout_s <= wall_s
        why = f"timed out after {timeout_s:g} s" if late else f"process exited with {rc}"
        rec["error"] = {"cell": running, "traceback": f"{why} in cell {running}"}
    for results in glob.glob(os.path.join(workdir, "*_results.json")):
        with open(results) as f:
            rec["results"] = json.load(f)
    log.flush()
    return rec


def key_numbers(rec: dict) -> str:
    """The numbers worth a glance from a notebook's nbXX_results.json."""
    r, key = rec.get("results") or {}, nb_key(rec["notebook"])
    fmt = lambda d: ", ".join(f"{k} {v:.4g}" for k, v in d.items())
    if key == "nb01" and r:
        return f"final loss {fmt(r['final_loss'])}; compiled FP8 GEMMs {r['compiled_fp8_gemms']}"
    if key == "nb02" and r:
        lv = r["levels"]
        val = fmt({k: v["val_loss"] for k, v in lv.items()})
        tps = ", ".join(f"{k} {v['median_tokens_per_s']:,.0f}" for k, v in lv.items())
        return f"val loss {val}; tokens/s {tps}"
    if key == "nb03" and r:
        bpp = "; ".join(
            f"{name}: " + fmt({lab: v["all"] for lab, v in rows.items()})
            for name, rows in r["bytes_per_param"].items()
        )
        return f"bytes/param {bpp}; last loss {r['run']['last_loss']:.4f}"
    return json.dumps(r)[:120] if r else "(no results)"


def main() -> int:
    """Parse flags, run each notebook, write notebooks.json, the figure zip and the log."""
    p = argparse.ArgumentParser(description="Run the colab/ notebooks as scripts.")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--only", default="", help="comma-separated prefixes, e.g. 01,03")
    p.add_argument("--notebooks", nargs="+", help="notebook files (default colab/*.ipynb)")
    p.add_argument("--timeout-s", type=float, default=0, help="per notebook; 0: none")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(*a.child)
    paths = a.notebooks or sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))
    if a.only:
        wanted = [s.strip() for s in a.only.split(",") if s.strip()]
        paths = [q for q in paths if any(os.path.basename(q).startswith(w) for w in wanted)]
    if not paths:
        p.error("no notebooks selected")
    os.makedirs(a.out, exist_ok=True)
    # data, checkpoints and run folders stay out of --out: only 8 files come back from the GPU
    work = tempfile.mkdtemp(prefix="fp8jax_notebooks_")
    figdir = os.path.join(work, "figures")
    os.makedirs(figdir)
    records = []
    with open(os.path.join(a.out, "notebooks_log.txt"), "w") as log:
        for i, path in enumerate(paths):
            key = nb_key(path)  # made unique: it names the work folder and the figures
            key = key if [nb_key(q) for q in paths].count(key) == 1 else f"{key}_{i + 1}"
            records.append(run_one(os.path.abspath(path), key, work, figdir, log, a.timeout_s))
            # rewritten after each notebook so a run killed later keeps what finished
            with open(os.path.join(a.out, "notebooks.json"), "w") as f:
                json.dump(records, f, indent=1)
            with zipfile.ZipFile(os.path.join(a.out, "notebook_figures.zip"), "w") as z:
                for png in sorted(glob.glob(os.path.join(figdir, "*.png"))):
                    z.write(png, os.path.basename(png))
    print("\n========== failures" if any(not r["ok"] for r in records) else "")
    for r in records:
        if not r["ok"]:
            print(f"{r['name']} cell {r['error']['cell']}:\n{r['error']['traceback']}")
    print(f"{'notebook':<10} {'ok':<4} {'wall s':>8}  key numbers")
    for r in records:
        ok = "yes" if r["ok"] else "NO"
        print(f"{r['name']:<10} {ok:<4} {r['wall_s']:>8.1f}  {key_numbers(r)}")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
