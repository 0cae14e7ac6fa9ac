"""Examples/s, achieved FLOP/s and model FLOPs utilisation (MFU) of a run.

MFU is the model FLOPs of a step (`training/flop_count.py`: every layer
counted once, no remat recomputation) per second, over the peak dense
bfloat16 matrix throughput of the devices. A float32 run is measured against
the same bfloat16 peak, so its MFU shows what half precision would gain.
"""

# Peak dense bfloat16 FLOP/s of one device (one chip; one GPU), from the
# vendors' data sheets, by a substring of `jax.Device.device_kind`. Ordered
# so that the first match is the right one ('TPU v5 lite' before 'TPU v5').
PEAK_BF16_FLOPS_PER_SECOND = (
    ('TPU v4', 275e12),
    ('TPU v5 lite', 197e12),  # v5e
    ('TPU v5e', 197e12),
    ('TPU v5p', 459e12),
    ('TPU v5', 459e12),
    ('TPU v6 lite', 918e12),  # v6e (Trillium)
    ('TPU v6e', 918e12),
    ('A100', 312e12),
    ('H100', 989e12),  # SXM; the PCIe card is slower and reports 'H100 PCIe'
    ('H200', 989e12),
)
_SLOWER_VARIANTS = {'H100 PCIe': 756e12}


def peak_flops_per_second(device_kind: str):
  """Peak dense bfloat16 FLOP/s of one device of this kind, or None."""
  for name, peak in _SLOWER_VARIANTS.items():
    if name in device_kind:
      return peak
  for name, peak in PEAK_BF16_FLOPS_PER_SECOND:
    if name in device_kind:
      return peak
  return None


def throughput_metrics(steps_per_second: float, batch_size: int,
                       step_flops: float, devices) -> dict:
  """`examples_per_second`, `flops_per_second` (all devices together),
  `flops_per_second_per_device` and, for devices of known peak, `mfu`, from
  the measured steps/s of a step over `devices`."""
  metrics = {'examples_per_second': steps_per_second * batch_size,
             'flops_per_second': steps_per_second * step_flops}
  metrics['flops_per_second_per_device'] = (metrics['flops_per_second'] /
                                            len(devices))
  peak = peak_flops_per_second(devices[0].device_kind)
  if peak is not None:
    metrics['mfu'] = metrics['flops_per_second'] / (peak * len(devices))
  return metrics


def console_fields(summary: dict) -> list[str]:
  """A logged step's throughput as the console shows it: images/s,
  TFLOP/s per device and, where the device's peak is known, MFU."""
  fields = [f'{summary["examples_per_second"]:,.0f} images/s',
            f'{summary["flops_per_second_per_device"] / 1e12:.3g} '
            'TFLOP/s/device']
  if 'mfu' in summary:
    fields.append(f'MFU {100 * summary["mfu"]:.1f}%')
  return fields
