"""Eight host CPU devices for every test; the repository root on sys.path."""

import os
import sys

# Must happen before jax is imported anywhere.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
# gcsfs reads this when imported: by default it asks GCS's gRPC storage
# control API for each bucket's layout, which the GCS emulator that
# tests/gcs_emulator.py starts does not serve.
os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'] = 'false'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
