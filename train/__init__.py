"""The training program (`python -m train.main`) is not implemented yet; see README "Status"."""
