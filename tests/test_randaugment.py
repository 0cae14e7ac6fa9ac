"""RandAugment's ops against PIL and numpy references; its randomness."""

import collections

import numpy as np
import PIL.Image
import PIL.ImageEnhance
import PIL.ImageOps
import pytest
import tensorflow as tf

from data import randaugment

RNG = np.random.default_rng(0)
# Photographs are smooth; a gradient plus noise keeps every op non-trivial.
IMAGE = np.clip(
    np.linspace(20, 230, 24 * 28 * 3).reshape(24, 28, 3) +
    RNG.normal(0, 20, (24, 28, 3)), 0, 255).astype(np.uint8)


def pil(image):
  return PIL.Image.fromarray(np.asarray(image))


def apply(op_name, image=IMAGE, magnitude=10.0, sign=1.0, center=(5, 7)):
  ops = dict(randaugment.OPS)
  return ops[op_name](tf.constant(image), magnitude, sign,
                      tf.constant(center)).numpy()


@pytest.mark.parametrize('name', [name for name, _ in randaugment.OPS])
def test_every_op_keeps_shape_and_uint8(name):
  # Magnitudes may also arrive as float64 tensors.
  for magnitude in (0.0, 5.0, 10.0, tf.constant(7.3, tf.float64)):
    out = apply(name, magnitude=magnitude)
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


def test_randaugment_is_a_function_of_its_seed():
  augment = tf.function(lambda image, seed: randaugment.randaugment(
      image, seed, num_layers=2, magnitude=10.0), autograph=False)
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
