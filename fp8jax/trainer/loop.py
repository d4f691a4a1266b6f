"""The training loop: ``train_and_evaluate(config, workdir)``, and ``setup(run)``.

Called by ``train.py``, the notebooks and the tests. The step itself (pure, jitted once with
explicit shardings and donation) lives in ``trainer.step``; it skips the update of a step whose
loss, gradient norm or learning rate is not finite and counts it. The loop around it:

* parses the config once (``spec.parse``) and checks it against the devices and the corpus
  before it writes anything, raising a one-line ``fp8jax.errors.UserError`` naming the fix;
* logs each step's metrics to the console, TensorBoard and ``<workdir>/metrics.jsonl``;
* warns on every skipped step and stops after ``max_bad_steps`` in a row, leaving the last good
  state as the latest checkpoint (``NonFiniteLossError``);
* on SIGTERM checkpoints at the next step boundary and returns normally (pre-emption); a rerun
  with the same ``workdir`` resumes bit-exactly (same state, same data position).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import signal
import threading
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.sharding import Mesh

from fp8jax import configs, errors, models, provenance, spec
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.diagnostics import memory
from fp8jax.models import moe
from fp8jax.ops import kernels
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.spec import RunSpec
from fp8jax.trainer import environment, formats, generate, inference, objectives, workdir_lock
from fp8jax.trainer import metrics as metrics_lib
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like

__all__ = [
    "Setup",
    "VOCAB_MULTIPLE",
    "abstract_batch",
    "data_tokenizer",
    "from_checkpoint",
    "init_moe_state",
    "keep_tokenizer",
    "load_config",
    "objective_of",
    "partitionable",
    "setup",
    "train_and_evaluate",
    "use_compilation_cache",
]

# The model's vocabulary is an existing tokenizer's rounded up to a multiple of this, so the
# embedding and output GEMMs keep tile-aligned shapes (ids past the tokenizer's never occur).
VOCAB_MULTIPLE = 128
# What lowers a train step's memory, for a run that does not fit its devices.
_MEMORY_FIXES = (
    "lower config.batch_size (or raise config.grad_accum_steps), set config.model.remat_policy="
    "'full', config.model.loss_chunk (e.g. 4096), a higher config.fp8.level, or spread the "
    "model over more devices (config.mesh.fsdp)"
)


class _Preempted:
    """SIGTERM flag: the loop checkpoints and returns at the next step boundary; so does a first
    Ctrl-C while the steps run (``catch_interrupts``), after which the run raises
    KeyboardInterrupt."""

    def __init__(self):
        self.flag = False
        self.interrupted = False  # the flag is a Ctrl-C's
        self._old = None
        self._old_sigint = None

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
        self.release_interrupts()
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)

    def catch_interrupts(self) -> None:
        """From now until ``release_interrupts``, a first Ctrl-C (SIGINT) sets the flag and a
        second one raises KeyboardInterrupt at once; nothing changes where Ctrl-C does not
        raise it (ignored, a handler of the caller's) or off the main thread."""
        old = signal.getsignal(signal.SIGINT)
        main = threading.current_thread() is threading.main_thread()
        if old is not signal.default_int_handler or not main:
            return

        def handle(signum, frame):
            del signum, frame
            self.flag = self.interrupted = True
            self.release_interrupts()
            logging.warning(
                "Ctrl-C: the run stops after this step, checkpointed; Ctrl-C again stops it at "
                "once, losing the steps since the last checkpoint"
            )

        signal.signal(signal.SIGINT, handle)
        self._old_sigint = old

    def release_interrupts(self) -> None:
        """Ctrl-C raises KeyboardInterrupt again (as before ``catch_interrupts``)."""
        if self._old_sigint is not None:
            signal.signal(signal.SIGINT, self._old_sigint)
            self._old_sigint = None


load_config = configs.load  # a shipped config by name ("tiny") or a config file by path


def partitionable(run: RunSpec, mesh: Mesh) -> RunSpec:
    """``run``, with XLA ops instead of the Pallas kernels where SPMD would split them.

    XLA's SPMD partitioner cannot split a Pallas custom call: it all-gathers the operand and
    runs the kernel on the global tensor on every device (measured: docs/performance.md).
    FP8 casts: data-parallel replicas at O1+ run per device under shard_map
    (``step._manual_replicas``), where the kernel sees local arrays; tensor parallelism, or a
    step without FP8 communication, leaves the split to SPMD, so those use XLA's casts. The
    decode attention ('auto'): the end-of-run sample's KV cache is split like the batch and the
    heads on any mesh of several devices, so its steps use XLA's attention there.
    """
    model = run.model
    if step_lib.splits_pallas_casts(run, mesh):
        logging.log_first_n(
            logging.WARNING,
            "fp8.cast_kernel='pallas' cannot be split by XLA's partitioner (mesh %s, comm %s); "
            "using XLA's casts ('xla'). Set fp8.cast_kernel='xla' to silence this.",
            1,
            dict(mesh.shape),
            "on" if run.comm.enabled else "off",
        )
        model = dataclasses.replace(model, cast_kernel="xla")
    if mesh.size > 1 and model.decode_attention == kernels.AUTO:
        model = dataclasses.replace(model, decode_attention="xla")
    return run if model is run.model else dataclasses.replace(run, model=model)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``setup`` builds for a run: mesh, model, optimizer and the jitted steps."""

    run: RunSpec  # the run the steps were built from (after ``partitionable``)
    mesh: Mesh
    model: models.Transformer
    tx: Any  # optax.GradientTransformation
    objective: objectives.Objective  # what the steps minimise and report (the data format's)
    init: Any  # jitted (rng, params=None) -> TrainState, sharded (params: given weights)
    abstract: step_lib.TrainState  # ShapeDtypeStructs of the state
    state_shardings: step_lib.TrainState  # a NamedSharding per state leaf
    batch_sharding: Any  # NamedSharding of a batch's leaves
    train_step: Any  # jitted (state, batch) -> (state, metrics)
    eval_step: Any  # jitted (state, batch) -> the objective's metrics (LM: the loss)
    stats_step: Any  # jitted (state, batch) -> per-layer FP8 health


def setup(run: RunSpec, devices=None, donate: bool = True) -> Setup:
    """Build model, optimizer, mesh and the jitted steps (shared with inspect/benchmarks/tests)."""
    if "JAX_THREEFRY_GPU_KERNEL_LOWERING" not in os.environ:  # the user's own choice wins
        # The init draws every weight with threefry: lowered to JAX's GPU kernel rather than
        # unrolled into XLA ops, a large model's init compiles several times faster
        # (measured: docs/performance.md); other platforms ignore the flag.
        jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    mesh = sharding_lib.make_mesh(run.mesh, devices)
    environment.check_platform(run.model, mesh)
    run = partitionable(run, mesh)
    model = models.build_model(run.model)
    tx = step_lib.make_optimizer(run)
    objective = objective_of(run)
    init_fn = functools.partial(step_lib.init_state, model, tx, run, objective=objective)
    abstract = jax.eval_shape(init_fn, jax.random.PRNGKey(run.seed))
    state_sh = sharding_lib.state_shardings(model, abstract, mesh)
    batch_sh = sharding_lib.batch_sharding(mesh)
    train_step = jax.jit(
        step_lib.make_train_step(model, tx, run, mesh=mesh, objective=objective),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, sharding_lib.replicated(mesh)),
        donate_argnums=0 if donate else (),
    )
    eval_fn = step_lib.make_eval_step(model, mesh, objective)
    eval_step = jax.jit(eval_fn, in_shardings=(state_sh, batch_sh))
    return Setup(
        run=run,
        mesh=mesh,
        model=model,
        tx=tx,
        objective=objective,
        init=jax.jit(init_fn, out_shardings=state_sh),
        abstract=abstract,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        train_step=train_step,
        eval_step=eval_step,
        stats_step=jax.jit(step_lib.make_stats_step(model, mesh)),
    )


def objective_of(run: RunSpec) -> objectives.Objective:
    """The objective ``run``'s data format trains, with the run's hyper-parameters."""
    return objectives.get(formats.get(run.data.format).objective).from_run(run)


def abstract_batch(run: RunSpec, batch_size: int | None = None) -> dict:
    """ShapeDtypeStructs of one training batch (its data format's keys: fine-tuning adds
    weights, positions and segment ids)."""
    shape = (batch_size or run.optim.batch_size, run.optim.seq_len)
    dtypes = formats.get(run.data.format).dtypes
    return {k: jax.ShapeDtypeStruct(shape, d) for k, d in dtypes.items()}


def from_checkpoint(run: RunSpec, workdir: str) -> tuple[RunSpec, Any, Any]:
    """``run`` with the ``init_from`` checkpoint's architecture, its tokenizer and its weights.

    Without ``init_from``: ``(run, None, None)``. A resume (``workdir`` holds the run's own
    checkpoint) takes the model and tokenizer the run recorded and no weights: it restores its
    own. A missing or unsupported checkpoint is a one-line UserError, raised before any write.
    """
    if not run.init_from:
        return run, None, None
    path = pathlib.Path(run.init_from).expanduser()
    resumed = provenance.has_checkpoint(workdir)
    if not resumed and not path.is_dir():
        raise errors.ConfigError(
            f"config.init_from={run.init_from!r} is not a directory: name a Hugging Face model "
            f"dir (config.json, *.safetensors, tokenizer.json) or an fp8jax work dir"
        )
    from fp8jax import hf  # the checkpoint readers (safetensors, orbax)

    with errors.reraise_as(errors.CheckpointMismatchError, ValueError, OSError, KeyError):
        if resumed:
            model = dataclasses.replace(run.model, **hf.architecture(workdir))
            tokenizer, params = tokenizer_lib.load_hf(workdir), None
        else:
            loaded = hf.load(str(path), run.model)
            model, tokenizer, params = loaded.model_cfg, loaded.tokenizer, loaded.params
    if run.optim.seq_len > model.max_len:
        raise errors.ConfigError(
            f"seq_len={run.optim.seq_len} exceeds the max_len={model.max_len} of the model in "
            f"{path}: lower seq_len"
        )
    unused = [
        f"model.{f.name}={getattr(run.model, f.name)!r} (the checkpoint's: "
        f"{getattr(model, f.name)!r})"
        for f in dataclasses.fields(model)
        if getattr(model, f.name) != getattr(run.model, f.name)
    ]
    if unused and not resumed:  # set on the command line, they would be dropped unseen
        logging.warning(
            "config.init_from: the architecture is that of %s; the config's %s not used",
            path,
            ", ".join(unused) + (" is" if len(unused) == 1 else " are"),
        )
    return dataclasses.replace(run, model=model), tokenizer, params


def init_moe_state(run: RunSpec) -> Any:
    """The MoE router biases a fresh ``init_from`` run starts with: the latest checkpoint's of
    the fp8jax work dir it names, in ``run``'s layout (scanned or per block).

    None (the model's zeros) where there are none to carry: a Hugging Face dir (which has no
    such biases), a work dir that saved none, or a model that keeps none (warned where the work
    dir has some). Biases of other layers or experts than ``run``'s model's are a one-line
    ConfigError, raised before any write.
    """
    from fp8jax import hf  # the checkpoint readers (config.json, orbax)

    path = pathlib.Path(run.init_from).expanduser().absolute()  # orbax reads absolute paths
    if (path / hf.architectures.CONFIG).is_file() or not hf.workdir.is_workdir(path):
        return None  # a Hugging Face dir: no router biases
    saved = inference.saved_moe_state(path)
    if not saved:
        return None
    fresh = inference.fresh_moe_state(run.model)
    if not fresh:
        logging.warning(
            "%s holds MoE router biases that this model does not keep (its "
            "model.moe.bias_update_rate is 0): the router selects without them",
            path,
        )
        return None
    source_scanned = jax.tree.leaves(saved)[0].ndim == 2  # [layers, experts], else [experts]
    bias_LxE = moe.stacked_bias(saved, source_scanned)
    want = moe.stacked_bias(fresh, run.model.scan_layers).shape
    if bias_LxE.shape != want:
        raise errors.ConfigError(
            f"config.init_from={run.init_from!r} holds router biases of {bias_LxE.shape[0]} "
            f"layers x {bias_LxE.shape[1]} experts, the model {want[0]} x {want[1]}: point "
            "init_from at a work dir of this model's layers and experts"
        )
    return moe.unstacked_bias(bias_LxE, fresh, run.model.scan_layers)


def data_tokenizer(run: RunSpec, workdir: str, tokenizer: Any) -> tuple[RunSpec, Any]:
    """``run`` with the vocabulary of ``config.data.tokenizer``, and that tokenizer; ``(run,
    tokenizer)`` as given when it is ''. A tokenizer that does not load, one beside init_from,
    or a resume with another tokenizer than the checkpoint's is a one-line UserError."""
    name = run.data.tokenizer
    if not name:
        return run, tokenizer
    if run.init_from:
        raise errors.ConfigError(
            f"config.data.tokenizer={name!r} and config.init_from={run.init_from!r} both bring a "
            "tokenizer: set data.tokenizer='' to train with the checkpoint's"
        )
    try:
        tok = tokenizer_lib.load(name)
    except ValueError as e:
        raise errors.ConfigError(f"config.data.tokenizer={name!r}: {e}") from None
    kept = pathlib.Path(workdir) / tokenizer_lib.HF_TOKENIZER
    if provenance.has_checkpoint(workdir) and kept.is_file():
        if tokenizer_lib.sha256(kept.read_text(encoding="utf-8")) != tokenizer_lib.sha256(
            tok.to_str()
        ):
            raise errors.DataError(
                f"config.data.tokenizer={name!r} is not the tokenizer {kept} the checkpoint in "
                f"{workdir} was trained with (its ids are in the embeddings): name that one, or "
                "start a fresh --workdir"
            )
    vocab = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    logging.info("tokenizer %s: %d ids, model vocabulary %d", name, tok.vocab_size, vocab)
    return dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=vocab)), tok


def keep_tokenizer(workdir: str, tok) -> None:
    """Save ``tok`` in ``workdir`` as a HF tokenizer (tokenizer.json + tokenizer_config.json
    with its EOS, BOS and chat template), so the work dir reloads with everything it had."""
    config = dict(eos_token=tok.eos_token, bos_token=tok.bos_token, chat_template=tok.chat_template)
    provenance.write_json(pathlib.Path(workdir) / "tokenizer_config.json", config)
    tok.save(pathlib.Path(workdir) / tokenizer_lib.HF_TOKENIZER)


def train_and_evaluate(config: ml_collections.ConfigDict | RunSpec, workdir: str) -> dict:
    """Train ``config`` in ``workdir`` (resuming if a checkpoint is there); return final metrics.

    ``config``: a config (parsed here, once) or a ``RunSpec``; ``workdir``: a folder (``~``
    expanded) outside any other work dir's managed folders. Bad input raises a ``UserError``
    (config, data, checkpoint) before anything in ``workdir`` is overwritten; ``max_bad_steps``
    non-finite steps in a row raise ``NonFiniteLossError``. One process at a time trains in a
    work dir (``workdir_lock``); a new one that a refused run leaves empty is removed. A Ctrl-C
    while steps run ends the step, checkpoints it and then raises KeyboardInterrupt.
    """
    workdir = os.path.expanduser(os.fspath(workdir))  # '--workdir=~/runs/x' reaches us as is
    provenance.check_outside_managed(workdir, "--workdir")
    new = not os.path.lexists(workdir)
    try:
        with contextlib.ExitStack() as locks:
            return _train_and_evaluate(config, workdir, locks)
    except errors.UserError:
        if new:
            workdir_lock.remove_if_unused(workdir)
        raise


def _train_and_evaluate(config, workdir: str, locks: contextlib.ExitStack) -> dict:
    run = config if isinstance(config, RunSpec) else spec.parse(config)
    environment.check_corpus(run)
    run, tokenizer, init_params = from_checkpoint(run, workdir)
    # A fresh fine-tuning run's router biases: its source's (a resume restores its own).
    init_moe = init_moe_state(run) if init_params is not None else None
    run, tokenizer = data_tokenizer(run, workdir, tokenizer)
    if run.distributed:
        sharding_lib.initialize_distributed()
    environment.check_environment(run)
    workdir_lock.make_workdir(workdir)
    if jax.process_index() == 0:  # the run's first process holds the lock until the end
        locks.enter_context(workdir_lock.hold(workdir))
    metrics_lib.quiet_library_logs()
    use_compilation_cache(run.loop.compilation_cache_dir)
    logging.info("fp8jax: level %s, devices %s", run.fp8.level, jax.devices())
    # From here SIGTERM only sets a flag; the loop checkpoints and returns at a step boundary.
    with _Preempted() as preempt:
        with errors.reraise_as(errors.DataError, ValueError, OSError):
            dataset = formats.build(run, workdir, tokenizer)
            # A fresh fine-tuning run, or one with an existing tokenizer: keep the tokenizer.
            if init_params is not None or run.data.tokenizer:
                keep_tokenizer(workdir, tokenizer)
            train_iter = dataset.train_iter()
            eval_batches = dataset.eval_batches(run.loop.eval_batches)
        env = setup(run)
        ckpt = Checkpointer(
            workdir, keep=run.loop.keep_checkpoints, every=run.loop.checkpoint_every_steps
        )
        try:
            state, step = _restore_or_init(env, ckpt, train_iter, init_params, init_moe)
            # Only now: a checkpoint of another model must leave the work dir as it was.
            provenance.record_model(workdir, env.run.model)
            step_lib.record_schedule(workdir, run.optim, step)
            sample = run.loop.sample_tokens > 0 and step < run.optim.num_train_steps
            # The sample's programs compile in the background while the run trains.
            compiled = (
                generate.compile_sample(env.model, state, dataset.tokenizer, run.loop.sample_tokens)
                if sample
                else None
            )
            state, summary = _train(env, ckpt, state, step, train_iter, eval_batches, preempt)
            if step >= run.optim.num_train_steps:
                logging.info("the run in %s already reached step %d", workdir, step)
            elif sample and "preempted_at" not in summary:
                # While the last checkpoint is still being written in the background.
                summary["sample"] = generate.end_sample(
                    env.model, state, dataset.tokenizer, run.loop.sample_tokens, compiled=compiled
                )
        finally:
            ckpt.close()
    summary_path = os.path.join(workdir, "summary.json")
    before = provenance.read_json(pathlib.Path(summary_path)) or {}
    before.pop("preempted_at", None)
    summary = {**before, **summary}  # a rerun or resume adds to what earlier runs reported
    provenance.write_json(pathlib.Path(summary_path), summary)
    if preempt.interrupted and "preempted_at" in summary:
        raise KeyboardInterrupt(
            f"Ctrl-C at step {summary['step']}, checkpointed in {ckpt.directory}; rerun the same "
            "command to resume"
        )
    return summary


def use_compilation_cache(directory: str, name: str = "config.compilation_cache_dir") -> None:
    """Keep compiled XLA programs in ``directory`` (JAX's persistent cache) so reruns skip
    compiling; '' leaves JAX's setting alone, and so does a cache the user set up. A folder
    that cannot be created (a file of that name, a read-only mount) is a one-line ConfigError
    naming the setting ``name``, not a JAX warning at every compile."""
    if not directory or jax.config.jax_compilation_cache_dir:
        return
    path = os.path.expanduser(directory)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        why = errors.folder_failure(path, e)
        raise errors.ConfigError(
            f"{name}={directory!r} cannot hold compiled programs ({why}); name a folder you can "
            "write, or '' for no compilation cache"
        ) from None
    jax.config.update("jax_compilation_cache_dir", path)


def _restore_or_init(env: Setup, ckpt: Checkpointer, train_iter, params=None, moe_state=None):
    """The latest checkpoint's state (and data position) if there is one, else a fresh state
    (from ``params`` and ``moe_state``, an init_from checkpoint's weights and router biases,
    if given); None for a run that already reached its last step (nothing is restored)."""
    step = ckpt.latest_step()
    rng = jax.random.PRNGKey(env.run.seed)
    if step is None and params is not None:
        logging.info("initialising from the weights of %s", env.run.init_from)
        return env.init(rng, params, moe_state=moe_state), 0
    if step is None:
        n = sum(x.size for x in jax.tree.leaves(env.abstract.params))
        logging.info("initialising %.4g M parameters (seed %d)", n / 1e6, env.run.seed)
        return env.init(rng), 0
    abstract = abstract_like(env.abstract, env.state_shardings)
    if step >= env.run.optim.num_train_steps:
        # A finished run trains nothing and uses no array: its step is only checked against
        # this config, from the metadata (reading and checking 14 GB took 24 s on gpt_1b3).
        ckpt.check(abstract, step)
        return None, step
    state, data_state = ckpt.restore(abstract, step)
    train_iter.set_state(data_state)
    logging.info("resuming from checkpoint step %d in %s", step, ckpt.directory)
    return state, step


def _train(env: Setup, ckpt, state, step, train_iter, eval_batches, preempt):
    """The loop from ``step`` to ``num_train_steps``; returns the final state and summary."""
    run = env.run
    num_steps, loop = run.optim.num_train_steps, run.loop
    if preempt.flag:  # SIGTERM during start-up: nothing new to save, skip the compile
        logging.warning("SIGTERM before the first step; exiting")
        return state, {"step": step, "preempted_at": step}
    if step >= num_steps:  # a finished run: nothing to compile or train
        return state, {"step": step}
    cache = jax.config.jax_compilation_cache_dir
    logging.info(
        "compiling the train step (level %s; %s)",
        run.fp8.level,
        f"cached in {cache} for reruns" if cache else "no compilation cache",
    )
    t0 = time.perf_counter()
    compiled = env.train_step.lower(state, abstract_batch(run)).compile()
    logging.info("train step compiled in %.1f s", time.perf_counter() - t0)
    memory.check_fits(metrics_lib.log_memory(compiled), "the train step", _MEMORY_FIXES)
    tokens_per_step = run.optim.batch_size * run.optim.seq_len
    log = metrics_lib.RunLog(os.path.dirname(ckpt.directory), num_steps, tokens_per_step, step)
    guard = metrics_lib.NonFiniteGuard(loop.max_bad_steps)
    fp8_stats = run.fp8.level.fp8_gemms

    def report(done: int, metrics) -> None:
        """Log step ``done``'s metrics if due and check its non-finite count (reads them)."""
        if done % loop.log_every_steps == 0 or done == num_steps:
            log.train(done, metrics)
        guard.check(done, metrics)

    # A step's metrics are read once the next step is dispatched, so the device never waits
    # for the host's logging, data loading or progress bar; steps that wait for the device
    # anyway (evaluation, FP8 health, checkpoint, the last) report theirs before that work.
    pending = None
    preempt.catch_interrupts()
    try:
        while step < num_steps and not preempt.flag:
            batch = sharding_lib.put_batch(next(train_iter), env.batch_sharding)
            state, metrics = compiled(state, batch)
            step += 1
            log.bar.update()
            if pending is not None:
                report(*pending)
            pending = (step, metrics)
            evaluates = step % loop.eval_every_steps == 0 or step == num_steps
            checks_fp8 = fp8_stats and step % loop.fp8_stats_every_steps == 0
            if evaluates or checks_fp8 or ckpt.due(step):
                report(*pending)
                pending = None
            if evaluates:
                log.first("evaluation: compiling the eval step")
                evaluated = env.objective.evaluate(
                    env.eval_step, state, eval_batches, env.batch_sharding
                )
                log.eval(step, evaluated)
            if checks_fp8:
                log.first("FP8 health pass: compiling the stats step")
                stats = env.stats_step(state, batch)
                log.fp8(step, metrics_lib.fp8_health(state, stats), metrics_lib.fp8_worst(stats))
            ckpt.save(step, state, train_iter.get_state())
        if pending is not None:
            report(*pending)
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
        preempt.release_interrupts()
        log.close()
    summary = log.summary
    if preempt.flag and step < num_steps:
        why = "Ctrl-C" if preempt.interrupted else "SIGTERM"
        logging.warning("%s: checkpointing step %d in %s; exiting", why, step, ckpt.directory)
        summary["preempted_at"] = step
    ckpt.save(step, state, train_iter.get_state(), force=True)
    if step in ckpt.refused:  # the state itself is not finite: the run has nothing to keep
        ckpt.wait()  # the saves in flight finish first: the message names the newest complete one
        good = ckpt.latest_step()
        kept = f"step {good} in {ckpt.directory}" if good is not None else "no checkpoint"
        raise errors.NonFiniteLossError(
            f"the train state of step {step} holds NaN/Inf in {ckpt.refused[step][0]}, so it "
            f"was not checkpointed; the last good state is {kept}. Check the initial weights "
            f"(config.init_from) and lower the learning rate"
        )
    return state, {**summary, "step": step}
