"""Calibration: profile a model's KV activations on calibration text (see run.py)."""

from kvcalib.calibration.run import PHASES, SEQ_LEN, Settings, calibrate, calibrate_model

__all__ = ["PHASES", "SEQ_LEN", "Settings", "calibrate", "calibrate_model"]
