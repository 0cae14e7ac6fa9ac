"""RandAugment's ops against PIL and numpy references; its randomness:
the ops, signs, magnitudes and skipped layers it draws."""

import collections

import numpy as np
import PIL.Image
import PIL.ImageEnhance
import PIL.ImageOps
import pytest
import tensorflow as tf

from data import randaugment
import input_pipeline

RNG = np.random.default_rng(0)
# Photographs are smooth; a gradient plus noise keeps every op non-trivial.
IMAGE = np.clip(
    np.linspace(20, 230, 24 * 28 * 3).reshape(24, 28, 3) +
    RNG.normal(0, 20, (24, 28, 3)), 0, 255).astype(np.uint8)


def pil(image):
  return PIL.Image.fromarray(np.asarray(image))


def apply(op_name, image=IMAGE, magnitude=10.0, sign=1.0, center=(5, 7),
          op_set='big_vision'):
  ops = dict(randaugment.OP_SETS[op_set])
  return ops[op_name](tf.constant(image), magnitude, sign,
                      tf.constant(center)).numpy()


@pytest.mark.parametrize('op_set, name', [
    (op_set, name) for op_set, ops in randaugment.OP_SETS.items()
    for name, _ in ops])
def test_every_op_keeps_shape_and_uint8(op_set, name):
  # Magnitudes may also arrive as float64 tensors.
  for magnitude in (0.0, 5.0, 10.0, tf.constant(7.3, tf.float64)):
    out = apply(name, magnitude=magnitude, op_set=op_set)
    assert out.dtype == np.uint8 and out.shape == IMAGE.shape


@pytest.mark.parametrize('name', ['Rotate', 'ShearX', 'ShearY', 'TranslateX',
                                  'TranslateY', 'Cutout', 'SolarizeAdd'])
def test_ops_with_a_zero_amount_are_the_identity_at_magnitude_zero(name):
  np.testing.assert_array_equal(apply(name, magnitude=0.0), IMAGE)


@pytest.mark.parametrize('op', [randaugment.color, randaugment.contrast,
                                randaugment.brightness,
                                randaugment.sharpness])
def test_enhancements_at_factor_one_are_the_identity(op):
  np.testing.assert_array_equal(op(tf.constant(IMAGE), 1.0).numpy(), IMAGE)


def test_pointwise_ops_match_pil():
  image = tf.constant(IMAGE)
  np.testing.assert_array_equal(randaugment.invert(image).numpy(),
                                np.asarray(PIL.ImageOps.invert(pil(IMAGE))))
  np.testing.assert_array_equal(
      randaugment.posterize(image, 4).numpy(),
      np.asarray(PIL.ImageOps.posterize(pil(IMAGE), 4)))
  np.testing.assert_array_equal(
      randaugment.solarize(image, 100).numpy(),
      np.asarray(PIL.ImageOps.solarize(pil(IMAGE), 100)))
  np.testing.assert_array_equal(
      randaugment.equalize(image).numpy(),
      np.asarray(PIL.ImageOps.equalize(pil(IMAGE))))
  # PIL rounds its contrast-stretch table; this op truncates: at most 1 apart.
  stretched = randaugment.autocontrast(tf.constant(IMAGE // 2 + 40)).numpy()
  reference = np.asarray(PIL.ImageOps.autocontrast(pil(IMAGE // 2 + 40)))
  assert np.abs(stretched.astype(int) - reference).max() <= 1
  assert stretched.min() == 0 and stretched.max() == 255


@pytest.mark.parametrize('op, enhancer', [
    (randaugment.color, PIL.ImageEnhance.Color),
    (randaugment.brightness, PIL.ImageEnhance.Brightness),
    (randaugment.sharpness, PIL.ImageEnhance.Sharpness),
    (randaugment.mean_contrast, PIL.ImageEnhance.Contrast),
])
@pytest.mark.parametrize('factor', [0.1, 0.6, 1.9])
def test_enhancements_match_pil_to_rounding(op, enhancer, factor):
  ours = op(tf.constant(IMAGE), factor).numpy().astype(int)
  theirs = np.asarray(enhancer(pil(IMAGE)).enhance(factor)).astype(int)
  # PIL rounds blends and uses its own grey weights; this op truncates.
  assert np.abs(ours - theirs).max() <= 2
  assert np.mean(ours == theirs) > 0.4


def test_posterize_at_zero_bits_keeps_the_top_bit_as_big_visions_op():
  # TensorFlow clamps the shifts of uint8 to 7 bits.
  np.testing.assert_array_equal(
      randaugment.posterize(tf.constant(IMAGE), 0).numpy(), IMAGE & 128)


def test_contrast_blends_towards_the_recipes_grey_level():
  factor = 1.9
  out = randaugment.contrast(tf.constant(IMAGE), factor).numpy()
  grey = min(IMAGE.shape[0] * IMAGE.shape[1] / 256.0, 255.0)
  grey = float(np.uint8(grey))
  expected = np.clip(grey + factor * (IMAGE.astype(np.float32) - grey), 0,
                     255).astype(np.uint8)
  np.testing.assert_array_equal(out, expected)


def test_posterize_pil_matches_pil_down_to_zero_bits():
  for bits in range(1, 5):
    np.testing.assert_array_equal(
        randaugment.posterize_pil(tf.constant(IMAGE), bits).numpy(),
        np.asarray(PIL.ImageOps.posterize(pil(IMAGE), bits)))
  # PIL's mask at 0 bits, ~(2**8 - 1), keeps nothing (Pillow 13 refuses 0).
  assert not randaugment.posterize_pil(tf.constant(IMAGE), 0).numpy().any()


@pytest.mark.parametrize('name', ['Rotate', 'SolarizeIncreasing',
                                  'SolarizeAdd', 'ColorIncreasing',
                                  'ContrastIncreasing', 'BrightnessIncreasing',
                                  'SharpnessIncreasing', 'ShearX', 'ShearY',
                                  'TranslateXRel', 'TranslateYRel'])
@pytest.mark.parametrize('sign', [-1.0, 1.0])
def test_timm_increasing_ops_are_the_identity_at_magnitude_zero(name, sign):
  np.testing.assert_array_equal(
      apply(name, magnitude=0.0, sign=sign, op_set='timm_increasing'), IMAGE)


@pytest.mark.parametrize('sign', [-1.0, 1.0])
def test_timm_increasing_ops_take_timms_arguments_at_magnitude_nine(sign):
  """DeiT's magnitude, against timm's level rules written out."""
  def timm_apply(name):
    return apply(name, magnitude=9.0, sign=sign, op_set='timm_increasing')
  image = tf.constant(IMAGE)
  np.testing.assert_array_equal(  # 4 - int(0.9 x 4) bits
      timm_apply('PosterizeIncreasing'),
      np.asarray(PIL.ImageOps.posterize(pil(IMAGE), 1)))
  np.testing.assert_array_equal(  # threshold 256 - int(0.9 x 256)
      timm_apply('SolarizeIncreasing'),
      np.asarray(PIL.ImageOps.solarize(pil(IMAGE), 26)))
  factor = 1.0 + sign * 0.81  # 1 +- 0.9 x 0.9
  for name, op in [('ColorIncreasing', randaugment.color),
                   ('ContrastIncreasing', randaugment.mean_contrast),
                   ('BrightnessIncreasing', randaugment.brightness),
                   ('SharpnessIncreasing', randaugment.sharpness)]:
    np.testing.assert_array_equal(timm_apply(name), op(image, factor).numpy())
  height, width = IMAGE.shape[:2]  # 0.45 x 0.9 of the side
  np.testing.assert_array_equal(
      timm_apply('TranslateXRel'),
      randaugment.translate_x(image, sign * 0.405 * width).numpy())
  np.testing.assert_array_equal(
      timm_apply('TranslateYRel'),
      randaugment.translate_y(image, sign * 0.405 * height).numpy())


def test_timm_increasing_ops_are_timms_fifteen_without_cutout():
  names = [name for name, _ in randaugment.TIMM_INCREASING_OPS]
  assert len(names) == 15 and 'Cutout' not in names
  assert set(randaugment.OP_SETS) == set(input_pipeline.RANDAUG_OP_SETS)


def test_solarize_add_brightens_only_dark_pixels():
  out = randaugment.solarize_add(tf.constant(IMAGE), 110).numpy()
  dark = IMAGE < 128
  np.testing.assert_array_equal(
      out[dark], np.minimum(IMAGE[dark].astype(int) + 110, 255))
  np.testing.assert_array_equal(out[~dark], IMAGE[~dark])


def test_rotation_by_ninety_degrees_turns_a_square_image():
  square = IMAGE[:24, :24]
  turned = randaugment.rotate(tf.constant(square), 90.0).numpy()
  # Positive angles turn the content counterclockwise on screen.
  np.testing.assert_array_equal(turned, np.rot90(square, k=1))
  back = randaugment.rotate(tf.constant(square), -90.0).numpy()
  np.testing.assert_array_equal(back, np.rot90(square, k=-1))


def test_translations_move_content_and_fill_grey():
  left = randaugment.translate_x(tf.constant(IMAGE), 5.0).numpy()
  np.testing.assert_array_equal(left[:, :-5], IMAGE[:, 5:])
  assert (left[:, -5:] == randaugment.FILL).all()
  down = randaugment.translate_y(tf.constant(IMAGE), -3.0).numpy()
  np.testing.assert_array_equal(down[3:], IMAGE[:-3])
  assert (down[:3] == randaugment.FILL).all()


def test_shear_x_shifts_each_row_by_level_times_its_index():
  level = 0.25
  sheared = randaugment.shear_x(tf.constant(IMAGE), level).numpy()
  for y in (0, 8, 20):
    shift = int(round(level * y))
    width = IMAGE.shape[1] - shift
    np.testing.assert_array_equal(sheared[y, :width], IMAGE[y, shift:])
  sheared_y = randaugment.shear_y(tf.constant(IMAGE), level).numpy()
  np.testing.assert_array_equal(sheared_y[:, 0], IMAGE[:, 0])


def test_cutout_greys_a_square_around_its_centre():
  out = randaugment.cutout(tf.constant(IMAGE), 4, tf.constant([10, 12]))
  out = out.numpy()
  assert (out[6:14, 8:16] == randaugment.FILL).all()
  outside = np.ones(IMAGE.shape[:2], bool)
  outside[6:14, 8:16] = False
  np.testing.assert_array_equal(out[outside], IMAGE[outside])
  # Clipped at the border.
  corner = randaugment.cutout(tf.constant(IMAGE), 4, tf.constant([0, 0]))
  assert (corner.numpy() != IMAGE).any(axis=-1).sum() <= 16


# DeiT's RandAugment, timm's rand-m9-mstd0.5-inc1.
DEIT = dict(magnitude=9.0, magnitude_std=0.5, apply_prob=0.5,
            op_set='timm_increasing')


@pytest.mark.parametrize('settings', [dict(magnitude=10.0), DEIT])
def test_randaugment_is_a_function_of_its_seed(settings):
  augment = tf.function(lambda image, seed: randaugment.randaugment(
      image, seed, num_layers=2, **settings), autograph=False)
  image = tf.constant(IMAGE)
  first = augment(image, tf.constant([3, 4], tf.int64)).numpy()
  np.testing.assert_array_equal(
      first, augment(image, tf.constant([3, 4], tf.int64)).numpy())
  others = [augment(image, tf.constant([3, s], tf.int64)).numpy()
            for s in range(5, 15)]
  assert any(not np.array_equal(first, other) for other in others)


def test_layers_choose_ops_uniformly_and_signs_evenly():
  choose = tf.function(lambda seed: randaugment.layer_choices(
      seed, tf.constant([24, 28, 3])), autograph=False)
  draws = [choose(tf.constant([7, s], tf.int64)) for s in range(3200)]
  counts = collections.Counter(int(op) for op, _, _ in draws)
  assert set(counts) == set(range(len(randaugment.OPS)))
  # 200 expected per op; 5 standard deviations is 69.
  assert all(abs(c - 200) < 70 for c in counts.values()), counts
  signs = np.array([float(sign) for _, sign, _ in draws])
  assert set(signs) == {-1.0, 1.0} and abs(signs.mean()) < 0.1
  centers = np.array([center.numpy() for _, _, center in draws])
  assert centers.min() == 0 and (centers.max(axis=0) == [23, 27]).all()


def layers(seed, num_layers=2, num_ops=len(randaugment.OPS)):
  """(layer seed, op, sign, centre) of each layer `randaugment` draws."""
  for layer_seed in tf.unstack(tf.random.experimental.stateless_split(
      tf.constant(seed, tf.int64), num_layers)):
    yield (layer_seed,) + randaugment.layer_choices(
        layer_seed, tf.constant(IMAGE.shape), num_ops)


@pytest.mark.parametrize('op_set', list(randaugment.OP_SETS))
def test_without_noise_or_skips_every_layer_applies_its_op_at_the_magnitude(
    op_set):
  """magnitude_std=0 and apply_prob=1 (big_vision's): every chosen op, at
  the fixed magnitude as a number, as the ops ran before either existed."""
  ops = randaugment.OP_SETS[op_set]
  augment = tf.function(lambda seed: randaugment.randaugment(
      tf.constant(IMAGE), seed, 2, 9.0, 0.0, 1.0, op_set), autograph=False)
  for s in range(12):
    expected = tf.constant(IMAGE)
    for _, op, sign, center in layers([3, s], num_ops=len(ops)):
      expected = ops[int(op)][1](expected, 9.0, sign, center)
    np.testing.assert_array_equal(
        augment(tf.constant([3, s], tf.int64)).numpy(), expected.numpy())


@pytest.mark.parametrize('op_set', list(randaugment.OP_SETS))
def test_with_noise_and_skips_each_layer_applies_its_op_at_its_draw_or_not(
    op_set):
  ops = randaugment.OP_SETS[op_set]
  augment = tf.function(lambda seed: randaugment.randaugment(
      tf.constant(IMAGE), seed, 2, 9.0, 0.5, 0.5, op_set), autograph=False)
  skipped = 0
  for s in range(12):
    expected = tf.constant(IMAGE)
    for layer_seed, op, sign, center in layers([4, s], num_ops=len(ops)):
      if randaugment.layer_applied(layer_seed, 0.5):
        magnitude = randaugment.layer_magnitude(layer_seed, 9.0, 0.5)
        expected = ops[int(op)][1](expected, magnitude, sign, center)
      else:
        skipped += 1
    np.testing.assert_array_equal(
        augment(tf.constant([4, s], tf.int64)).numpy(), expected.numpy())
  assert 0 < skipped < 24


def draw_many(draw, count=4000):
  """draw(seed) at `count` seeds, in one graph."""
  seeds = tf.stack([tf.fill([count], tf.constant(11, tf.int64)),
                    tf.range(count, dtype=tf.int64)], axis=1)
  return tf.function(lambda: tf.map_fn(
      draw, seeds, fn_output_signature=draw(seeds[0]).dtype))().numpy()


@pytest.mark.parametrize('magnitude, std', [(9.0, 0.5), (9.5, 1.0),
                                            (0.5, 1.0)])
def test_drawn_magnitudes_follow_the_normal_clipped_to_the_range(
    magnitude, std):
  drawn = draw_many(lambda seed: randaugment.layer_magnitude(
      seed, magnitude, std))
  reference = np.clip(np.random.default_rng(0).normal(
      magnitude, std, 1_000_000), 0.0, randaugment.MAX_MAGNITUDE)
  # 5 standard errors of the 4000 draws' mean and deviation (the latter's
  # is at most std / sqrt(2 x 4000) for these lighter-tailed laws).
  assert abs(drawn.mean() - reference.mean()) < 5 * std / np.sqrt(4000)
  assert abs(drawn.std() - reference.std()) < 5 * std / np.sqrt(8000)
  assert drawn.min() >= 0.0 and drawn.max() <= randaugment.MAX_MAGNITUDE
  # The clipped mass sits on the ends, as in the reference.
  for end in (0.0, randaugment.MAX_MAGNITUDE):
    share = np.mean(reference == end)
    assert abs(np.mean(drawn == end) - share) <= 5 * np.sqrt(
        share * (1 - share) / 4000) + 1e-3


@pytest.mark.parametrize('apply_prob', [0.5, 0.2])
def test_apply_prob_is_the_share_of_layers_that_apply_their_op(apply_prob):
  applied = draw_many(lambda seed: randaugment.layer_applied(
      seed, apply_prob))
  # 5 binomial standard deviations.
  assert abs(applied.mean() - apply_prob) < 5 * np.sqrt(
      apply_prob * (1 - apply_prob) / 4000)


@pytest.mark.parametrize('key, value, message', [
    ('randaug_magnitude_std', -0.5,
     r'randaug_magnitude_std -0.5 must be >= 0 \(0: every op at '
     r'randaug_magnitude\)'),
    ('randaug_apply_prob', 1.5,
     r'randaug_apply_prob 1.5 must be in \[0, 1\] \(1: every chosen op '
     r'applied\)'),
    ('randaug_ops', 'timm',
     "unknown randaug_ops 'timm'; valid names: big_vision, timm_increasing"),
])
def test_bad_randaugment_values_are_refused_naming_the_fix(key, value,
                                                          message):
  with pytest.raises(ValueError, match=message):
    input_pipeline.Preprocessing(32, **{key: value})
