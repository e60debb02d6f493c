"""A tiny llama calibrated in memory, as the calibration tests run it
(tests/toolkit/calibration/test_retrieval.py, test_answer_cut.py)."""

from pathlib import Path

from kvcalib.calibration import Settings, calibrate_model
from kvcalib.core.models import ModelSource
from kvcalib.core.profile import Profile
from support.tiny import CharTokenizer, tiny_model

SOURCE = ModelSource("tiny", Path("tiny"), "fingerprint-of-tiny")


def calibrate_tiny(folder: Path, settings: Settings, *, progress: bool = False) -> Profile:
    """A fresh tiny llama's profile in `folder` from 2 windows of 32 characters (CharTokenizer),
    under `settings`."""
    return calibrate_model(
        tiny_model("llama"),
        CharTokenizer(),
        folder,
        source=SOURCE,
        num_samples=2,
        seq_len=32,
        settings=settings,
        progress=progress,
    )
