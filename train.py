"""The run: its programs compiled, and the training loop.

The model lives as an NNX graph definition plus pure state (parameters,
BatchNorm statistics, optimizer state; `training/state.py`); the train step
(`training/update.py`) is a pure function of that state, compiled once with
explicit shardings, and `train_and_evaluate` runs it with CLU logging,
evaluation (`evaluators/`) and checkpoints on their schedules.
"""

import concurrent.futures
import dataclasses
import functools
import itertools
import threading
from typing import Callable

from absl import logging
import jax
import ml_collections
import optax

from checks import config_values
from checks import data_checks
from checks import memory_budget
from checks import workdir_access
from data import datasets
from evaluators import classification
from evaluators import registry
import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import compilation_cache
from runtime import config_error
from runtime import goodput
from runtime import preemption
from runtime import sharding
from training import compiling
from training import flop_count
from training import intermediate_grads
from training import nonfinite
from training import optimizer
from training import reporting
from training import run_state
from training import state as train_state
from training import teacher as teacher_lib
from training import update

# The name of the thread a train step compiles on while the state is made.
_COMPILE_THREAD = 'compile_train_step'


def distillation_settings(config, teacher_graphdef) -> dict:
  """`distillation.training_inputs`'s teacher keywords under `config`
  (empty without a teacher)."""
  if teacher_graphdef is None:
    return {}
  return dict(teacher_graphdef=teacher_graphdef,
              distillation_type=config.distillation_type,
              distillation_alpha=config.distillation_alpha,
              distillation_tau=config.distillation_tau)


def train_step_kwargs(config, graphdef, tx, learning_rate_fn,
                      teacher_graphdef=None) -> dict:
  """The keyword arguments of `train_step` under `config`, distilled from
  the teacher of `teacher_graphdef` (in the state) when given."""
  return dict(graphdef=graphdef, tx=tx, learning_rate_fn=learning_rate_fn,
              label_smoothing=config.label_smoothing,
              dropout_seed=config.seed + 1,
              mixing=dict(mixup_alpha=config.mixup_alpha,
                          cutmix_alpha=config.cutmix_alpha,
                          mixup_switch_prob=config.mixup_switch_prob),
              skip_nonfinite_steps=config.skip_nonfinite_steps,
              grad_accum_steps=config.grad_accum_steps,
              # XLA:CPU is slow in loops, as for the layers (`scan_unroll`).
              accum_unroll=config.scan_unroll, ema_decay=config.ema_decay,
              trainable=config.trainable,
              distill=distillation_settings(config, teacher_graphdef))


@dataclasses.dataclass
class CompiledSteps:
  """A run's compiled functions and what they cost."""
  train: Callable  # (state, global batch) -> (state, metrics)
  evaluator: classification.Evaluator  # the main evaluation
  teacher_metrics: dict  # eval_teacher_accuracy, if any: computed once
  evaluators: dict[str, registry.Scheduled]  # config.evals, by name
  summaries: intermediate_grads.Summaries | None
  # compile_seconds, memory_*_bytes, step_flops: logged once per start.
  startup_scalars: dict


@dataclasses.dataclass
class RunPrograms:
  """The programs every run of a config compiles, compiled."""
  train: Callable  # (state, global batch) -> (state, metrics)
  train_executable: jax.stages.Compiled
  train_lowered: jax.stages.Lowered
  compile_seconds: float  # of the train step
  step_kwargs: dict  # the train step's keywords
  evaluator: classification.Evaluator  # the main evaluation
  summaries: intermediate_grads.Summaries | None


def compile_train_step(step_mode: str, mesh, step_kwargs: dict, run,
                       train_batch):
  """The train step with `step_kwargs` compiled for the state of `run` and
  `train_batch` (arrays, or their shapes and shardings): (`step_kwargs`,
  (the step, its executable, compile seconds and lowering)), as
  `compiling.compile_train_step` gives the latter."""
  return step_kwargs, compiling.compile_train_step(
      step_mode, mesh, functools.partial(update.train_step, **step_kwargs),
      run.sharding, run.state, train_batch)


def start_compiling_train_step(config, info, mesh, learning_rate_fn
                               ) -> concurrent.futures.Future | None:
  """The train step of `config` compiling on a thread of its own from the
  shapes of the run's state and batches alone, so that the state is made
  meanwhile (XLA releases Python's lock): a future of `compile_train_step`'s
  result. None when distilling: the teacher's depth is its file's, known
  once the state is made."""
  if config.teacher_model:
    return None
  run, _, batch = abstract_run(config, info, mesh, learning_rate_fn)
  step_kwargs = train_step_kwargs(config, run.graphdef, run.tx,
                                  learning_rate_fn, run.teacher_graphdef)
  pool = concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix=_COMPILE_THREAD)
  compiled = pool.submit(compile_train_step, config.step_mode, mesh,
                         step_kwargs, run, batch)
  pool.shutdown(wait=False)
  return compiled


def train_step_compiling() -> bool:
  """Whether a train step that `start_compiling_train_step` began still
  compiles: a launch that fails before using it would otherwise wait it
  out at exit (`console.exit_at_once` does not)."""
  return any(thread.name.startswith(_COMPILE_THREAD)
             for thread in threading.enumerate())


def abstract_run(config, info, mesh, learning_rate_fn):
  """The run of `config` as shapes and shardings, no array made or file
  read (`run_state.create`'s `abstract`), and its first training batch."""
  run = run_state.create(config, info, mesh, '', learning_rate_fn,
                         dtype=models.compute_dtype(config),
                         abstract=True, abstract_teacher=True)
  data = datasets.ShapesDataset(info, ('teacher_top1',) if run.teacher
                                else ())
  return run, data, next(train_batches(config, data, mesh, 0))


def compile_programs(config, mesh, run: run_state.RunState, learning_rate_fn,
                     train_batch, eval_data, writer=None,
                     train_program: concurrent.futures.Future | None = None
                     ) -> RunPrograms:
  """The train step (of `config.step_mode`), the main evaluation over
  `eval_data` and, when asked for, the intermediate-gradient summary step
  (writing to `writer`), compiled for the state of `run` (with its
  teacher, if any) and `train_batch`; the train step's compile may be
  under way already (`train_program`, `start_compiling_train_step`)."""
  step_kwargs = train_step_kwargs(config, run.graphdef, run.tx,
                                  learning_rate_fn, run.teacher_graphdef)
  # XLA compiles with Python's lock released: the programs compile on
  # threads of their own, so that on a host of many cores they take about
  # as long as the longest of them.
  with concurrent.futures.ThreadPoolExecutor() as pool:
    train_program = train_program or pool.submit(
        compile_train_step, config.step_mode, mesh, step_kwargs, run,
        train_batch)
    evaluator = pool.submit(
        classification.Evaluator, eval_data, mesh, run.graphdef, run.state,
        run.sharding, batch_size=config.batch_size, dtype=run.dtype,
        steps=config.steps_per_eval)
    summaries = (pool.submit(
        intermediate_grads.compiled_summaries, step_kwargs,
        config.intermediate_grads_every_steps, run.state, train_batch,
        run.sharding, sharding.batch_sharding(mesh), writer)
                 if config.intermediate_grads_every_steps else None)
    train_kwargs, (run_train_step, executable, compile_seconds, lowered) = (
        train_program.result())
    return RunPrograms(run_train_step, executable, lowered, compile_seconds,
                       train_kwargs, evaluator.result(),
                       summaries and summaries.result())


def hparams(config) -> dict:
  """The config's values as hparams: numbers, strings and booleans as they
  are, anything else (nested configs, tuples) as its string."""
  return {key: value if isinstance(value, (int, float, str, bool))
          else str(value) for key, value in config.items()}


def evaluator_context(config, info: input_pipeline.DatasetInfo, mesh,
                      graphdef, state, state_sharding,
                      dtype) -> registry.Context:
  """What the evaluators of a run of `config` computing in `dtype` are
  given (they get these values alone, never the config)."""
  return registry.Context(mesh, graphdef, state, state_sharding,
                          config.batch_size, dtype,
                          input_pipeline.Preprocessing.from_config(config),
                          config.data_dir, tuple(info.class_names),
                          tuple(info.image_shape))


def compile_steps(config, mesh, run: run_state.RunState, learning_rate_fn,
                  train_batch, dataset, writer,
                  train_program: concurrent.futures.Future | None
                  ) -> CompiledSteps:
  """The run's programs (`compile_programs`, the train step's compile under
  way in `train_program`; the evaluations read the teacher's predictions,
  if any, made here) and the evaluators of `config.evals`, compiled for the
  state of `run` and this batch."""
  context = evaluator_context(config, dataset.info, mesh, run.graphdef,
                              run.state, run.sharding, run.dtype)
  evaluated = teacher_lib.eval_data(
      dataset, run.teacher, mesh, batch_size=config.batch_size,
      dtype=context.dtype, steps=config.steps_per_eval)
  programs = compile_programs(config, mesh, run, learning_rate_fn,
                              train_batch, evaluated, writer, train_program)
  # The evaluators compile (Python's lock released) while the FLOPs are
  # counted here (a lowering: Python).
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    evaluators = pool.submit(registry.create_all, config.evals, context)
    # The unrolled lowering costs as much as loading every program from
    # the cache: a relaunch reads the count kept beside them.
    step_flops = compilation_cache.kept_flops(
        compiling.program_key(programs.train_lowered),
        lambda: flop_count.true_step_flops(
            update.train_step, run.graphdef, programs.step_kwargs,
            run.state, train_batch))
    evaluators = evaluators.result()
  memory = programs.train_executable.memory_analysis()
  teacher_metrics = evaluated.metrics if run.teacher else {}
  return CompiledSteps(
      programs.train, programs.evaluator, teacher_metrics, evaluators,
      programs.summaries, {
          'compile_seconds': programs.compile_seconds,
          'memory_temp_bytes': memory.temp_size_in_bytes,
          'memory_argument_bytes': memory.argument_size_in_bytes,
          'memory_output_bytes': memory.output_size_in_bytes,
          'step_flops': step_flops,
      })


def abstract_topology_run(config, topology):
  """`abstract_run` on the compile-only devices of `topology`
  (`runtime/accelerators.py`): (mesh, run, data, batch, learning_rate_fn).

  Nothing is run, read or written: the data set is its description
  (`datasets.described`), every array a shape with its sharding, and the
  learning rate a constant (the schedule is a scalar function)."""
  if config.step_mode != 'jit':
    raise config_error.ConfigError(
        "--mode=compile compiles step_mode 'jit' alone; size the run with "
        '--config.step_mode=jit')
  with config_error.as_config_error():
    info = datasets.described(input_pipeline.DataSource.from_config(config))
    mesh = sharding.create_mesh(config.mesh, config.step_mode, topology.devices)
  learning_rate_fn = optax.constant_schedule(config.learning_rate)
  run, data, batch = abstract_run(config, info, mesh, learning_rate_fn)
  return mesh, run, data, batch, learning_rate_fn


def step_flops(run, step_kwargs, batch) -> dict:
  """'step_flops': the train step's FLOPs with every layer counted, and
  'recomputed_flops': with the remat policy's recomputation too."""
  return {key: flop_count.true_step_flops(
      update.train_step, run.graphdef, step_kwargs, run.state, batch,
      recomputation=recomputation)
          for key, recomputation in (('step_flops', False),
                                     ('recomputed_flops', True))}


def compile_for_topology(config, topology, count_flops: bool = True) -> dict:
  """Every program a run of `config` compiles, compiled for the
  compile-only devices of `topology` as that run would compile it
  (`abstract_topology_run`): the train step, the main evaluation, the
  intermediate-gradient summary step when on, the teacher's predictions
  when distilling. Returns {'programs': {name: (executable, compile
  seconds)}, 'state_bytes': {part: bytes per chip} of the state} and, with
  `count_flops`, `step_flops`'s counts."""
  mesh, run, data, batch, learning_rate_fn = abstract_topology_run(
      config, topology)
  programs = compile_programs(config, mesh, run, learning_rate_fn, batch,
                              data)
  compiled = {'train step': (programs.train_executable,
                             programs.compile_seconds),
              'evaluation step': (programs.evaluator.compiled_step,
                                  programs.evaluator.compile_seconds)}
  if programs.summaries is not None:
    compiled['summary step'] = (programs.summaries.compiled_summary_step,
                                None)
  if run.teacher:
    images = next(data.eval_batches(config.batch_size,
                                    sharding.batch_sharding(mesh),
                                    batch['image'].dtype))['image']
    compiled['teacher predictions'] = compiling.lower_and_compile(
        teacher_lib.top1_program(run.teacher, mesh), run.state.teacher,
        images)[:2]
  return {'programs': compiled,
          'state_bytes': memory_budget.state_bytes(run.state),
          **(step_flops(run, programs.step_kwargs, batch) if count_flops
             else {})}


def prepare_data(config, workdir: str, events_dir: str):
  """Checks the config and the run's directories, and opens the data set:
  every mistake is a ConfigError naming the fix, before anything is
  written."""
  config_values.validate_config(config)
  with config_error.as_config_error():
    data_checks.check_data(config)
    for directory in dict.fromkeys((workdir, events_dir)):
      workdir_access.check_workdir(directory)
    return datasets.create_dataset(
        input_pipeline.DataSource.from_config(config))


def create_logged_mesh(config):
  """The run's mesh, and which rows of every global batch this process
  loads, logged."""
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  logging.info('Mesh %s; process %d loads rows %s of every global batch.',
               dict(mesh.shape), jax.process_index(),
               input_pipeline.describe_rows(input_pipeline.process_rows(
                   config.batch_size, sharding.batch_sharding(mesh))))
  return mesh


def train_batches(config, dataset, mesh, start_step: int):
  """The global training batches of steps `start_step + 1`, ... ."""
  return dataset.train_batches(
      config.batch_size, config.seed, start_step,
      sharding.batch_sharding(mesh), models.compute_dtype(config),
      config.repeated_augments)


def evaluate_if_due(steps: CompiledSteps, state, step: int,
                    eval_every_steps: int, last_step: bool, writer,
                    timeline: goodput.Timeline) -> None:
  """The held-out evaluation every `eval_every_steps` and at the last step
  (with the teacher's metrics, if any), then each of `config.evals` on its
  own cadence: each writes its scalars at `step` (and a console line), its
  time given to the timeline's `evaluation`."""
  if step % eval_every_steps == 0 or last_step:
    with timeline.during('evaluation'):
      writer.write_scalars(step, steps.evaluator.run(state) |
                           steps.teacher_metrics)
  for scheduled in steps.evaluators.values():
    if scheduled.due(step, eval_every_steps, last_step):
      with timeline.during('evaluation'):
        writer.write_scalars(step, scheduled.evaluator.run(state))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_request: preemption.StopRequest | None = None,
                       events_dir: str | None = None,
                       timeline: goodput.Timeline | None = None
                       ) -> train_state.TrainState:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Stops early, with a checkpoint, when `stop_request` (entered: SIGTERM and
  SIGINT; see main.py) or a multi-host preemption notice asks it to.
  TensorBoard event files (and profiles) go to `events_dir`, by default the
  workdir itself. `timeline` is the launch's so far (main.py starts it at
  its first line); by default it starts here.
  """
  events_dir = events_dir or workdir
  timeline = timeline or goodput.Timeline()
  timeline.switch('data')
  dataset = prepare_data(config, workdir, events_dir)
  num_steps, learning_rate_fn = optimizer.logged_schedule(config, dataset.info)
  mesh = create_logged_mesh(config)
  reporting.start_importing_writers()
  timeline.switch('model')
  train_program = start_compiling_train_step(config, dataset.info, mesh,
                                             learning_rate_fn)
  run = run_state.create(config, dataset.info, mesh, workdir, learning_rate_fn,
                         dtype=models.compute_dtype(config))
  timeline.switch('restore')
  run, manager = restore(config, run, workdir, dataset.info.class_names,
                         stop_request)
  state, start_step = run.state, int(run.state.step)
  if start_step >= num_steps:
    logging.info('The run is complete: the checkpoint in %s is at step %d '
                 'of %d. Evaluate it with --mode=eval.', manager.directory,
                 start_step, num_steps)
    return state
  if run.step is not None:
    preemption.drop_events_after(events_dir, run.step)
  else:
    preemption.note_fresh_start(events_dir, manager.directory,
                                config.init_from)
  tally = goodput.Goodput(workdir, timeline, writes=jax.process_index() == 0)
  tally.restored(start_step)

  timeline.switch('input')
  writer = reporting.create_writer(hparams(config), events_dir, start_step,
                                  timeline)
  train_iter = input_pipeline.prefetch(
      train_batches(config, dataset, mesh, start_step))
  try:
    first_batch = next(train_iter)
    timeline.switch('compile')
    # A step the devices cannot hold: the line `--mode=compile` prints.
    with memory_budget.refused_when_out_of_memory(config,
                                                  compile_for_topology):
      steps = compile_steps(config, mesh, run, learning_rate_fn, first_batch,
                            dataset, writer, train_program)
      writer.write_scalars(start_step, steps.startup_scalars)
      logging.info('Starting at step %d of %d; TensorBoard logs in %s, '
                   'checkpoints in %s.', start_step, num_steps, events_dir,
                   manager.directory)
      timeline.switch('steps')
      state = train_loop(
          config, state, itertools.chain([first_batch], train_iter), steps,
          dataset, mesh, manager, writer, start_step, num_steps,
          stop_request or preemption.StopRequest(), events_dir, tally,
          run.teacher_fingerprint)
  finally:  # on an error too: the input stops before the exit
    timeline.switch('teardown')
    input_pipeline.stop(train_iter, 'the training batches')
  finish(manager, state, tally, writer, dataset)
  return state


def finish(manager, state, tally: goodput.Goodput, writer, dataset) -> None:
  """Waits until the last checkpoint is written, then flushes the writer
  and logs the run's goodput and the examples its input skipped."""
  with tally.timeline.during('checkpoint'):
    checkpointing.wait_until_saved(manager, state)
  tally.finished()
  writer.flush()
  logging.info(tally.summary())
  if skipped := {key: n for key, n in dataset.skipped().items() if n}:
    logging.info('Skipped: %s.', ', '.join(
        f'{key.removeprefix("data_skipped_")} {n}'
        for key, n in skipped.items()))


def restore(config, run: run_state.RunState, workdir: str, class_names,
            stop_request: preemption.StopRequest | None):
  """`run` from the newest readable checkpoint of `workdir` (itself when
  there is none), and the checkpoint manager: storage errors read again
  for `restore_retry_seconds`, a signal of `stop_request` ends the reads."""
  storage_retries = dict(
      retry_seconds=config.restore_retry_seconds,
      stop_requested=lambda: stop_request and stop_request.signal_name)
  manager = checkpointing.open_manager(workdir, config.keep_checkpoints,
                                       **storage_retries)
  return run_state.restore_latest(run, manager, config, class_names,
                                  **storage_retries), manager


def train_loop(config, state, train_iter, steps: CompiledSteps, dataset,
               mesh, manager, writer, start_step: int, num_steps: int,
               stop_request: preemption.StopRequest, events_dir: str,
               tally: goodput.Goodput, teacher_file: dict | None = None):
  """Steps `start_step + 1` to `num_steps`, with logging, evaluation,
  summaries and checkpoints on their cadences, each one's time given to its
  activity of `tally.timeline`; returns the last state. Checkpoints record
  `teacher_file`, the fingerprint of the teacher's weights, if any."""
  timeline = tally.timeline
  hooks = reporting.create_hooks(
      events_dir, start_step, num_steps, profile=config.profile,
      profile_delay_steps=config.profile_delay_steps,
      profile_num_steps=config.profile_num_steps)
  console = reporting.StepConsole(start_step, num_steps)

  def summarize_offender(frozen_state):
    """Summaries of the batch that made the run non-finite, if enabled."""
    if steps.summaries is not None:
      offending_step = int(frozen_state.step)
      batches = train_batches(config, dataset, mesh, offending_step - 1)
      try:
        steps.summaries.write(offending_step, frozen_state, next(batches))
      finally:
        input_pipeline.close(batches)

  train_metrics = []
  # steps/s counts the steps' time only, not evaluations, saves, summaries.
  last_log = (start_step, timeline.seconds['steps'])
  for step in range(start_step + 1, num_steps + 1):
    batch = next(train_iter)
    with jax.profiler.StepTraceAnnotation('train', step_num=step):
      state, metrics = steps.train(state, batch)
    train_metrics.append(metrics)
    if step == start_step + 1:
      reporting.report_startup(tally, writer, step, metrics)
    last_step = step == num_steps
    host_sync = last_step or any(step % every == 0 for every in (
        config.log_every_steps, config.eval_every_steps,
        config.checkpoint_every_steps))
    stopping = stop_request.should_stop(step, host_sync)
    if host_sync or stopping:
      nonfinite.stop_if_nonfinite(state, config.skip_nonfinite_steps, manager,
                                  writer, summarize_offender)
    if step % config.log_every_steps == 0 or last_step:
      metrics_written = dataset.skipped() | tally.scalars(step)
      summary = reporting.train_summary(
          train_metrics, step - last_log[0],
          timeline.seconds['steps'] - last_log[1], config.batch_size,
          steps.startup_scalars['step_flops'])
      writer.write_scalars(step, summary | metrics_written)
      console.log(step, summary)
      train_metrics, last_log = [], (step, timeline.seconds['steps'])
    for hook in hooks:
      hook(step)
    if steps.summaries is not None:  # the updated state, this step's batch
      with timeline.during('other'):
        steps.summaries.write_if_due(step, state, batch)
    evaluate_if_due(steps, state, step, config.eval_every_steps, last_step,
                    writer, timeline)
    if step % config.checkpoint_every_steps == 0 or last_step or stopping:
      with timeline.during('checkpoint'):
        # Every event up to `step` is on disk before its checkpoint.
        writer.flush()
        checkpointing.save(manager, step, state, compatibility.as_json(config),
                           dataset.info.class_names, teacher_file)
      tally.saved(step)
    if stopping:
      logging.warning('Stopped by %s after step %d of %d; checkpoint saved in '
                      '%s. Run the same command to resume.',
                      stop_request.signal_name, step, num_steps,
                      manager.directory)
      break
  return state
