"""The training loop: ``train_and_evaluate(config, workdir)``.

Called by ``train.py``, the notebooks and the tests. The step itself (pure, jitted once with
explicit shardings and donation) lives in ``trainer.step``; it skips the update of a step whose
loss, gradient norm or learning rate is not finite and counts it. The loop around it:

* validates the config, the data and any checkpoint before it writes anything, raising a
  one-line ``fp8jax.errors.UserError`` naming the fix;
* logs each step's metrics to the console, TensorBoard and ``<workdir>/metrics.jsonl``;
* warns on every skipped step and stops after ``max_bad_steps`` in a row, leaving the last good
  state as the latest checkpoint (``NonFiniteLossError``);
* on SIGTERM checkpoints at the next step boundary and returns normally (pre-emption); a rerun
  with the same ``workdir`` resumes bit-exactly (same state, same data position).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from fp8jax import errors, models
from fp8jax.models import config as model_config
from fp8jax.parallel import comm
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.trainer import metrics as metrics_lib
from fp8jax.trainer import provenance
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like


class _Preempted:
    """SIGTERM flag: the loop checkpoints and returns at the next step boundary."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook kernels): no handler
            self._old = None
        return self

    def _handle(self, signum, frame):
        del signum, frame
        self.flag = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def check_loop_config(config: ml_collections.ConfigDict) -> None:
    """Raise a one-line ConfigError naming a bad optimizer, loop or mesh field and the fix."""
    model_config.check_training_fields(config)
    if config.grad_accum_dtype not in ("float32", ""):
        raise errors.ConfigError(
            f"config.grad_accum_dtype={config.grad_accum_dtype!r}: use 'float32' or '' (the "
            f"gradients' own dtype)"
        )
    if config.batch_size % config.grad_accum_steps:
        raise errors.ConfigError(
            f"batch_size={config.batch_size} is not divisible by grad_accum_steps="
            f"{config.grad_accum_steps}: change one of them"
        )


def check_platform(config: ml_collections.ConfigDict, mesh) -> None:
    """Raise a ConfigError if the config asks for a GPU-only kernel that the devices lack."""
    platform = mesh.devices.flat[0].platform
    if config.model.attention_impl == "cudnn" and platform != "gpu":
        # jax.nn.dot_product_attention would fail deep inside tracing with "cuDNN is not detected".
        raise errors.ConfigError(
            f"model.attention_impl='cudnn' (cuDNN flash attention) needs an NVIDIA GPU, but JAX "
            f"runs on {platform}: add --config.model.attention_impl=xla to run this config here"
        )


def validate(
    config: ml_collections.ConfigDict, training: bool = True, corpus: bool = False
) -> None:
    """Check every field's type and range, then the settings against each other and the devices.

    ``training=False`` (diagnostics.inspect) also accepts fp8.impl='flax', which only the trainer
    rejects. ``corpus=True`` (train_and_evaluate) also checks that the corpus and tokenizer
    can be built: the data path exists and the vocabulary fits the byte-level BPE.
    """
    try:
        models.check_config(config)
        check_loop_config(config)
        model_config.check_data_config(config, corpus=corpus)
        comm.CommConfig.from_config(config)
        mesh = sharding_lib.make_mesh(config.mesh)
        check_platform(config, mesh)
    except (KeyError, AttributeError) as e:  # ml_collections: a field the config file lacks
        raise errors.ConfigError(
            f"the config has no field {errors.field_name(e)!r}: add it (configs/base.py lists "
            f"every field with its default)"
        ) from e
    if training and config.fp8.impl != "fp8jax":
        raise errors.ConfigError(
            f"fp8.impl={config.fp8.impl!r} is for benchmarks/step.py's comparison with flax's "
            f"own FP8 op: train with fp8.impl='fp8jax'"
        )
    if config.fp8.level == "O3" and mesh.shape["fsdp"] == 1:
        # O3 is O2 with the masters and Adam state sharded over fsdp: with nothing to shard
        # over it would train as O2 under O3's name.
        raise errors.ConfigError(
            f"fp8.level='O3' shards the O2 state over mesh.fsdp, but the mesh has fsdp=1 "
            f"({dict(mesh.shape)}): use fp8.level='O2', or set mesh.fsdp > 1 (and as many devices)"
        )
    replicas = mesh.shape["data"] * mesh.shape["fsdp"] * config.grad_accum_steps
    if config.batch_size % replicas:
        raise errors.ConfigError(
            f"batch_size={config.batch_size} does not split over data x fsdp x grad_accum_steps "
            f"= {replicas}: use a multiple of {replicas} or change config.mesh"
        )


CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"  # in a source checkout


def load_config(name_or_path: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a config file, given its path or its name under ``configs/``."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".py":
        path = CONFIG_DIR / f"{name_or_path}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no config file {path}: pass a path or a name in {CONFIG_DIR}")
    # Loaded by path, as ml_collections' --config flag does (configs/ is not a package).
    spec = importlib.util.spec_from_file_location(f"fp8jax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


def partitionable(config: ml_collections.ConfigDict, mesh) -> ml_collections.ConfigDict:
    """``config``, with XLA's FP8 casts instead of the Pallas kernel where SPMD would split it.

    XLA's SPMD partitioner cannot split a Pallas custom call: it all-gathers the operand and
    casts the global tensor on every device. On two H200s (gpt_1b3 O1, data = 2) that was 13.7
    GB of bf16 all-gathers per device per step and 38.5k tokens/s per GPU, against 75k on one
    (benchmarks/RESULTS.md). Data-parallel replicas at O1+ run per device under shard_map
    (``step._manual_replicas``), where the kernel sees local arrays; tensor parallelism, or a
    step without FP8 communication, leaves the split to SPMD, so those use XLA's casts.
    """
    if not step_lib.splits_pallas_casts(config, mesh):
        return config
    cfg = comm.CommConfig.from_config(config)
    logging.log_first_n(
        logging.WARNING,
        "fp8.cast_kernel='pallas' cannot be split by XLA's partitioner (mesh %s, comm %s); "
        "using XLA's casts ('xla'). Set fp8.cast_kernel='xla' to silence this.",
        1,
        dict(mesh.shape),
        "on" if cfg.enabled else "off",
    )
    config = config.copy_and_resolve_references()
    config.fp8.cast_kernel = "xla"
    return config


def setup(config: ml_collections.ConfigDict, devices=None, donate: bool = True):
    """Build model, optimizer, mesh and the jitted steps (shared with inspect/benchmarks/tests)."""
    models.check_config(config)
    if "JAX_THREEFRY_GPU_KERNEL_LOWERING" not in os.environ:  # the user's own choice wins
        # The init draws every weight with threefry. Lowered to JAX's GPU kernel rather than
        # unrolled into XLA ops, gpt_1b3's init compiles in 6 s instead of 35 s on an H200
        # (benchmarks/RESULTS.md, 2026-11-30, third); other platforms ignore the flag.
        jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    check_platform(config, mesh)
    config = partitionable(config, mesh)
    model = models.build_model(config)
    tx = step_lib.make_optimizer(config)
    init_fn = functools.partial(step_lib.init_state, model, tx, config)
    abstract = jax.eval_shape(init_fn, jax.random.PRNGKey(config.seed))
    state_sh = sharding_lib.state_shardings(model, config, abstract, mesh)
    batch_sh = sharding_lib.batch_sharding(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(model, tx, config, mesh=mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, sharding_lib.replicated(mesh)),
        donate_argnums=0 if donate else (),
    )
    eval_step = jax.jit(step_lib.make_eval_step(model, mesh), in_shardings=(state_sh, batch_sh))
    return dict(
        mesh=mesh,
        model=model,
        tx=tx,
        init=jax.jit(init_fn, out_shardings=state_sh),
        abstract=abstract,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        train_step=train_step,
        eval_step=eval_step,
        stats_step=jax.jit(step_lib.make_stats_step(model, mesh)),
    )


def abstract_batch(config, batch_size=None):
    """ShapeDtypeStructs of one training batch."""
    shape = (batch_size or config.batch_size, config.seq_len)
    spec = jax.ShapeDtypeStruct(shape, jnp.int32)
    return {"inputs": spec, "targets": spec}


def evaluate(eval_step, state, batches, sharding) -> dict:
    """Mean validation loss and perplexity over fixed batches."""
    losses = [eval_step(state, sharding_lib.put_batch(b, sharding)) for b in batches]
    loss = float(np.mean(jax.device_get(losses)))
    return {"val_loss": loss, "val_perplexity": float(np.exp(min(loss, 50.0)))}


def sample(model, state, tokenizer, prompt: str, num_tokens: int, max_len: int, seed=0) -> str:
    """Sample ``num_tokens`` tokens after ``prompt`` (temperature 0.8, fixed-length buffer).

    The parameters and FP8 state are arguments of the one jitted step, not constants captured
    in its program (at 1.3B those would be gigabytes of constants to lower and compile).
    """
    from fp8jax.optim import adam as optim

    ids = tokenizer.encode(prompt)[-(max_len - num_tokens) :] or [0]
    n0 = len(ids)
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :n0] = ids
    coll = step_lib.state_collection(model)

    @jax.jit
    def next_token(params, fp8, tokens_1xL, pos, key):
        logits_1xLxV = model.apply({"params": optim.materialize(params), coll: fp8}, tokens_1xL)
        return jax.random.categorical(key, logits_1xLxV[0, pos - 1] / 0.8)

    key = jax.random.PRNGKey(seed)
    pos = n0 - 1
    for pos in range(n0, min(max_len, n0 + num_tokens)):
        key, sub = jax.random.split(key)
        buf[0, pos] = int(next_token(state.params, state.fp8, jnp.asarray(buf), pos, sub))
    return tokenizer.decode(buf[0, : pos + 1].tolist())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train ``config`` in ``workdir`` (resuming if a checkpoint is there); return final metrics.

    Bad input raises a ``UserError`` (config, data, checkpoint) before anything in ``workdir``
    is overwritten; ``max_bad_steps`` non-finite steps in a row raise ``NonFiniteLossError``.
    """
    if config.get("distributed", False) is True:  # anything else: validate names the field
        sharding_lib.initialize_distributed()
    with errors.reraise_as(errors.ConfigError, ValueError, TypeError):
        validate(config, corpus=True)
    os.makedirs(workdir, exist_ok=True)
    metrics_lib.quiet_library_logs()
    use_compilation_cache(config.compilation_cache_dir)
    logging.info("fp8jax: level %s, devices %s", config.fp8.level, jax.devices())
    # From here SIGTERM only sets a flag; the loop checkpoints and returns at a step boundary.
    with _Preempted() as preempt:
        with errors.reraise_as(errors.DataError, ValueError, OSError):
            from fp8jax.trainer import data as data_lib  # here: setup() must not need grain

            dataset = data_lib.build(config, workdir)
            train_iter = dataset.train_iter()
            eval_batches = dataset.eval_batches(config.eval_batches)
        env = setup(config)
        ckpt = Checkpointer(
            workdir, keep=config.keep_checkpoints, every=config.checkpoint_every_steps
        )
        try:
            state, step = _restore_or_init(config, env, ckpt, train_iter)
            _record_schedule(workdir, config, step)
            state, summary = _train(
                config, env, ckpt, state, step, train_iter, eval_batches, preempt
            )
        finally:
            ckpt.close()
    summary_path = os.path.join(workdir, "summary.json")
    before = provenance.read_json(pathlib.Path(summary_path)) or {}
    before.pop("preempted_at", None)
    if step >= config.num_train_steps:  # restored a finished run: nothing trained
        logging.info("the run in %s already reached step %d: nothing to train", workdir, step)
    elif config.sample_tokens > 0 and "preempted_at" not in summary:
        prompt, n = "The ", config.sample_tokens
        t0 = time.perf_counter()
        summary["sample"] = sample(
            env["model"], state, dataset.tokenizer, prompt, n, config.seq_len
        )
        logging.info("sample (%.1f s): %s", time.perf_counter() - t0, summary["sample"])
    summary = {**before, **summary}  # a rerun or resume adds to what earlier runs reported
    provenance.write_json(pathlib.Path(summary_path), summary)
    return summary


def use_compilation_cache(directory: str) -> None:
    """Keep compiled XLA programs in ``directory`` (JAX's persistent cache) so reruns skip
    compiling; '' leaves JAX's setting alone, and so does a cache the user set up."""
    if not directory or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


# Fields that define the learning-rate schedule (fp8jax.trainer.step.learning_rate_schedule).
_SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "num_train_steps", "min_lr_ratio")


def _record_schedule(workdir: str, config, step: int) -> None:
    """Keep the schedule's fields in ``<workdir>/schedule.json``; warn when a resume changes them.

    The schedule is a function of the step and these fields, so a resumed run with another
    ``num_train_steps`` follows another curve from the restored step on (cosine re-stretched).
    """
    path = os.path.join(workdir, "schedule.json")
    now = {k: config[k] for k in _SCHEDULE_FIELDS}
    before = provenance.read_json(pathlib.Path(path)) or {}
    changed = {k: (before[k], v) for k, v in now.items() if k in before and before[k] != v}
    if step > 0 and changed:
        old = config.copy_and_resolve_references()
        for k, (v, _) in changed.items():
            old[k] = v
        lr_old = float(step_lib.learning_rate_schedule(old)(step))
        lr_new = float(step_lib.learning_rate_schedule(config)(step))
        logging.warning(
            "resuming at step %d with a changed learning-rate schedule (%s): from here the "
            "rate follows the new one (%.4g at this step, %.4g under the old), its cosine "
            "decaying until step %d",
            step, ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), lr_new, lr_old,
            config.num_train_steps,
        )  # fmt: skip
    if now != before:
        provenance.write_json(pathlib.Path(path), now)


def _restore_or_init(config, env, ckpt, train_iter):
    """The latest checkpoint's state (and data position) if there is one, else a fresh state."""
    step = ckpt.latest_step()
    if step is None:
        n = sum(x.size for x in jax.tree.leaves(env["abstract"].params))
        logging.info("initialising %.4g M parameters (seed %d)", n / 1e6, config.seed)
        return env["init"](jax.random.PRNGKey(config.seed)), 0
    state, data_state = ckpt.restore(abstract_like(env["abstract"], env["state_shardings"]), step)
    train_iter.set_state(data_state)
    logging.info("resuming from checkpoint step %d in %s", step, ckpt.directory)
    return state, step


def _train(config, env, ckpt, state, step, train_iter, eval_batches, preempt):
    """The loop from ``step`` to ``num_train_steps``; returns the final state and summary."""
    if preempt.flag:  # SIGTERM during start-up: nothing new to save, skip the compile
        logging.warning("SIGTERM before the first step; exiting")
        return state, {"step": step, "preempted_at": step}
    if step >= config.num_train_steps:  # a finished run: nothing to compile or train
        return state, {"step": step}
    cache = jax.config.jax_compilation_cache_dir
    logging.info(
        "compiling the train step (level %s; %s)",
        config.fp8.level,
        f"cached in {cache} for reruns" if cache else "no compilation cache",
    )
    t0 = time.perf_counter()
    compiled = env["train_step"].lower(state, abstract_batch(config)).compile()
    logging.info("train step compiled in %.1f s", time.perf_counter() - t0)
    metrics_lib.log_memory(compiled)
    log = _Log(os.path.dirname(ckpt.directory), config, step)
    guard = _NonFiniteGuard(config.max_bad_steps)
    pending = None  # (step, metrics) whose non-finite count is read one step late
    try:
        while step < config.num_train_steps and not preempt.flag:
            batch = sharding_lib.put_batch(next(train_iter), env["batch_sharding"])
            state, metrics = compiled(state, batch)
            step += 1
            log.bar.update()
            # Read the previous step's count only now, so this step is already dispatched.
            if pending is not None:
                guard.check(*pending)
            pending = (step, metrics)
            last = step == config.num_train_steps
            if step % config.log_every_steps == 0 or last:
                log.train(step, metrics)
                guard.check(step, metrics)
            if step % config.eval_every_steps == 0 or last:
                log.first("evaluation: compiling the eval step")
                log.eval(step, evaluate(env["eval_step"], state, eval_batches,
                                        env["batch_sharding"]))  # fmt: skip
            if config.fp8.level != "O0" and step % config.fp8_stats_every_steps == 0:
                log.first("FP8 health pass: compiling the stats step")
                stats = env["stats_step"](state, batch)
                log.fp8(step, metrics_lib.fp8_health(state, stats), metrics_lib.fp8_worst(stats))
            ckpt.save(step, state, train_iter.get_state())
        if pending is not None:
            guard.check(*pending)
    except errors.NonFiniteLossError as e:
        # Skipped steps leave the state as it was, so unless the state itself went bad (then
        # the save is refused) this checkpoints the last good state.
        ckpt.save(step, state, train_iter.get_state(), force=True, wait=True)
        good = ckpt.latest_step()
        saved = f"checkpointed at step {good} in {ckpt.directory}" if good is not None else "lost"
        raise errors.NonFiniteLossError(
            f"{e}; the last good state is {saved}. Lower the learning rate, check the data, "
            f"or raise config.max_bad_steps"
        ) from None
    finally:
        log.close()
    summary = log.summary
    if preempt.flag and step < config.num_train_steps:
        logging.warning("SIGTERM: checkpointing step %d in %s; exiting", step, ckpt.directory)
        summary["preempted_at"] = step
    ckpt.save(step, state, train_iter.get_state(), force=True)
    return state, {**summary, "step": step}


class _NonFiniteGuard:
    """Warns about each skipped step; raises NonFiniteLossError after ``max_bad`` in a row."""

    def __init__(self, max_bad: int):
        self.max_bad, self.checked = max_bad, 0

    def check(self, step: int, metrics) -> None:
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
            step, loss, gnorm, lr, bad, int(metrics["skipped_steps"]),
        )  # fmt: skip
        if bad >= self.max_bad:
            raise errors.NonFiniteLossError(
                f"{bad} consecutive non-finite steps ({step - bad + 1}..{step}, last loss={loss}, "
                f"grad_norm={gnorm})"
            )


# A larger share of an operand's FP8 values clipped or flushed than this is logged as a warning:
# delayed scaling keeps healthy operands far below it (a clip only while an amax grows).
HEALTH_WARN_SHARE = 1e-3


class _Log:
    """Metrics to the console, TensorBoard and ``<workdir>/metrics.jsonl`` (a JSON per line)."""

    def __init__(self, workdir: str, config, step: int):
        main = jax.process_index() == 0
        self.writer = metrics_lib.Writer(workdir, enabled=main)
        # One os.write per record on an O_APPEND file: a kill leaves whole lines only.
        path = os.path.join(workdir, "metrics.jsonl")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if main else None
        self.bar = tqdm(total=config.num_train_steps, initial=step, desc="train", unit="step",
                        disable=not main)  # fmt: skip
        self.tokens_per_step = config.batch_size * config.seq_len
        self.last_step, self.t_last = step, time.perf_counter()
        self.summary = {}
        self.seen = set()

    def train(self, step: int, metrics) -> None:
        m = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        m["tokens_per_s"] = (
            (step - self.last_step) * self.tokens_per_step / max(now - self.t_last, 1e-9)
        )
        self.last_step, self.t_last = step, now
        self.bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
        self._emit(step, "train", m)
        self.summary.update({f"train_{k}": v for k, v in m.items()})

    def first(self, what: str) -> None:
        """Log ``what`` the first time it is seen (a compile the console would otherwise hide)."""
        if what not in self.seen:
            self.seen.add(what)
            logging.info("first %s", what)

    def eval(self, step: int, values: dict) -> None:
        self._emit(step, "eval", values)
        self.summary.update(values)

    def fp8(self, step: int, health: dict, worst: dict) -> None:
        self.writer.scalars(step, health)
        self.writer.scalars(step, worst)  # the two shares; the "_at" names are not scalars
        logging.info("step %d: %s", step, metrics_lib.fmt(worst))
        for kind in ("saturated", "flushed"):
            share = worst[f"fp8_max_{kind}"]
            if not share <= HEALTH_WARN_SHARE:  # NaN too
                logging.warning(
                    "step %d: %.3g of %s's FP8 values %s (more than %.2g): its scale is off or "
                    "an outlier sets it; see fp8_stats/* in TensorBoard (fp8.margin, "
                    "fp8.history_len, fp8.recipe='current')",
                    step, share, worst[f"fp8_max_{kind}_at"],
                    "clip at the format max" if kind == "saturated" else "flush to zero",
                    HEALTH_WARN_SHARE,
                )  # fmt: skip
        self._append({"step": step, **worst})

    def _emit(self, step: int, prefix: str, values: dict) -> None:
        self.writer.scalars(step, {f"{prefix}/{k}": v for k, v in values.items()})
        logging.info("step %d: %s", step, metrics_lib.fmt(values))
        self._append({"step": step, **values})

    def _append(self, record: dict) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
