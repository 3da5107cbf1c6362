"""Prediction from measured memory: the device probes, the model fitted from them, the meter, the predictor.

- :mod:`~elastic_batches.memory.probe`: what a device says about its memory (:class:`MemoryProbe`,
  :class:`AcceleratorProbe` for CUDA and XPU, :func:`device_probe`, :func:`active_probe`);
- :mod:`~elastic_batches.memory.devices`: :class:`DevicesProbe`, the tightest of several devices
  (a model spread over them in one process) as one;
- :mod:`~elastic_batches.memory.model`: :class:`MemoryModel`, the bytes an attempt needs, fitted
  from the peaks measured around microbatches;
- :mod:`~elastic_batches.memory.meter`: the windows ``ElasticStep`` opens around each microbatch,
  which feed the model;
- :mod:`~elastic_batches.memory.predictor`: :class:`Predictor`, what a ``SplitController`` plans
  from the model and the ranks' vote.
"""

from elastic_batches.memory.devices import DevicesProbe, devices_probe
from elastic_batches.memory.model import RECOVER_AFTER, SPREAD, MemoryModel, check_margin, format_bytes
from elastic_batches.memory.predictor import Predictor
from elastic_batches.memory.probe import (
    AcceleratorProbe,
    MemoryProbe,
    MemoryReading,
    active_probe,
    check_memory,
    device_probe,
)

__all__ = [
    "RECOVER_AFTER",
    "SPREAD",
    "AcceleratorProbe",
    "DevicesProbe",
    "MemoryModel",
    "MemoryProbe",
    "MemoryReading",
    "Predictor",
    "active_probe",
    "check_margin",
    "check_memory",
    "device_probe",
    "devices_probe",
    "format_bytes",
]
