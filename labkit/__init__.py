"""labkit: the instruments of the Fit the Model workbook (meters, models, data, plots, widgets, results)."""

from labkit.device import DEVICE_CHOICES, hardware_report, resolve_device, synchronize
from labkit.estimate import MemoryEstimate, estimate_training_memory, example_batch
from labkit.example import RunningExample, running_example
from labkit.runmode import in_kernel, is_batch
from labkit.meter import CATEGORIES, PHASES, FitResult, MemoryMeter, OutOfMemory, format_bytes, try_fit
from labkit.models import GPT, MLP, GPTConfig, MLPConfig, build_model, count_params
from labkit.progress import progress
from labkit.results import record, recorded
from labkit.tables import print_rows
from labkit.throughput import Throughput, measure_throughput, measure_throughputs
from labkit.train import make_optimizer, measure_step, seeded_model, train_step
from labkit.validate import ParameterError

__all__ = [
    "CATEGORIES", "DEVICE_CHOICES", "FitResult", "GPT", "GPTConfig", "MLP", "MLPConfig", "MemoryEstimate",
    "MemoryMeter", "OutOfMemory", "PHASES", "ParameterError", "RunningExample", "Throughput", "build_model",
    "count_params", "estimate_training_memory", "example_batch", "format_bytes", "hardware_report",
    "in_kernel", "is_batch", "make_optimizer", "measure_step", "measure_throughput", "measure_throughputs",
    "print_rows", "progress", "record", "recorded", "resolve_device", "running_example", "seeded_model", "synchronize",
    "train_step", "try_fit",
]
