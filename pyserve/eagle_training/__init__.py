"""`pyserve train-eagle`: EAGLE-3 heads trained on a target's own answers (train.py)."""
