"""Drafter training configs (`python -m experiments.train_drafter --config=configs/train/X.py`)."""
