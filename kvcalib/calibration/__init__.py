"""Calibration: profile a model's KV activations on calibration text (see run.py)."""

from kvcalib.calibration.run import PHASES, Settings, calibrate, calibrate_model

__all__ = ["PHASES", "Settings", "calibrate", "calibrate_model"]
