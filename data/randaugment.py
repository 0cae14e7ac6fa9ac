"""RandAugment (Cubuk et al., 2019) on uint8 RGB images, in TensorFlow.

Each of `num_layers` layers picks one op of an op set (OP_SETS) uniformly
and applies it at a magnitude (10 is the top of every op's range);
rotations, shears and translations take a random sign and fill with grey
128. The defaults are big_vision's `randaug(num_layers, magnitude)`, its
ViT-S/16 ImageNet recipe (the TensorFlow EfficientNet implementation it
forks): the 16 ops of OPS, each layer's op always applied, at `magnitude`
itself. timm's RandAugment (DeiT's `rand-m9-mstd0.5-inc1`) differs in
three ways, each a parameter of `randaugment`: `magnitude_std` > 0 draws
each layer's magnitude from Normal(magnitude, magnitude_std) clipped to
[0, 10] (timm's `mstd`); `apply_prob` < 1 applies each layer's op with
that probability (timm's 0.5); `op_set='timm_increasing'` takes timm's
`inc1` ops, TIMM_INCREASING_OPS. Still unlike timm's PIL ops: empty pixels
are grey 128 (DeiT's: the ImageNet mean, (124, 116, 104)), geometric ops
sample the nearest pixel (DeiT's: bicubic) and blends truncate (PIL
rounds).

Every random choice is a stateless op seeded per example, so an example's
augmentation is a function of its seed alone and a resumed run sees the
images of an uninterrupted one. Written here because no library serves:
keras-cv's RandAugment has another op set and magnitude scale and draws
from a stateful generator, and tf-models-official (which has these ops,
also stateful) does not install beside TensorFlow 2.21.
"""

import math

import tensorflow as tf

MAX_MAGNITUDE = 10.0  # the magnitude at which each op reaches its range's end
FILL = 128  # grey for pixels that geometric ops and Cutout leave empty
CUTOUT_HALF_SIZE = 40  # Cutout's square is 2 x this at magnitude 10
TRANSLATE_PIXELS = 100  # translation at magnitude 10
TRANSLATE_FRACTION = 0.45  # timm's: of the image's side, at magnitude 10


def blend(image1, image2, factor):
  """image1 + factor x (image2 - image1) in uint8: interpolation for factor
  in [0, 1], extrapolation clipped to [0, 255] beyond. `factor` is a
  number or a float32 scalar tensor."""
  image1 = tf.cast(image1, tf.float32)
  blended = image1 + factor * (tf.cast(image2, tf.float32) - image1)
  # Inside [0, 1] the float result already lies between the two pixels,
  # so clipping every factor changes nothing there and needs no test of
  # a tensor's value.
  blended = tf.clip_by_value(blended, 0.0, 255.0)
  return tf.cast(blended, tf.uint8)  # truncates, as the recipe's ops do


def _transform(image, transform):
  """The projective `transform` (8 numbers mapping output to input pixel
  coordinates), nearest neighbour, empty pixels FILL."""
  return tf.raw_ops.ImageProjectiveTransformV3(
      images=image[None], transforms=tf.cast([transform], tf.float32),
      output_shape=tf.shape(image)[:2], fill_value=float(FILL),
      interpolation='NEAREST', fill_mode='CONSTANT')[0]


def rotate(image, degrees):
  """Rotated by `degrees` about the image's centre."""
  height = tf.cast(tf.shape(image)[0], tf.float32)
  width = tf.cast(tf.shape(image)[1], tf.float32)
  radians = tf.cast(degrees, tf.float32) * (math.pi / 180.0)
  cos, sin = tf.cos(radians), tf.sin(radians)
  # Output pixel (x, y) reads input (cos x - sin y + dx, sin x + cos y + dy):
  # the offsets keep the centre ((w - 1) / 2, (h - 1) / 2) in place.
  x_offset = ((width - 1) - (cos * (width - 1) - sin * (height - 1))) / 2
  y_offset = ((height - 1) - (sin * (width - 1) + cos * (height - 1))) / 2
  return _transform(image, [cos, -sin, x_offset, sin, cos, y_offset, 0., 0.])


def translate_x(image, pixels):
  """Content moved `pixels` to the left (right when negative)."""
  return _transform(image, [1., 0., pixels, 0., 1., 0., 0., 0.])


def translate_y(image, pixels):
  """Content moved `pixels` up (down when negative)."""
  return _transform(image, [1., 0., 0., 0., 1., pixels, 0., 0.])


def shear_x(image, level):
  """Output pixel (x, y) reads input (x + level x y, y)."""
  return _transform(image, [1., level, 0., 0., 1., 0., 0., 0.])


def shear_y(image, level):
  """Output pixel (x, y) reads input (x, level x x + y)."""
  return _transform(image, [1., 0., 0., level, 1., 0., 0., 0.])


def autocontrast(image):
  """Each channel stretched linearly so its darkest pixel is 0 and its
  brightest 255 (a flat channel stays as it is)."""
  pixels = tf.cast(image, tf.float32)
  low = tf.reduce_min(pixels, axis=(0, 1))
  high = tf.reduce_max(pixels, axis=(0, 1))
  scale = 255.0 / tf.maximum(high - low, 1.0)
  stretched = tf.cast(tf.clip_by_value((pixels - low) * scale, 0.0, 255.0),
                      tf.uint8)
  return tf.where(high > low, stretched, image)


def equalize(image):
  """PIL's histogram equalisation, channel by channel."""
  def equalize_channel(channel):
    channel = tf.cast(channel, tf.int32)
    histogram = tf.math.bincount(channel, minlength=256, maxlength=256)
    last_count = tf.gather(histogram, tf.reduce_max(
        tf.where(histogram > 0)[:, 0]))
    step = (tf.reduce_sum(histogram) - last_count) // 255
    lookup = (tf.cumsum(histogram) + step // 2) // tf.maximum(step, 1)
    lookup = tf.clip_by_value(tf.concat([[0], lookup[:-1]], 0), 0, 255)
    return tf.cast(tf.where(step > 0, tf.gather(lookup, channel), channel),
                   tf.uint8)
  return tf.stack([equalize_channel(image[..., c]) for c in range(3)], -1)


def invert(image):
  return 255 - image


def posterize(image, bits):
  """Only the top `bits` bits of every value kept. At 0 bits the top bit
  stays too: TensorFlow clamps a uint8 shift to 7, here as in big_vision's
  op."""
  shift = tf.cast(8 - bits, tf.uint8)
  return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def posterize_pil(image, bits):
  """PIL's posterize, which timm calls: as `posterize`, but 0 bits (or
  fewer) keep none, a black image, as PIL's mask does (Pillow 13 refuses 0
  bits)."""
  return tf.where(bits > 0, posterize(image, bits), tf.zeros_like(image))


def solarize(image, threshold):
  """Values at or above `threshold` inverted."""
  return tf.where(tf.cast(image, tf.int32) < threshold, image, 255 - image)


def solarize_add(image, addition, threshold: int = 128):
  """`addition` added (clipped) to values below `threshold`."""
  added = tf.cast(tf.clip_by_value(tf.cast(image, tf.int32) + addition, 0,
                                   255), tf.uint8)
  return tf.where(image < threshold, added, image)


def color(image, factor):
  """Saturation: blended with its own grey version."""
  grey = tf.image.grayscale_to_rgb(tf.image.rgb_to_grayscale(image))
  return blend(grey, image, factor)


def contrast(image, factor):
  """Blended with a flat grey image. The grey level is the recipe's: its
  implementation divides the sum of a 256-bin histogram (the pixel count)
  by 256 where PIL takes the mean grey level; kept, since that is the
  augmentation the published numbers were trained with."""
  pixel_count = tf.cast(tf.shape(image)[0] * tf.shape(image)[1], tf.float32)
  grey = tf.cast(tf.clip_by_value(pixel_count / 256.0, 0.0, 255.0), tf.uint8)
  return blend(tf.fill(tf.shape(image), grey), image, factor)


def mean_contrast(image, factor):
  """PIL's Contrast, which timm calls: blended with a flat image at the
  image's mean grey level, rounded half up."""
  grey = tf.reduce_mean(tf.cast(tf.image.rgb_to_grayscale(image), tf.float32))
  grey = tf.cast(tf.floor(grey + 0.5), tf.uint8)
  return blend(tf.fill(tf.shape(image), grey), image, factor)


def brightness(image, factor):
  """Blended with black."""
  return blend(tf.zeros_like(image), image, factor)


def sharpness(image, factor):
  """Blended with PIL's SMOOTH-filtered image (border pixels unfiltered)."""
  kernel = tf.constant([[1., 1., 1.], [1., 5., 1.], [1., 1., 1.]]) / 13.0
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
  smooth = tf.nn.depthwise_conv2d(tf.cast(image, tf.float32)[None], kernel,
                                  [1, 1, 1, 1], 'VALID')[0]
  smooth = tf.cast(tf.clip_by_value(smooth, 0.0, 255.0), tf.uint8)
  inside = tf.pad(tf.ones_like(smooth, tf.bool), [[1, 1], [1, 1], [0, 0]])
  smooth = tf.where(inside, tf.pad(smooth, [[1, 1], [1, 1], [0, 0]]), image)
  return blend(smooth, image, factor)


def cutout(image, half_size, center):
  """The square of side 2 x half_size around `center` (y, x), clipped to
  the image, filled with grey."""
  height, width = tf.shape(image)[0], tf.shape(image)[1]
  rows, cols = tf.range(height)[:, None], tf.range(width)[None, :]
  inside = ((rows >= center[0] - half_size) & (rows < center[0] + half_size) &
            (cols >= center[1] - half_size) & (cols < center[1] + half_size))
  return tf.where(inside[..., None], tf.constant(FILL, tf.uint8), image)


def _level64(magnitude, top, offset=0.0):
  # float64, the arithmetic of Python floats: a magnitude given as a number
  # yields the values big_vision's ops compute from it, to the bit.
  return tf.cast(magnitude, tf.float64) / MAX_MAGNITUDE * top + offset


def _level(magnitude, top, offset=0.0):
  """offset + magnitude / MAX_MAGNITUDE x top, a float32 scalar."""
  return tf.cast(_level64(magnitude, top, offset), tf.float32)


def _int_level(magnitude, top):
  """int(magnitude / MAX_MAGNITUDE x top), an int32 scalar."""
  return tf.cast(_level64(magnitude, top), tf.int32)


def _enhance_factor(magnitude):
  return _level(magnitude, 1.8, 0.1)


def _increasing_enhance_factor(magnitude, sign):
  """timm's: away from the identity 1 by up to 0.9, either way, >= 0.1."""
  return tf.maximum(0.1, 1.0 + sign * _level(magnitude, 0.9))


def _translate_fraction(image, magnitude, sign, axis):
  """timm's relative translation: up to TRANSLATE_FRACTION of the side."""
  side = tf.cast(tf.shape(image)[axis], tf.float32)
  return sign * _level(magnitude, TRANSLATE_FRACTION) * side


# Each op set lists its ops as (name, op(image, magnitude, sign, center)):
# `magnitude` a number or float64 scalar, `sign` -1 or +1 at random,
# `center` a random pixel (y, x).
#
# The first four ops of both sets, alike in both.
_SHARED_OPS = (
    ('AutoContrast', lambda im, m, sign, center: autocontrast(im)),
    ('Equalize', lambda im, m, sign, center: equalize(im)),
    ('Invert', lambda im, m, sign, center: invert(im)),
    ('Rotate', lambda im, m, sign, center: rotate(im, sign * _level(m, 30))),
)

# big_vision's 16 ops, in its order; enhancement factors run from 0.1 at
# magnitude 0 to 1.9 at 10.
OPS = _SHARED_OPS + (
    ('Posterize', lambda im, m, sign, center: posterize(
        im, _int_level(m, 4))),
    ('Solarize', lambda im, m, sign, center: solarize(
        im, _int_level(m, 256))),
    ('Color', lambda im, m, sign, center: color(im, _enhance_factor(m))),
    ('Contrast', lambda im, m, sign, center: contrast(im, _enhance_factor(m))),
    ('Brightness', lambda im, m, sign, center: brightness(
        im, _enhance_factor(m))),
    ('Sharpness', lambda im, m, sign, center: sharpness(
        im, _enhance_factor(m))),
    ('ShearX', lambda im, m, sign, center: shear_x(im, sign * _level(m, 0.3))),
    ('ShearY', lambda im, m, sign, center: shear_y(im, sign * _level(m, 0.3))),
    ('TranslateX', lambda im, m, sign, center: translate_x(
        im, sign * _level(m, TRANSLATE_PIXELS))),
    ('TranslateY', lambda im, m, sign, center: translate_y(
        im, sign * _level(m, TRANSLATE_PIXELS))),
    ('Cutout', lambda im, m, sign, center: cutout(
        im, _int_level(m, CUTOUT_HALF_SIZE), center)),
    ('SolarizeAdd', lambda im, m, sign, center: solarize_add(
        im, _int_level(m, 110))),
)

# timm's `inc1` set (`_RAND_INCREASING_TRANSFORMS`), in its order: 15 ops,
# no Cutout (timm leaves it to random erasing). Unlike big_vision's, every
# op grows more severe with the magnitude: Posterize keeps 4 bits at 0
# down to none at 10, Solarize's threshold falls from 256 to 0, and the
# enhancements move away from the identity by up to 0.9, either way.
# Translations reach 0.45 of the side (timm's `TranslateXRel`), and
# Contrast blends towards the mean grey level, as PIL's does.
TIMM_INCREASING_OPS = _SHARED_OPS + (
    ('PosterizeIncreasing', lambda im, m, sign, center: posterize_pil(
        im, 4 - _int_level(m, 4))),
    ('SolarizeIncreasing', lambda im, m, sign, center: solarize(
        im, 256 - _int_level(m, 256))),
    ('SolarizeAdd', lambda im, m, sign, center: solarize_add(
        im, _int_level(m, 110))),
    ('ColorIncreasing', lambda im, m, sign, center: color(
        im, _increasing_enhance_factor(m, sign))),
    ('ContrastIncreasing', lambda im, m, sign, center: mean_contrast(
        im, _increasing_enhance_factor(m, sign))),
    ('BrightnessIncreasing', lambda im, m, sign, center: brightness(
        im, _increasing_enhance_factor(m, sign))),
    ('SharpnessIncreasing', lambda im, m, sign, center: sharpness(
        im, _increasing_enhance_factor(m, sign))),
    ('ShearX', lambda im, m, sign, center: shear_x(im, sign * _level(m, 0.3))),
    ('ShearY', lambda im, m, sign, center: shear_y(im, sign * _level(m, 0.3))),
    ('TranslateXRel', lambda im, m, sign, center: translate_x(
        im, _translate_fraction(im, m, sign, 1))),
    ('TranslateYRel', lambda im, m, sign, center: translate_y(
        im, _translate_fraction(im, m, sign, 0))),
)

# By the names of the config key `randaug_ops`
# (input_pipeline.RANDAUG_OP_SETS).
OP_SETS = {'big_vision': OPS, 'timm_increasing': TIMM_INCREASING_OPS}


def layer_choices(seed, image_shape, num_ops: int = len(OPS)):
  """One layer's random choices from `seed` ([2] int): the op's index in
  its set of `num_ops`, the sign, and Cutout's centre (y, x)."""
  op_seed, sign_seed, y_seed, x_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 4))
  op = tf.random.stateless_uniform([], op_seed, 0, num_ops, tf.int32)
  sign = tf.where(tf.random.stateless_uniform([], sign_seed) < 0.5, -1.0, 1.0)
  center = tf.stack([
      tf.random.stateless_uniform([], y_seed, 0, image_shape[0], tf.int32),
      tf.random.stateless_uniform([], x_seed, 0, image_shape[1], tf.int32)])
  return op, sign, center


# layer_magnitude and layer_applied draw from seeds of their own, folded
# into the layer's: its op, sign and centre stay as without them.
def layer_magnitude(seed, magnitude: float, magnitude_std: float):
  """One layer's magnitude (float64 scalar): `magnitude`, or for
  magnitude_std > 0 a draw from Normal(magnitude, magnitude_std) clipped
  to [0, MAX_MAGNITUDE], as timm draws one per op it applies."""
  if not magnitude_std:
    return tf.constant(magnitude, tf.float64)
  noise = tf.random.stateless_normal(
      [], tf.random.experimental.stateless_fold_in(seed, 4), dtype=tf.float64)
  return tf.clip_by_value(magnitude + magnitude_std * noise, 0.0,
                          MAX_MAGNITUDE)


def layer_applied(seed, apply_prob: float):
  """Whether one layer applies its op: True with probability apply_prob."""
  return tf.random.stateless_uniform(
      [], tf.random.experimental.stateless_fold_in(seed, 5)) < apply_prob


def randaugment(image, seed, num_layers: int, magnitude: float,
                magnitude_std: float = 0.0, apply_prob: float = 1.0,
                op_set: str = 'big_vision'):
  """`num_layers` ops of OP_SETS[op_set], each chosen uniformly from
  `seed`'s stream and applied in turn to a uint8 RGB image, with
  probability `apply_prob`, at `layer_magnitude`."""
  ops = OP_SETS[op_set]
  for layer_seed in tf.unstack(
      tf.random.experimental.stateless_split(seed, num_layers)):
    op, sign, center = layer_choices(layer_seed, tf.shape(image), len(ops))
    layer_m = layer_magnitude(layer_seed, magnitude, magnitude_std)
    branches = [lambda fn=fn: fn(image, layer_m, sign, center)
                for _, fn in ops]
    if apply_prob < 1:
      # A layer that skips its op takes an extra branch, the identity.
      op = tf.where(layer_applied(layer_seed, apply_prob), op, len(ops))
      branches.append(lambda: image)
    image = tf.switch_case(op, branches)
  return image
