"""BERT pretraining across mixed GPUs on top of hsync.WeightedDDP."""
