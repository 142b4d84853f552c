"""The training program, `python -m train.main`: regenerate → train → calibrate → export.

`train/config.py` holds every setting (`TrainConfig`); presets live in `configs/`; the
stages (`train/stages.py`) are each resumable. See README "Train a drafter".
"""
