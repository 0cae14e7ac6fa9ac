"""Image data the tests write: `tiny_images` (a TFDS data set of PNG files
of many sizes), class folders of tiny images, and train and val image
folders of several formats and sizes."""

import os

import numpy as np
import PIL.Image
import tensorflow_datasets as tfds


TINY_SPLITS = {'train': 19, 'test': 7}


class TinyImages(tfds.core.GeneratorBasedBuilder):
  """PNG files `SPLIT/INDEX.png` from `manual_dir`; an image's label is its
  index, so labels name examples."""

  VERSION = tfds.core.Version('1.0.0')
  MANUAL_DOWNLOAD_INSTRUCTIONS = 'The PNG files written by the test.'

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3)),
            'label': tfds.features.ClassLabel(
                num_classes=max(TINY_SPLITS.values())),
        }),
        supervised_keys=('image', 'label'))

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(dl_manager.manual_dir / split)
            for split in TINY_SPLITS}

  def _generate_examples(self, directory):
    for path in directory.iterdir():
      index = int(path.stem)
      yield index, {'image': path, 'label': index}


def prepare_tiny_images(tmp_path_factory, file_format='tfrecord'):
  """(TFDS data dir, PNG directory): `tiny_images` prepared by TFDS from
  PNG files of many sizes written here, as `file_format` files."""
  source = tmp_path_factory.mktemp('pngs')
  rng = np.random.default_rng(0)
  for split, count in TINY_SPLITS.items():
    os.makedirs(source / split)
    for index in range(count):
      shape = (rng.integers(12, 40), rng.integers(12, 40), 3)
      PIL.Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(
          source / split / f'{index}.png')
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  # Four record files per split: batches of 8 come from up to 4 shards.
  TinyImages(data_dir=data_dir, file_format=file_format).download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=str(source),
                                                   num_shards=4))
  return data_dir, source


def write_class_folders(root, names, per_class, seed):
  """root/<name>/img_<k>.png, tiny RGB images; returns the paths by class."""
  rng = np.random.default_rng(seed)
  paths = {}
  for name in names:
    os.makedirs(os.path.join(root, name))
    paths[name] = []
    for _ in range(per_class):
      path = os.path.join(root, name, f'img_{rng.integers(10**8):08d}.png')
      PIL.Image.fromarray(rng.integers(0, 256, (10, 10, 3), np.uint8)).save(
          path)
      paths[name].append(path)
  return paths


# ------------------------------------------------------- image folders

# Written out of order: labels follow the sorted names, not this order.
CLASSES = ('zebra', 'cat', 'Dog')
SORTED_CLASSES = ('Dog', 'cat', 'zebra')  # sorted() order, as torchvision's
# Lossless formats (the reference decodes them with Pillow), and JPEG.
FORMATS = {'png': 'PNG', 'bmp': 'BMP', 'gif': 'GIF', 'webp': 'WEBP',
           'JPEG': 'JPEG'}


def image_pixels(rng, height, width) -> np.ndarray:
  """Smooth random RGB content (GIF's 256-colour palette keeps it)."""
  small = rng.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3),
                       dtype=np.uint8)
  return np.asarray(PIL.Image.fromarray(small).resize(
      (width, height), PIL.Image.Resampling.NEAREST))


def save_image(path, pixels: np.ndarray, mode: str = 'RGB'):
  extension = os.path.splitext(path)[1][1:]
  image = PIL.Image.fromarray(pixels).convert(mode)
  options = {'lossless': True} if extension == 'webp' else {}
  image.save(path, FORMATS[extension], **options)


def write_folders(root, per_class=(8, 3), corrupt=False, extras=True,
                  seed=0) -> dict:
  """ROOT/train/<class>/ and ROOT/val/<class>/ of `per_class` images each,
  in every format in turn (odd sizes, a grey and an RGBA one); optionally
  a corrupt JPEG, and files that are not images. Returns
  {path: RGB pixels as Pillow decodes them}."""
  rng = np.random.default_rng(seed)
  written = {}
  for split, count in zip(('train', 'val'), per_class):
    for label, name in enumerate(CLASSES):
      directory = os.path.join(root, split, name)
      os.makedirs(directory)
      for i in range(count):
        extension = list(FORMATS)[(i + label) % len(FORMATS)]
        path = os.path.join(directory, f'{i:03d}.{extension}')
        mode = 'L' if i == 1 else 'RGBA' if (
            i == 2 and extension in ('png', 'webp')) else 'RGB'
        save_image(path, image_pixels(rng, 20 + 3 * i, 26 + 2 * label), mode)
        written[path] = np.asarray(PIL.Image.open(path).convert('RGB'))
  if corrupt:
    with open(os.path.join(root, 'train', 'cat', '000a.jpg'), 'wb') as f:
      f.write(b'\xff\xd8\xff\xe0 not really a JPEG')
  if extras:
    with open(os.path.join(root, 'train', 'cat', 'notes.txt'), 'w') as f:
      f.write('not an image')
    with open(os.path.join(root, 'val', 'zebra', '.DS_Store'), 'w') as f:
      f.write('')
  return written

