"""Knowledge distillation's losses: DeiT's and big_vision's against NumPy
versions of their formulas, the two heads' base and distillation terms,
and zero for a student holding its teacher's weights (the teacher sharded,
in the compute dtype)."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import input_pipeline
import models
from runtime import sharding
from training import distillation
from training import teacher as teacher_lib
import train
from helpers import VIT
from helpers import tiny_config
from helpers import write_checkpoint

pytestmark = pytest.mark.xdist_group('distillation')


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def deit_soft(student, teacher, tau):
  """DeiT: F.kl_div(log_softmax(s / T), log_softmax(t / T),
  reduction='sum', log_target=True) * T * T / s.numel()."""
  log_t, log_s = np_log_softmax(teacher / tau), np_log_softmax(student / tau)
  return np.sum(np.exp(log_t) * (log_t - log_s)) * tau * tau / student.size


def deit_hard(student, teacher):
  """DeiT: F.cross_entropy(s, t.argmax(dim=1))."""
  log_s = np_log_softmax(student)
  return -np.mean(log_s[np.arange(len(student)), teacher.argmax(1)])


def big_vision_kl(student, teacher, t):
  """big_vision: t**2 * softmax_xent(logits=s / t, labels=softmax(t / t),
  kl=True) per example, then the batch mean."""
  labels = np.exp(np_log_softmax(teacher / t))
  per_example = np.sum(labels * (np.log(labels) -
                                 np_log_softmax(student / t)), -1)
  return np.mean(t**2 * per_example)


@pytest.mark.parametrize('tau', [1.0, 3.0])
def test_each_loss_matches_its_anchor_formula(tau):
  rng = np.random.default_rng(0)
  student, teacher = (rng.normal(0, 3, (6, 10)).astype(np.float32)
                      for _ in range(2))
  for kind, reference in (('soft', deit_soft(student, teacher, tau)),
                          ('hard', deit_hard(student, teacher)),
                          ('kl', big_vision_kl(student, teacher, tau))):
    got = distillation.distillation_loss(kind, student, teacher, tau)
    np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=kind)
  # soft and kl differ only in their normalisation: by the logits, by the
  # examples (10 classes).
  np.testing.assert_allclose(
      distillation.distillation_loss('soft', student, teacher, tau) * 10,
      big_vision_kl(student, teacher, tau), rtol=1e-5)
  # The gradient flows into the student alone.
  grad = jax.grad(lambda t: distillation.distillation_loss(
      'soft', student, t, tau))(teacher)
  assert not np.any(grad)


def test_two_heads_take_the_base_and_the_distillation_loss():
  rng = np.random.default_rng(1)
  class_logits, dist_logits, targets = (
      jnp.asarray(rng.normal(0, 2, (4, 10)), jnp.float32) for _ in range(3))
  labels = np.array([1, 2, 3, 4])
  base = lambda logits: -jnp.mean(jax.nn.log_softmax(logits)[
      jnp.arange(4), labels])
  loss = distillation.distilled_loss(base, targets, 'hard', 0.25, 1.0)
  total, terms = loss((class_logits, dist_logits))
  np.testing.assert_allclose(terms['base_loss'], base(class_logits),
                             rtol=1e-6)
  np.testing.assert_allclose(
      terms['distillation_loss'],
      deit_hard(np.asarray(dist_logits), np.asarray(targets)), rtol=1e-6)
  np.testing.assert_allclose(
      total, 0.75 * terms['base_loss'] + 0.25 * terms['distillation_loss'],
      rtol=1e-6)
  # One head carries both; evaluation averages two.
  np.testing.assert_allclose(
      loss(class_logits)[0], 0.75 * base(class_logits) + 0.25 * deit_hard(
          np.asarray(class_logits), np.asarray(targets)), rtol=1e-6)
  np.testing.assert_allclose(
      distillation.prediction((class_logits, dist_logits)),
      (class_logits + dist_logits) / 2)


# A ViT of one block on 16 x 16 images: one patch, the class token.
SMALL_VIT = {**VIT, 'num_layers': 1, 'image_size': 16}
VIT_INFO = input_pipeline.DatasetInfo(10, (16, 16, 3), 1000, 100)


def test_a_student_with_its_teachers_weights_has_zero_distillation_loss(
    tmp_path):
  """soft and kl: zero up to rounding, the teacher on the very images the
  student gets after mixup; hard: the cross-entropy of its own top-1."""
  saved = write_checkpoint(tmp_path, tiny_config(**SMALL_VIT), VIT_INFO,
                           noise=0.05)
  config = tiny_config(**SMALL_VIT, teacher_model='ViT_Ti16',
                       teacher_init_from=str(tmp_path),
                       distillation_type='soft', distillation_alpha=1.0,
                       distillation_tau=2.0)
  # Sharded over FSDP: the large kernels split as the student's would be.
  mesh = sharding.create_mesh({'data': 1, 'fsdp': 8})
  teacher = teacher_lib.create_teacher(
      config.teacher_model, config.teacher_init_from,
      config.teacher_init_format, models.options(config), VIT_INFO, mesh,
      dtype=models.compute_dtype(config), seed=config.seed)
  kernel = teacher.state['encoder']['layers']['mlp_in']['kernel'][...]
  assert 'fsdp' in tuple(kernel.sharding.spec)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.create_model(
      'ViT_Ti16', 10, 3, rngs=nnx.Rngs(0), **models.options(config))))
  batch = {'image': jax.random.normal(jax.random.key(0), (8, 16, 16, 3)),
           'label': jnp.arange(8) % 10}

  @jax.jit
  def losses(teacher_state, params, model_state):
    student = nnx.merge(graphdef, params, model_state)
    found = {}
    for kind in ('soft', 'kl', 'hard'):
      config.distillation_type = kind
      images, loss_of_output, _ = distillation.training_inputs(
          batch, jax.random.key(1), teacher_state, label_smoothing=0.0,
          mixup_alpha=0.8, **train.distillation_settings(config,
                                                         teacher.graphdef))
      found[kind], _ = loss_of_output(student(images, train=True))
    return found, student(images, train=True)

  found, output = losses(teacher.state, saved.params, saved.model_state)
  assert abs(float(found['soft'])) < 1e-6
  assert abs(float(found['kl'])) < 1e-6
  np.testing.assert_allclose(found['hard'], deit_hard(np.asarray(output),
                                                      np.asarray(output)),
                             rtol=1e-5)
  assert float(found['hard']) > 0.01

  # Under half precision the teacher is held and computes in bfloat16.
  config.half_precision = True
  teacher = teacher_lib.create_teacher(
      config.teacher_model, config.teacher_init_from,
      config.teacher_init_format, models.options(config), VIT_INFO,
      sharding.create_mesh({'data': -1, 'fsdp': 1}),
      dtype=models.compute_dtype(config), seed=config.seed)
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(teacher.state)
            if jnp.issubdtype(leaf.dtype, jnp.floating)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
